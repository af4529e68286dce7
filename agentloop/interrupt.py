"""How in-flight generation meets a weight update (`train.interrupt`), as plain data both sides share.

One `InterruptPolicy` per mode says what the pause, the update and the prefix cache do. The orchestrator
pauses and finishes the update with it (`ServerManager.pause`, `ServerManager.finish_update`), and the
mode travels with every push: the disk path's update call and the learner's tensor/nccl payloads take
their `flush_cache` from the same policy (agentloop.train.weights.sync), so no path can ask a server for
a flush it cannot do.

Why the flags are what they are (SGLang 0.5.17, the GPU bundle, and 0.5.23, the CPU engine):
- A flush (`flush_cache` in an update call, or POST /flush_cache) needs the scheduler idle. In an update
  call a refused flush is fatal on 0.5.17 (`assert ... "Cache flush failed after updating weights"`
  kills the scheduler) and fails the update on 0.5.23; /flush_cache refuses with HTTP 400, harmlessly.
- abort: every request was aborted and drained before the update, so the server is idle and the update
  flushes, as it always has.
- retract: retracted requests wait in the queue. 0.5.23 flushes while paused with only waiting
  requests; 0.5.17 counts them as busy. So the update never flushes, and `finish_update` flushes
  afterwards with /flush_cache; where that is refused, the waiting requests are aborted (their callers
  continue them under the new weights, as in abort mode) and the now idle server is flushed. Without a
  flush a retracted request would re-prefill its prompt from KV the old weights computed.
- in_place: running requests keep their KV, so nothing can flush. Instead every request carries a
  per-version cache key (SGLang's `extra_key`): a request of version v+1 never reuses a prefix cached
  under version v. (A request admitted under v and still running keeps v's KV: that is in_place.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

InterruptMode = Literal["abort", "retract", "in_place"]
INTERRUPT_MODES: tuple[str, ...] = get_args(InterruptMode)


@dataclass(frozen=True)
class InterruptPolicy:
    """What one interrupt mode does around a weight update."""

    mode: str
    """abort | retract | in_place (`train.interrupt`)."""
    pause_mode: str
    """The `mode` sent to SGLang's /pause_generation."""
    flush_in_update: bool
    """The update call itself flushes the prefix cache (its `flush_cache` field, on the last bucket)."""
    flush_after: bool
    """`finish_update` flushes with /flush_cache once the servers hold the new weights, before resuming."""
    cache_salt: bool
    """Requests carry a per-weight-version `extra_key`, so the prefix cache never serves KV of other weights."""
    client_continues: bool
    """Calls the pause cuts short return their partial tokens, and the client continues them."""

    @property
    def flushes(self) -> bool:
        """Whether the prefix cache is emptied at each update (in the update call or right after it)."""
        return self.flush_in_update or self.flush_after


_POLICIES = {
    "abort": InterruptPolicy("abort", "abort", flush_in_update=True, flush_after=False, cache_salt=False,
                             client_continues=True),
    "retract": InterruptPolicy("retract", "retract", flush_in_update=False, flush_after=True, cache_salt=False,
                               client_continues=False),
    "in_place": InterruptPolicy("in_place", "in_place", flush_in_update=False, flush_after=False, cache_salt=True,
                                client_continues=False),
}


def interrupt_policy(mode: str) -> InterruptPolicy:
    """The policy of `mode`; ValueError naming the modes for anything else."""
    try:
        return _POLICIES[mode]
    except KeyError:
        raise ValueError(f"unknown interrupt mode {mode!r}; expected one of {list(INTERRUPT_MODES)}") from None


__all__ = ["INTERRUPT_MODES", "InterruptMode", "InterruptPolicy", "interrupt_policy"]
