"""Event-loop lag: how late a periodic timer fires. The one number that says the loop is starved."""

from __future__ import annotations

import asyncio
import time
from collections import deque


class LoopLagMonitor:
    """Samples event-loop lag every `interval_s` while running; `gauges()` gives p50/p99/max in ms."""

    def __init__(self, interval_s: float = 0.05, window: int = 4096):
        self.interval_s = interval_s
        self._samples: deque[float] = deque(maxlen=window)
        self._max = 0.0
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
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, time.perf_counter() - t - self.interval_s)
            self._samples.append(lag)
            self._max = max(self._max, lag)

    def gauges(self, reset: bool = False) -> dict[str, float]:
        """p50/p99/max lag in ms over the samples since the start (or the last reset); `reset` starts a new
        window (a training step's row covers its own step)."""
        s = sorted(self._samples)
        top = self._max
        if reset:
            self._samples.clear()
            self._max = 0.0
        if not s:
            return {"loop/lag_p50_ms": 0.0, "loop/lag_p99_ms": 0.0, "loop/lag_max_ms": 0.0}
        return {
            "loop/lag_p50_ms": 1000 * s[len(s) // 2],
            "loop/lag_p99_ms": 1000 * s[min(len(s) - 1, int(0.99 * len(s)))],
            "loop/lag_max_ms": 1000 * top,
        }
