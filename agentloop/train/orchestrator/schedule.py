"""The asynchronous schedule's control logic, as plain synchronous classes (no event loop, no I/O).

    Staleness        the rule: a token trained at step s may come from weights at most η versions older
                     than the weights step s starts from (s - 1); an episode is judged by its oldest token
    Admission        how many new prompts may start now: at most (η + v − v0 + 1)·B − (accepted + running),
                     v = the version the servers serve, B = prompts per step (AReaL's and SkyRL's rule);
                     v0 = the version counting began at (0, or C for a run resumed after step C)
    GroupBuffer      finished groups waiting for the learner; the next batch is the B oldest eligible
                     ones; groups that can never be trained any more are handed back to be cancelled
    AsyncSchedule    the three above as one object the orchestrator drives: it consumes events (a group
                     finished, a step begins, a version was pushed) and answers with commands (admit k
                     prompts, give a prompt out again, cancel a running group, the batch of a step);
                     every admitted group ends exactly once, as trained, cancelled or dropped

With η = 0 the three reproduce the synchronous schedule exactly: B prompts are admitted for version v,
the batch is exactly those B groups, and nothing more starts until version v + 1 is served.

Versions: v = weights after v learner updates (the initial weights are 0). Step s trains the weights
of version s - 1 into version s. A group can join step s only if its oldest token version is at least
s - 1 - η.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

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


# ---------------------------------------------------------------------------- the schedule as one object


class Prompt(Protocol):
    """What the schedule reads of a dispatched prompt (agentloop.records.Sample)."""

    @property
    def group_uid(self) -> int: ...

    @property
    def attempt(self) -> int: ...


class Finished(Protocol):
    """What the schedule reads of a group that left the stream (agentloop.rollout.engine.GroupOutcome)."""

    sample: Any
    """The dispatched prompt (a `Prompt`)."""
    n: int
    cancelled: str | None

    @property
    def oldest_version(self) -> int | None: ...


@dataclass(frozen=True)
class Retry:
    """Command: give this prompt out again (before any new one), with its next attempt number."""

    sample: Any


@dataclass(frozen=True)
class Cancel:
    """Command: cancel this running group (it can no longer be trained); it comes out cancelled."""

    uid: int
    reason: str


Command = Retry | Cancel


class AsyncSchedule(Generic[T]):
    """The asynchronous schedule's control logic (train.schedule=async), with no event loop and no I/O.
    Groups (T) are `Finished` objects: agentloop.rollout.engine.GroupOutcome in a run.

    The orchestrator reports events and carries out the commands returned:
        admit()                     how many new prompts may start now (then `started` with each one)
        group_done(out, ...)        a group left the stream: buffered, or cancelled/dropped ([Retry] or [])
        step_begins(step, running)  groups that can no longer join this step or a later one: buffered ones
                                    are evicted ([Retry]), running ones whose first tokens are too old are
                                    cancelled ([Cancel])
        take(step)                  the step's batch (B groups, oldest version first) or None: not yet
        version_pushed(v)           the servers serve version v now (admission grows)
        end()                       the run is ending: nothing is given out again any more
    Accounting: every admitted group ends exactly once, as trained (in a batch), cancelled (stale or other:
    `groups_cancelled`, its prompt given out again unless the run is ending) or dropped for an
    infrastructure failure (`groups_dropped_infra`, given out again up to `infra_retries` attempts).
    `untrained()` is what a checkpoint stores as handed out but not trained.
    """

    def __init__(self, batch_size: int, max_staleness: int, *, total: int, first_step: int = 1,
                 infra_retries: int = 2):
        self.batch_size = batch_size
        self.staleness = Staleness(max_staleness)
        # A resumed run counts admissions from the version it starts at, so it keeps exactly the groups in
        # flight that a fresh run keeps at that point (η = 0: the synchronous schedule again).
        self.admission = Admission(batch_size, max_staleness, total=total, base_version=first_step - 1)
        self.buffer: GroupBuffer[T] = GroupBuffer(self.staleness)
        self.version = first_step - 1
        """The version the servers serve."""
        self.next_step = first_step
        """The step the next batch is for (a finished group too stale for it is not kept)."""
        self.infra_retries = infra_retries
        self.ending = False
        self.counts: Counter[str] = Counter()
        self._handed_out: set[int] = set()

    # ------------------------------------------------------------------ events

    def admit(self) -> int:
        """Prompts that may start now (0 once the run is ending)."""
        return 0 if self.ending else self.admission.allowed(self.version)

    def started(self, sample: Prompt) -> None:
        """A prompt `admit` allowed was submitted to the stream."""
        self.admission.started()
        self._handed_out.add(sample.group_uid)

    def group_done(self, out: T, *, complete: bool, continued: int = 0) -> list[Command]:
        """A group left the stream (`out`, a `Finished`): `complete`: every record of it may be trained (no
        infrastructure failure); `continued`: its episodes that a weight update interrupted and that were
        continued."""
        finished: Finished = out  # type: ignore[assignment]
        if finished.cancelled is not None:
            self.admission.finished(kept=False)
            return self._give_back(finished, "stale" if finished.cancelled.startswith("stale") else "other")
        if not complete:
            self.admission.finished(kept=False)
            return self._drop_infra(finished)
        if not self.staleness.trainable(finished.oldest_version, self.next_step):
            self.admission.finished(kept=False)
            return self._give_back(finished, "stale")
        self.admission.finished(kept=True)
        self.counts["episodes_continued"] += continued
        self.buffer.add(finished.sample.group_uid, finished.oldest_version, out)
        return []

    def step_begins(self, step: int, running: Mapping[int, int | None]) -> list[Command]:
        """Step `step`'s batch is wanted next. `running`: uid -> the version a running group started at (None: not
        started yet)."""
        self.next_step = step
        cmds: list[Command] = []
        for item in self.buffer.evict_stale(step):
            self.admission.dropped()
            cmds += self._give_back(item, "stale")
        floor = self.staleness.min_version(step)
        for uid, v in running.items():
            if v is not None and v < floor:
                cmds.append(Cancel(uid, f"stale: started at version {v}, step {step} needs >= {floor}"))
        return cmds

    def take(self, step: int) -> list[T] | None:
        """The batch of `step` (B groups), or None while fewer are eligible. Taken groups are trained; from now
        on a finished group must be trainable at step + 1 to be kept."""
        groups = self.buffer.take(step, self.batch_size)
        if groups is not None:
            for g in groups:
                self._handed_out.discard(g.sample.group_uid)  # type: ignore[attr-defined]
            self.next_step = step + 1
        return groups

    def version_pushed(self, version: int) -> None:
        self.version = version

    def end(self) -> None:
        self.ending = True

    # ------------------------------------------------------------------ state

    def untrained(self) -> list[int]:
        """uids handed out and not trained (a checkpoint's data state gives them out again on resume)."""
        return sorted(self._handed_out)

    def __len__(self) -> int:
        """Groups buffered."""
        return len(self.buffer)

    def since(self, seen: Mapping[str, int], keys: Iterable[str]) -> dict[str, int]:
        """Counts of `keys` since the snapshot `seen` (a copy of `counts` taken earlier)."""
        return {k: self.counts.get(k, 0) - seen.get(k, 0) for k in keys}

    # ------------------------------------------------------------------ internals

    def _give_back(self, finished: Any, reason: str) -> list[Command]:
        self.counts["groups_cancelled"] += 1
        self.counts["episodes_cancelled"] += finished.n
        self.counts[f"cancelled_{reason}"] += 1
        return [] if self.ending else [Retry(finished.sample)]

    def _drop_infra(self, finished: Any) -> list[Command]:
        """A group with an infrastructure failure is never trained partial: its prompt is given out again (fresh
        seeds), at most `infra_retries` attempts (a prompt that always fails, say one too long for the context,
        would else come back forever)."""
        self.counts["groups_dropped_infra"] += 1
        if not self.ending and finished.sample.attempt < self.infra_retries:
            return [Retry(finished.sample)]
        self._handed_out.discard(finished.sample.group_uid)
        return []
