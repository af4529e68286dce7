"""`GroupStreamProtocol`: the stream of GRPO groups that the asynchronous schedule drives
(agentloop.train.orchestrator.loop, `Trainer.run_async_schedule`), whichever process runs the episodes.

Implementations, the same members with the same signatures (checked by tests/unit/rollout/test_stream.py):
    agentloop.rollout.engine.GroupStream       the episodes on this event loop (`RolloutEngine.stream`)
    agentloop.cluster.ray_rollout.WorkerStream the episodes on rollout workers, Ray actors (cluster.rollout_workers)

The contract: every submitted group comes out of `next()` exactly once, complete or cancelled (with the reason);
`stopped` says why nothing more can finish (every server down), after which the driver submits nothing more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from agentloop.records import Sample
    from agentloop.rollout.engine import GroupOutcome


@runtime_checkable
class GroupStreamProtocol(Protocol):
    """GRPO groups in flight (module doc). Every method runs on the driver's event loop."""

    stopped: str | None
    """Why nothing more can finish (None: the stream takes groups)."""

    @property
    def running(self) -> int:
        """Groups submitted and not yet out of `next()`."""
        ...

    def running_uids(self) -> list[int]:
        """The keys of those groups."""
        ...

    def submit(self, sample: Sample, n: int, *, key: int | None = None) -> None:
        """Start a group of `n` episodes of `sample`, keyed by `key` (default its `group_uid`; a key must be new in
        this stream: ValueError)."""
        ...

    def cancel(self, uid: int, reason: str) -> bool:
        """Cancel a running group (its outcome still comes out of `next()`, cancelled with `reason`); False when
        no group of that key runs."""
        ...

    async def next(self, timeout: float | None = None) -> GroupOutcome:
        """The next group to finish (complete or cancelled)."""
        ...

    async def running_versions(self) -> dict[int, int | None]:
        """Key -> the weight version each running group started at (None: not started yet)."""
        ...

    def busy_fraction(self, reset: bool = False) -> float:
        """The share of time since the last reset with an episode (a group, on workers) running."""
        ...

    async def cancel_all(self, reason: str) -> list[GroupOutcome]:
        """Cancel every running group; every outcome not yet taken (cancelled or complete)."""
        ...


__all__ = ["GroupStreamProtocol"]
