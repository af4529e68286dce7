"""DataCursor: the deterministic, resumable order of training prompts (shuffled per epoch).

Every prompt handed out gets a uid: its position in the endless, epoch-shuffled stream of rows. So
the same row in two epochs (or twice in one step, when a step crosses an epoch boundary) is two
prompts, with their own seeds, episode ids and GRPO groups. Prompts handed out but not trained (in
flight at a kill, or cancelled as too stale) are given out again (`retry`, or `requeue` in the
state), first and with a new attempt number, so that over a run each position is trained exactly once.

State (stored with each learner checkpoint, `state()` / `from_state`): {"next": the first position
never handed out, "requeue": positions handed out but not trained, "rows": the number of training rows,
"fingerprint": `fingerprint(rows)`}. Positions mean something only for the rows they were handed out
from, so `from_state` refuses rows with another fingerprint (unless forced); a state without one (older
runs) is accepted as is. A plain int (older runs) means {"next": it, "requeue": []}.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from typing import Any

from agentloop.errors import ConfigError
from agentloop.records import Sample


def fingerprint(samples: list[Sample]) -> str:
    """sha256 of the rows in order (each row's JSON, index included) and their number: the same rows read
    the same way give the same value on every machine; another file, another order, another
    `data.max_samples`, `data.prompt_key` or held-out slice give another."""
    h = hashlib.sha256(f"{len(samples)}\n".encode())
    for s in samples:
        h.update(s.model_dump_json().encode())
        h.update(b"\n")
    return "sha256:" + h.hexdigest()


class DataMismatchError(ConfigError):
    """A resumed run's training rows are not those its stored data position was handed out from."""


class DataCursor:
    """Prompts in a per-epoch shuffled order; `position` counts positions handed out (resumable)."""

    def __init__(self, samples: list[Sample], seed: int, position: int = 0, requeue: list[int] | None = None):
        if not samples:
            raise ConfigError("the training set is empty")
        self.samples = samples
        self.seed = seed
        self.position = position
        self._retry: deque[tuple[int, int]] = deque((int(u), 1) for u in (requeue or []))
        self._orders: dict[int, list[int]] = {}
        self._fingerprint: str | None = None

    @property
    def fingerprint(self) -> str:
        """`fingerprint(self.samples)`, computed once."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.samples)
        return self._fingerprint

    @classmethod
    def from_state(cls, samples: list[Sample], seed: int, state: Any, *, source: str = "the training data",
                   force: bool = False) -> "DataCursor":
        """The cursor a stored state describes, over `samples` (read from `source`, named in errors).
        DataMismatchError if the state was stored for other rows, unless `force`: then the stored positions
        go on over the new rows."""
        if state is None:
            return cls(samples, seed)
        if isinstance(state, int):
            return cls(samples, seed, position=state)
        if isinstance(state, dict) and isinstance(state.get("next"), int):
            cur = cls(samples, seed, position=state["next"], requeue=list(state.get("requeue") or []))
            stored = state.get("fingerprint")
            if stored is not None and stored != cur.fingerprint and not force:
                raise DataMismatchError(
                    f"the training data changed since this run's checkpoint: {source} gives {len(samples)} rows "
                    f"({cur.fingerprint[:19]}...), the checkpoint's data position was stored for "
                    f"{state.get('rows', '?')} rows ({str(stored)[:19]}...); resume with the same data "
                    "(file, data.max_samples, data.prompt_key, held-out slice), or pass --force-data to go on from "
                    "the stored position over the new rows")
            return cur
        raise ConfigError(f"unreadable data position in the checkpoint: {state!r}")

    def state(self, untrained: list[int] | None = None) -> dict[str, Any]:
        """What a checkpoint stores: the next new position, the positions handed out but not trained
        (`untrained`, plus those still waiting to be given out again), and which rows they index."""
        pending = sorted(set(untrained or []) | {u for u, _ in self._retry})
        return {"next": self.position, "requeue": pending, "rows": len(self.samples),
                "fingerprint": self.fingerprint}

    def matches(self, state: Any) -> bool:
        """Whether a stored state was handed out from these rows (True when it records no fingerprint)."""
        stored = state.get("fingerprint") if isinstance(state, dict) else None
        return stored is None or stored == self.fingerprint

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.samples)))
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is all a run needs
        return order

    def sample_at(self, position: int, attempt: int = 0) -> Sample:
        """The prompt at a stream position, with its uid (and attempt) set."""
        epoch, k = divmod(position, len(self.samples))
        return self.samples[self._order(epoch)[k]].model_copy(update={"uid": position, "attempt": attempt})

    def take(self, n: int) -> list[Sample]:
        """The next n prompts: those to give out again first, then new positions."""
        out = []
        for _ in range(n):
            if self._retry:
                uid, attempt = self._retry.popleft()
                out.append(self.sample_at(uid, attempt))
            else:
                out.append(self.sample_at(self.position))
                self.position += 1
        return out

    def retry(self, sample: Sample) -> None:
        """Give this prompt out again (its group was cancelled), before any new position."""
        if sample.uid is None:
            raise ValueError("retry() needs a prompt handed out by this cursor (uid set)")
        self._retry.append((sample.uid, sample.attempt + 1))

    @property
    def pending_retries(self) -> int:
        return len(self._retry)

    def handed_out_untrained(self, uid: int) -> bool:
        """Whether position `uid` is still to be trained: waiting to be given out again, or not handed out yet
        (at or past `position`). False: trained (or dropped for good) before the stored state was made."""
        return uid >= self.position or any(u == uid for u, _ in self._retry)
