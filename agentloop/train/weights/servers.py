"""The weight transport: how a learner step's weights reach the servers, one transport per `learner.weight_sync`
path, each with a learner half and a server half that agree on the interrupt mode.

    path     learner half (sync, tensor, nccl: the learner)  server half (here, in the orchestrator)
    disk     DiskSync.publish: save weights/step-N (HF)      DiskHalf: pause, /update_weights_from_disk, finish, resume
    tensor   TensorSync.publish: ask, then CUDA IPC push     PushHalf: pause, answer with a PushOrder, wait, finish,
    nccl     NcclSync.publish: ask, then NCCL broadcast      resume (the learner pushes while the servers are paused)

The interrupt mode (`train.interrupt`, agentloop.interrupt) travels with every push: the server half pauses in
its mode, the disk update flushes only where its policy says so, and a PushOrder carries the mode to the learner
half, whose last payload flushes by the same policy (PushOrder.flush_cache); `finish_update` then does the flush
the mode needs after the update. Every path also loads HF directories (`load`): the weights of the step a run
resumes at, and a stale server's resync.

Where a server reads an HF directory: `stage(weights)` says, per server URL (default: the learner's path as is,
for one host or a shared filesystem; a Ray pool ships the files to each server's node, agentloop.cluster).

Map:
    ServerHalf        load (an HF directory into the servers, paused per the mode), resync (one stale server),
                      deliver (a step's update, per path), `current` (what a stale server is resynced to)
    DiskHalf, PushHalf  the server halves
    HALVES, server_half the server halves by path name; the learner halves are weight_sync.SYNCS, same names
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from agentloop.errors import AgentLoopError
from agentloop.interrupt import InterruptPolicy
from agentloop.server_manager import ServerManager
from agentloop.train.handle.protocol import LearnerHandle, PushOrder, SyncRequest, UpdateResult, WeightsOnDisk

Stage = Callable[[WeightsOnDisk], Awaitable["str | dict[str, str]"]]
"""Where each server reads a learner's HF directory: one path for all, or a path per server URL."""


class TransportError(AgentLoopError):
    """The weights could not reach the servers the way the transport expects."""


async def same_path(weights: WeightsOnDisk) -> str:
    """The default `stage`: the servers read the learner's directory where it is (one host, a shared filesystem)."""
    if weights.host is not None:
        raise TransportError(f"the weights {weights.path} are on the learner's node, and nothing ships them to the "
                             "servers' nodes (a Ray server pool does; or use a shared filesystem)")
    return weights.path


class ServerHalf:
    """What every path's server half does (module doc); `deliver` is per path."""

    name = ""

    def __init__(self, sm: ServerManager, policy: InterruptPolicy, learner: LearnerHandle, *,
                 stage: Stage = same_path):
        self.sm = sm
        self.policy = policy
        self.learner = learner
        self.stage = stage
        self.current: WeightsOnDisk | None = None
        """The newest HF weights loaded from disk (what a stale server is resynced to); None after a push."""

    async def load(self, weights: WeightsOnDisk, version: int) -> float:
        """Load an HF directory into the servers as `version`, interrupting in-flight generation per the mode;
        returns the seconds it took (the servers' pause included)."""
        t0 = time.monotonic()
        paths = await self.stage(weights)
        await self.sm.pause(mode=self.policy.pause_mode)
        try:
            # The prefix cache holds KV of the old weights: flushed in the update (abort) or right after it
            # (retract), or isolated per version by a cache key (in_place), see agentloop.interrupt.
            await self.sm.update_weights_from_disk(paths, weight_version=version,
                                                   flush_cache=self.policy.flush_in_update)
            await self.sm.finish_update(self.policy)
        finally:
            await self.sm.resume()
        self.current = weights
        self.sm.expect_version(version)
        return time.monotonic() - t0

    async def resync(self, url: str) -> None:
        """Reload the current weights into one server (it came back serving older ones): the ServerManager's
        resync hook."""
        version = self.sm.expected_version
        if self.current is None or version is None:
            raise TransportError("no weights on disk to resync a server with (weight_sync tensor|nccl: it stays "
                                 "out until the next push)")
        paths = await self.stage(self.current)
        # Never a flush inside the update: the server may still hold requests from before it was ejected,
        # and a refused flush there kills SGLang 0.5.17's scheduler; the fallback flush handles them.
        await self.sm.update_weights_from_disk(paths, weight_version=version, urls=[url], flush_cache=False)
        if self.policy.flushes:
            await self.sm.flush_prefix_cache([url])

    async def deliver(self, step: int, event: UpdateResult | SyncRequest,
                      timeout_s: float) -> tuple[UpdateResult, float]:
        """The learner's first answer for `step` (`wait_update_or_sync`) -> the servers serve step's weights:
        (the update, seconds spent getting the weights there)."""
        raise NotImplementedError

    def order(self, step: int, targets: list[str]) -> PushOrder:
        """What the learner is told to push: step's weights to `targets`, in this run's interrupt mode."""
        return PushOrder(step, tuple(targets), self.policy.mode)

    async def push_paused(self, step: int, timeout_s: float) -> tuple[UpdateResult, list[str]]:
        """A learner-side push (tensor, nccl; full weights or an adapter): pause the servers, let the learner push
        `step` into the reachable ones, finish the mode's update, resume; those servers then count as on `step`.
        (the learner's update, the servers it reached)."""
        await self.sm.pause(mode=self.policy.pause_mode)
        try:
            targets = await self.sm.reachable_targets()
            await self.learner.allow_sync(step, self.order(step, targets))
            upd = await self.learner.wait_update(step, timeout_s)
            await self.sm.finish_update(self.policy, targets)
        finally:
            await self.sm.resume()
        self.sm.mark_updated(step, targets)
        self.sm.expect_version(step)
        return upd, targets


class DiskHalf(ServerHalf):
    """The learner saved weights/step-N: load them."""

    name = "disk"

    async def deliver(self, step: int, event: UpdateResult | SyncRequest,
                      timeout_s: float) -> tuple[UpdateResult, float]:
        if not isinstance(event, UpdateResult) or event.weights is None:
            raise TransportError(f"step {step}: weight_sync disk expects the learner's weights on disk, got {event}")
        return event, await self.load(event.weights, step)


class PushHalf(ServerHalf):
    """tensor|nccl: the learner asks for paused servers, pushes itself to every server that must hold the weights,
    and the servers are resumed whatever happens (the pause stays short: the learner trained before asking)."""

    name = "push"

    async def deliver(self, step: int, event: UpdateResult | SyncRequest,
                      timeout_s: float) -> tuple[UpdateResult, float]:
        if not isinstance(event, SyncRequest):
            raise TransportError(f"step {step}: the learner answered without asking for paused servers ({event}); "
                                 "does it run the same learner.weight_sync?")
        t1 = time.monotonic()
        upd, _ = await self.push_paused(step, timeout_s)
        self.current = None  # the servers hold weights no directory has: a stale server waits for the next push
        return upd, time.monotonic() - t1


HALVES: dict[str, type[ServerHalf]] = {"disk": DiskHalf, "tensor": PushHalf, "nccl": PushHalf}
"""The server half of each `learner.weight_sync` path (the learner halves: weight_sync.SYNCS)."""


def server_half(path: str) -> type[ServerHalf]:
    try:
        return HALVES[path]
    except KeyError:
        raise ValueError(f"unknown weight sync {path!r}; known: {sorted(HALVES)}") from None


__all__ = ["DiskHalf", "HALVES", "PushHalf", "ServerHalf", "Stage", "TransportError", "same_path", "server_half"]
