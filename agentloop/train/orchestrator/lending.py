"""When lent servers sleep and wake (server.lend_learner_gpus): servers on the learner's GPUs take episodes while
the learner waits for a batch, and give their memory back while it trains. Plain synchronous control (no event loop,
no I/O): `LendSchedule` answers each step event with what to do; `Lender` carries that out on the ServerManager.

    LendSchedule.before_train()          the batch is ready, the learner is about to train on it: "sleep" (drain
                                         the lent servers, release their memory) unless they sleep already
    LendSchedule.may_train()             the learner may start (every lent server asleep)
    LendSchedule.after_update(ready)     the step's weights are in every server: "wake", unless the next batch is
                                         ready already (`ready`: the learner trains again at once, so waking
                                         would only drain them again)
States: awake -> sleeping -> asleep -> waking -> awake. A transition out of turn raises (a bug, never skipped):
the learner must never train beside a lent server that holds its KV cache (it would not fit), and a lent server
must never serve before the step's weights reached it (it would sample under the old version, where the push
did not reach it: the tags release its weights).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

State = Literal["awake", "sleeping", "asleep", "waking"]


class LendSchedule:
    """The sleep/wake state of the lent servers (module doc)."""

    def __init__(self, n_lent: int):
        self.n_lent = n_lent
        self.state: State = "awake"
        self.sleeps = 0
        self.wakes = 0
        self.kept_asleep = 0
        """Steps after which the lent servers stayed asleep (the next batch was ready)."""

    def _move(self, frm: State, to: State) -> None:
        if self.state != frm:
            raise RuntimeError(f"lent servers: {frm} -> {to} asked while {self.state}")
        self.state = to

    def before_train(self) -> Literal["sleep"] | None:
        if not self.n_lent or self.state == "asleep":
            return None
        self._move("awake", "sleeping")
        return "sleep"

    def slept(self) -> None:
        self._move("sleeping", "asleep")
        self.sleeps += 1

    def may_train(self) -> bool:
        return not self.n_lent or self.state == "asleep"

    def after_update(self, next_batch_ready: bool = False) -> Literal["wake"] | None:
        if not self.n_lent:
            return None
        if self.state != "asleep":
            raise RuntimeError(f"lent servers: the update ended while they were {self.state}, not asleep")
        if next_batch_ready:
            self.kept_asleep += 1
            return None
        self._move("asleep", "waking")
        return "wake"

    def woken(self) -> None:
        self._move("waking", "awake")
        self.wakes += 1

    def metrics(self) -> dict[str, float]:
        return {"lend/asleep": float(self.state == "asleep"), "lend/sleeps": float(self.sleeps),
                "lend/wakes": float(self.wakes), "lend/kept_asleep": float(self.kept_asleep)}


class Lender:
    """Carries out a LendSchedule's answers on a ServerManager (`sleep_servers` / `wake_servers`)."""

    def __init__(self, sm: Any, urls: Sequence[str], *, release: bool = True, tags: Sequence[str] = ("kv_cache",)):
        self.sm = sm
        self.urls = list(urls)
        self.release = release
        self.tags = tuple(tags)
        self.schedule = LendSchedule(len(self.urls))
        self.sleep_s = 0.0
        """Seconds the last step spent putting the lent servers to sleep."""
        self.wake_s = 0.0

    async def before_train(self) -> None:

        t0 = time.monotonic()
        if self.schedule.before_train() == "sleep":
            await self.sm.sleep_servers(self.urls, release=self.release, tags=self.tags)
            self.schedule.slept()
        if not self.schedule.may_train():
            raise RuntimeError("lent servers are not asleep: the learner must not train beside them")
        self.sleep_s = time.monotonic() - t0

    async def after_update(self, next_batch_ready: bool = False) -> None:

        t0 = time.monotonic()
        if self.schedule.after_update(next_batch_ready) == "wake":
            await self.sm.wake_servers(self.urls, release=self.release, tags=self.tags)
            self.schedule.woken()
        self.wake_s = time.monotonic() - t0

    def metrics(self) -> dict[str, float]:
        return {**self.schedule.metrics(), "time/lend_sleep_s": self.sleep_s, "time/lend_wake_s": self.wake_s}


__all__ = ["LendSchedule", "Lender"]
