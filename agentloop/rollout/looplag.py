"""Event-loop lag: how late a periodic timer fires. The one number that says the loop is starved.

Two readings per sample: `lag` (wall clock: what every timer, probe and request on this loop waits), and
`own lag`, the lag less the time the loop's thread spent waiting for a CPU while runnable (the kernel's
run-queue delay, /proc/thread-self/schedstat) during that sample. On a machine whose cores are busy with other
processes the first grows with their load; the second is what the loop's own work held it up (where the
kernel does not report run-queue delay, both are the same).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque


class _RunQueue:
    """Seconds the thread that opened it has waited on a run queue so far (None where the kernel does not say);
    the file stays open and is re-read with pread (a fresh open per sample costs ~0.1 ms)."""

    def __init__(self) -> None:
        try:
            self.fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self.fd = None

    def read(self) -> float | None:
        if self.fd is None:
            return None
        try:
            return int(os.pread(self.fd, 128, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _pcts(s: list[float], prefix: str, top: float) -> dict[str, float]:
    if not s:
        return {f"{prefix}_p50_ms": 0.0, f"{prefix}_p99_ms": 0.0, f"{prefix}_max_ms": 0.0}
    s = sorted(s)
    return {f"{prefix}_p50_ms": 1000 * s[len(s) // 2],
            f"{prefix}_p99_ms": 1000 * s[min(len(s) - 1, int(0.99 * len(s)))],
            f"{prefix}_max_ms": 1000 * top}


class LoopLagMonitor:
    """Samples event-loop lag every `interval_s` while running; `gauges()` gives p50/p99/max in ms, of the lag
    and of the loop's own lag (see the module docstring)."""

    def __init__(self, interval_s: float = 0.05, window: int = 4096):
        self.interval_s = interval_s
        self._samples: deque[float] = deque(maxlen=window)
        self._own: deque[float] = deque(maxlen=window)
        self._max = 0.0
        self._own_max = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        rq = _RunQueue()  # opened on the loop's thread: its run-queue delay is the one read
        try:
            await self._sample(rq)
        finally:
            rq.close()

    async def _sample(self, rq: _RunQueue) -> None:
        while True:
            t, q = time.perf_counter(), rq.read()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, time.perf_counter() - t - self.interval_s)
            q2 = rq.read()
            own = lag if q is None or q2 is None else max(0.0, lag - (q2 - q))
            self._samples.append(lag)
            self._own.append(own)
            self._max = max(self._max, lag)
            self._own_max = max(self._own_max, own)

    def gauges(self, reset: bool = False) -> dict[str, float]:
        """p50/p99/max lag in ms over the samples since the start (or the last reset); `reset` starts a new
        window (a training step's row covers its own step). `loop/own_lag_*`: the same less run-queue waits."""
        out = {**_pcts(list(self._samples), "loop/lag", self._max),
               **_pcts(list(self._own), "loop/own_lag", self._own_max)}
        if reset:
            self._samples.clear()
            self._own.clear()
            self._max = self._own_max = 0.0
        return out
