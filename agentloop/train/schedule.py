"""The asynchronous schedule's control logic, as plain synchronous classes (no event loop, no I/O).

    Staleness        the rule: a token trained at step s may come from weights at most η versions older
                     than the weights step s starts from (s - 1); an episode is judged by its oldest token
    Admission        how many new prompts may start now: at most (η + v − v0 + 1)·B − (accepted + running),
                     v = the version the servers serve, B = prompts per step (AReaL's and SkyRL's rule);
                     v0 = the version counting began at (0, or C for a run resumed after step C)
    GroupBuffer      finished groups waiting for the learner; the next batch is the B oldest eligible
                     ones; groups that can never be trained any more are handed back to be cancelled

With η = 0 the three reproduce the synchronous schedule exactly: B prompts are admitted for version v,
the batch is exactly those B groups, and nothing more starts until version v + 1 is served.

Versions: v = weights after v learner updates (the initial weights are 0). Step s trains the weights
of version s - 1 into version s. A group can join step s only if its oldest token version is at least
s - 1 - η.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Staleness:
    """The bound η (`train.max_staleness`)."""

    max_staleness: int

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def min_version(self, step: int) -> int:
        """The oldest token version step `step` may train on."""
        return step - 1 - self.max_staleness

    def trainable(self, oldest_version: int | None, step: int) -> bool:
        """A group whose oldest token is `oldest_version` may join step `step` (unknown: yes)."""
        return oldest_version is None or oldest_version >= self.min_version(step)

    def lag(self, token_version: int, step: int) -> int:
        """How many versions older than step `step`'s starting weights a token is."""
        return (step - 1) - token_version


@dataclass
class Admission:
    """How many prompts may start now (a prompt = one GRPO group of n episodes).

    `accepted` counts groups that finished and were kept (buffered or trained), `running` those in
    flight; cancelled groups count in neither, so their room is given again. `total` caps admissions
    at what the run still needs.

    `base_version`: the version the servers served when counting began. A run resumed after step C
    starts counting at C with nothing accepted, so the cap counts versions from there: the groups of
    steps 1..C were trained by an earlier process and are in no counter here. Without it a resumed run
    would admit C·B groups more than a fresh one for the rest of the run (and η = 0 would stop being
    the synchronous schedule).
    """

    batch_size: int
    max_staleness: int
    total: int | None = None
    base_version: int = 0
    accepted: int = 0
    running: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.base_version < 0:
            raise ValueError(f"base_version must be >= 0, got {self.base_version}")

    def allowed(self, version: int) -> int:
        """New prompts that may start while the servers serve `version`."""
        if version < self.base_version:
            raise ValueError(f"version {version} is older than the version admission started at ({self.base_version})")
        cap = (self.max_staleness + version - self.base_version + 1) * self.batch_size
        if self.total is not None:
            cap = min(cap, self.total)
        return max(0, cap - (self.accepted + self.running))

    def started(self, k: int = 1) -> None:
        self.running += k

    def finished(self, kept: bool) -> None:
        """A running group ended: kept (complete, goes to the buffer) or not (cancelled)."""
        if self.running <= 0:
            raise RuntimeError("finished() without a running group")
        self.running -= 1
        if kept:
            self.accepted += 1

    def dropped(self) -> None:
        """A kept group was later cancelled from the buffer (too stale): its room is given again."""
        if self.accepted <= 0:
            raise RuntimeError("dropped() without an accepted group")
        self.accepted -= 1


@dataclass
class _Entry(Generic[T]):
    key: int
    oldest: int | None
    item: T
    order: int


@dataclass
class GroupBuffer(Generic[T]):
    """Finished groups waiting for a batch, keyed by group uid."""

    staleness: Staleness
    _entries: dict[int, _Entry[T]] = field(default_factory=dict)
    _order: int = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: int, oldest_version: int | None, item: T) -> None:
        if key in self._entries:
            raise ValueError(f"group {key} is already buffered")
        self._entries[key] = _Entry(key, oldest_version, item, self._order)
        self._order += 1

    def eligible(self, step: int) -> int:
        return sum(self.staleness.trainable(e.oldest, step) for e in self._entries.values())

    def take(self, step: int, n: int) -> list[T] | None:
        """The batch of step `step`: n eligible groups, oldest version first, then in finishing order,
        returned in uid order (so the learner sees the same batch however they finished). None if fewer
        than n are eligible."""
        ok = [e for e in self._entries.values() if self.staleness.trainable(e.oldest, step)]
        if len(ok) < n:
            return None
        ok.sort(key=lambda e: (e.oldest if e.oldest is not None else -1, e.order))
        chosen = sorted(ok[:n], key=lambda e: e.key)
        for e in chosen:
            del self._entries[e.key]
        return [e.item for e in chosen]

    def evict_stale(self, next_step: int) -> list[T]:
        """Groups that can no longer join step `next_step` or any later one."""
        out = [e for e in self._entries.values() if not self.staleness.trainable(e.oldest, next_step)]
        for e in out:
            del self._entries[e.key]
        return [e.item for e in sorted(out, key=lambda e: e.key)]
