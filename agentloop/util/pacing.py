"""Pacing episode work on the event loop, so thousands of episodes never starve timers and I/O.

asyncio runs every callback that is ready at the start of an iteration before it looks at timers and sockets
again. When 10,000 episodes start at once, or a thousand responses land in one poll, every one of their steps
(template, tokenize, parse, build the next request) runs in that one iteration: the loop is blind for seconds
(measured: 4.8 s of lag for 1,000 three-turn tool episodes on 2 cores). Every health probe, timeout and
progress line waits that long.

    SliceBudget   the plain rule (no event loop): within one iteration, steps pass while the time since the
                  iteration's first step is under `slice_s`; later ones wait for the next iteration, where
                  waiting steps go first, in arrival order (FIFO); it also says how many waiters to wake
    StepGate      the async side: `await gate.enter()` before a step of episode work. Uncontended it returns at
                  once (one clock read); contended the task sleeps on a future until an iteration has room
    step_gate()   the running loop's gate (one per event loop, like asyncio's own per-loop state); the engine
                  sets its slice from `rollout.step_slice_ms`

Who enters: the engine before an episode starts, and the ServerManager after each answer, before the loop's
next step runs (so turn continuations are paced too). Work between two gate entries (one step) is not cut;
a slice bounds how many steps start in one iteration, so an iteration lasts about `slice_s` plus one step.

Invariant: every `enter` returns (passes) exactly once or raises CancelledError; steps that wait pass in
arrival order (tests/unit/rollout/test_pacing.py); a waiter woken but cancelled before it ran does not hold
up the others (the next iteration wakes more).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
import weakref


class SliceBudget:
    """The pacing rule as a synchronous state machine; the caller tells it when iterations begin."""

    def __init__(self, slice_s: float = 0.005, *, min_wake: int = 4, max_wake: int = 4096):
        self.slice_s = slice_s
        self.min_wake = min_wake
        self.max_wake = max_wake
        self.t0: float | None = None  # when this iteration's first step passed
        self.passed = 0  # steps passed in this iteration
        self.fit = 16  # steps that fitted in the last full slice: how many to wake next time
        self.deferred = 0  # steps that had to wait (a counter for gauges)

    def new_iteration(self) -> None:
        if self.t0 is not None and self.passed:
            self.fit = max(self.min_wake, min(self.max_wake, self.passed))
        self.t0 = None
        self.passed = 0

    def admit(self, now: float, *, queued: bool) -> bool:
        """May a step run now? `queued`: steps are waiting that arrived earlier (they go first)."""
        if self.t0 is None:
            self.t0 = now
        if queued or now - self.t0 >= self.slice_s:
            self.deferred += 1
            return False
        self.passed += 1
        return True

    def admit_woken(self, now: float) -> bool:
        """A waiter woken for this iteration: it runs unless the slice is already spent."""
        return self.admit(now, queued=False)

    def to_wake(self, waiting: int) -> int:
        """How many waiters to wake for the next iteration (a few more than fitted last time: those that find
        the slice spent go back to the front of the queue)."""
        return min(waiting, max(self.min_wake, self.fit + self.fit // 2))


class StepGate:
    """`await gate.enter()` before a step of episode work (see the module docstring).

    Waiters are kept in a heap by arrival ticket: a waiter woken into a spent slice waits again with its
    ticket, so woken-and-requeued ones stay ahead of later arrivals and among themselves in arrival order
    (a deque with appendleft reversed them). Cancelled waiters are dropped lazily when they reach the top."""

    def __init__(self, slice_s: float = 0.005):
        self.budget = SliceBudget(slice_s)
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._live = 0  # waiters not cancelled
        self._tickets = itertools.count()
        self._tick_pending = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def slice_s(self) -> float:
        return self.budget.slice_s

    @slice_s.setter
    def slice_s(self, value: float) -> None:
        self.budget.slice_s = value

    @property
    def waiting(self) -> int:
        return self._live

    def _schedule_tick(self) -> None:
        if not self._tick_pending:
            self._tick_pending = True
            assert self._loop is not None
            self._loop.call_soon(self._tick)  # scheduled during this iteration, so it runs at the next one

    def _tick(self) -> None:
        self._tick_pending = False
        self.budget.new_iteration()
        woken = 0
        want = self.budget.to_wake(self._live)
        while woken < want and self._waiters:
            _, fut = heapq.heappop(self._waiters)
            if fut.done():  # cancelled while waiting: already not counted
                continue
            self._live -= 1
            fut.set_result(None)
            woken += 1
        if self._live:
            self._schedule_tick()

    async def enter(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        first = self.budget.t0 is None
        if self.budget.admit(time.perf_counter(), queued=self._live > 0):
            if first:
                self._schedule_tick()
            return
        ticket = next(self._tickets)
        while True:
            fut = self._loop.create_future()
            heapq.heappush(self._waiters, (ticket, fut))
            self._live += 1
            self._schedule_tick()
            try:
                await fut
            except asyncio.CancelledError:
                if not fut.done() or fut.cancelled():  # not woken (Task.cancel cancels the awaited future)
                    fut.cancel()  # skipped by _tick
                    self._live -= 1
                raise
            if self.budget.admit_woken(time.perf_counter()):
                self._schedule_tick()
                return
            # woken into a spent slice: waits again with its ticket, ahead of every later arrival

    def gauges(self) -> dict[str, float]:
        return {"loop/steps_waiting": float(self._live), "loop/steps_deferred": float(self.budget.deferred)}


_GATES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, StepGate]" = weakref.WeakKeyDictionary()


def step_gate() -> StepGate:
    """The running event loop's StepGate (made on first use with the default 5 ms slice)."""
    loop = asyncio.get_running_loop()
    gate = _GATES.get(loop)
    if gate is None:
        gate = _GATES[loop] = StepGate()
    return gate
