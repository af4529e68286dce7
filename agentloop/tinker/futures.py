"""The futures mechanism: every training and sampling call answers at once with a request id; the SDK then polls
`/api/v1/retrieve_future` until the result is there.

    FutureStore     request id -> its outcome (a JSON body, protobuf bytes, or an error); `wait` is a long poll:
                    it returns the outcome, or None after `poll_s` (the handler then answers `try_again`, and the
                    SDK asks again at once), so a result reaches the client as soon as it exists without a busy loop
    SeqOrder        a training model's request order: the SDK numbers a model's requests 1, 2, ... (seq_id) and may
                    send them out of order (forward_backward chunks in parallel, the first last); each waits for its
                    turn, and a turn not taken within `gap_s` fails the waiting request, naming the missing seq_id

Invariant: every id `create` hands out gets exactly one outcome (a handler's task sets it in `finally`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from agentloop.tinker.wire import ErrorCategory, error_body


@dataclass
class Outcome:
    """A finished request: `proto` bytes (ForwardBackwardOutput, SampleResponse) or a `json` body."""

    json: dict[str, Any] | None = None
    proto: bytes | None = None


@dataclass
class _Entry:
    kind: str
    created: float = field(default_factory=time.monotonic)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None


class FutureStore:
    """Request ids and their outcomes (module doc)."""

    def __init__(self, keep: int = 10000):
        self._ids = itertools.count(1)
        self._entries: dict[str, _Entry] = {}
        self.keep = keep

    def create(self, kind: str) -> str:
        rid = f"req-{next(self._ids)}"
        self._entries[rid] = _Entry(kind)
        if len(self._entries) > self.keep:  # forget the oldest finished ones
            for old in [k for k, e in self._entries.items() if e.done.is_set()][: len(self._entries) - self.keep]:
                del self._entries[old]
        return rid

    def finish(self, rid: str, outcome: Outcome) -> None:
        e = self._entries[rid]
        if e.outcome is None:
            e.outcome = outcome
            e.done.set()

    def fail(self, rid: str, message: str, category: ErrorCategory = "user") -> None:
        body = error_body(message, category)
        self.finish(rid, Outcome(json={"error": body["error"], "category": body["category"]}))

    def known(self, rid: str) -> bool:
        return rid in self._entries

    async def wait(self, rid: str, poll_s: float) -> Outcome | None:
        e = self._entries[rid]
        try:
            await asyncio.wait_for(e.done.wait(), timeout=poll_s)
        except asyncio.TimeoutError:
            return None
        return e.outcome

    def pending(self) -> int:
        return sum(1 for e in self._entries.values() if not e.done.is_set())


class SeqOrder:
    """One model's turn-taking by seq_id (module doc)."""

    def __init__(self, first: int = 1, gap_s: float = 300.0):
        self.next = first
        self.gap_s = gap_s
        self._cond = asyncio.Condition()

    async def turn(self, seq_id: int | None) -> None:
        """Wait until `seq_id` is next (None: no order, go now)."""
        if seq_id is None:
            return
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self.next >= seq_id), timeout=self.gap_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"request seq_id {seq_id} waited {self.gap_s:.0f}s for seq_id {self.next}, which "
                                   "never came (a client lost a request?)") from None

    async def done(self, seq_id: int | None) -> None:
        if seq_id is None:
            return
        async with self._cond:
            self.next = max(self.next, seq_id + 1)
            self._cond.notify_all()
