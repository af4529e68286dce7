"""`run_async`: the one event loop of a command (uvloop when installed)."""

from __future__ import annotations

import asyncio
import gc
from typing import Awaitable, TypeVar

T = TypeVar("T")


FULL_COLLECTION_EVERY = 1000
"""Young-generation (gen 1) collections between two full ones (CPython's default: 10)."""


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the cyclic garbage collector's sight (gc.freeze), and
    make full collections rare.

    Full (generation 2) collections walk every tracked object, on the event loop. What is alive when a run
    starts (imported modules: torch and transformers alone are ~10^6 objects, the config, the tokenizer) lives
    until the process ends, so it is frozen: frozen objects are still freed by reference counting, only cycles
    among them are never collected. What thousands of episodes in flight hold (tasks, coroutines, buffers:
    ~100 tracked objects each) is walked by every full collection too: 0.3-0.7 s of CPU per collection at 5,000
    tool episodes in flight, dozens of them per run (CPython runs one whenever the old generation grew by 25%
    and 10 young collections passed). A full collection of that heap found no garbage (episodes free their
    objects by reference counting; cycles come from exceptions), so one runs only every
    FULL_COLLECTION_EVERY young collections (about every 1-2 minutes at 300 requests/s): rare pauses instead of
    frequent ones, cyclic garbage kept that much longer. Called before a command's loop starts and again when
    an engine is made (after the tokenizer and reward workers exist)."""
    gc.collect()
    gc.freeze()
    t0, t1, _ = gc.get_threshold()
    gc.set_threshold(t0, t1, FULL_COLLECTION_EVERY)


def run_async(coro: Awaitable[T]) -> T:
    """Run `coro` to completion on a fresh event loop (uvloop on Linux), the heap frozen first (freeze_heap)."""
    freeze_heap()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(coro)  # type: ignore[arg-type]
    return uvloop.run(coro)  # type: ignore[arg-type]
