"""The learner handle: how the orchestrator and the learner talk, whatever carries it (files, Ray).

Two protocols, one per side, and the facts that cross between them:
    LearnerHandle   the orchestrator's side: start the learner, wait until it is ready (and has trained the
                    batches submitted before a stop), submit a step's batch with its data state, wait for the
                    update (or a request to pause the servers for a push, then allow it), the resume facts
                    (a finished step's metrics, a step's weights), stop, wait for the final save, close
    LearnerInbox    learner rank 0's side: report its state, the next message (a batch, a stop), results,
                    ask for paused servers before a push, the final save
    LearnerInfo     what a ready learner says: next step, the checkpoint it resumed from, the data state stored
                    with the last batch it trained, its batch layout (agentloop.train.batch.format.BatchLayout)
    UpdateResult    a step's update: its learner metrics and where its weights are (WeightsOnDisk) or that the
                    learner pushed them itself
    SyncRequest     "pause the servers, then tell me where to push" (weight_sync tensor|nccl)
    PushOrder       the server half's answer to a SyncRequest: the URLs to push to and the interrupt mode
    WeightsOnDisk   an HF directory of the learner's, and how a server pool reaches it (`host`: None when the
                    path is readable where the servers run: one host or a shared filesystem)
    FinalResult     the final save: HF weights and checkpoint of the last step
    LearnerError    base of LearnerTimeout, LearnerDiedError, LearnerFailedError

Implementations: FileLearner (agentloop.train.orchestrator.learner_process: a child process group and the file mailbox,
agentloop.train.handle.mailbox) and RayLearner (agentloop.cluster.ray_learner: rank actors, batches and control
through Ray). The same tests run against both (tests/unit/train/test_handle.py).

Every wait takes a deadline; every method that crosses to the learner (a process, a Ray actor, its files) is
async, so the orchestrator's event loop never blocks on it (a Ray call is awaited, never `ray.get`); the two that
stay plain (`submitted`, `where`) answer from the handle's own memory.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from agentloop.errors import AgentLoopError


class LearnerError(AgentLoopError):
    """Base of the learner-handle errors."""


class LearnerTimeout(LearnerError, TimeoutError):
    """A wait on the learner ran past its deadline."""


class LearnerDiedError(LearnerError):
    """The learner (process, actor) is gone, or its heartbeat went stale."""


class LearnerFailedError(LearnerError):
    """The learner failed a step; `traceback` holds its traceback."""

    def __init__(self, message: str, *, step: int, traceback: str = ""):
        super().__init__(message)
        self.step = step
        self.traceback = traceback


@dataclass(frozen=True)
class WeightsOnDisk:
    """An HF weights directory the learner wrote."""

    path: str
    """Its path on the learner's filesystem."""
    host: Any = None
    """None: the path is readable where the servers run (one host, or a shared filesystem). Otherwise what a
    server pool fetches the files from (the Ray learner's rank-0 actor: `manifest` and `read_chunk`, once per
    node)."""


@dataclass(frozen=True)
class PushOrder:
    """The server half's answer to a learner that asked for paused servers: push step's weights to `urls`; the
    servers were paused in `interrupt` mode, and the push flushes their prefix caches only where that mode allows
    it (its policy's `flush_in_update`, agentloop.interrupt). Travels as JSON (the mailbox's sync.go, Ray)."""

    step: int
    urls: tuple[str, ...]
    interrupt: str | None = None
    """abort | retract | in_place; None (an order without a mode, an older orchestrator's): no flush, the safe
    side (a refused flush inside an update kills SGLang 0.5.17's scheduler, a missing one only keeps stale KV)."""
    released: tuple[int, ...] = ()
    """LoRA through weight_sync tensor: the adapter versions this learner pushed that no server holds any more (each
    server that loaded one unloaded it), so the host memory they were read from may be written again."""

    @property
    def flush_cache(self) -> bool:
        """Whether the push's last call flushes the prefix cache; ValueError for an unknown mode."""
        from agentloop.interrupt import interrupt_policy

        return interrupt_policy(self.interrupt).flush_in_update if self.interrupt else False

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "urls": list(self.urls), "interrupt": self.interrupt,
                "released": list(self.released)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PushOrder:
        return cls(step=int(d.get("step", 0)), urls=tuple(d.get("urls") or ()), interrupt=d.get("interrupt"),
                   released=tuple(int(v) for v in d.get("released") or ()))


@dataclass
class LearnerInfo:
    next_step: int
    """The first step the learner will train."""
    resumed_step: int | None = None
    """The checkpoint it resumed from (None: the initial weights)."""
    data_position: Any = None
    """The data state stored with the last batch it trained (None: a fresh start)."""
    world_size: int = 1
    layout: dict[str, Any] = field(default_factory=dict)
    """agentloop.train.batch.format.BatchLayout as JSON: how the learner lays out micro-batches."""
    probe: dict[str, Any] | None = None
    """A fresh learner's first forward: {"ids": token ids, "logprobs": log-probs of ids[1:] at temperature 1},
    which the servers' own log-probs of the same ids must match (served_model.check_served_logprobs)."""


@dataclass
class UpdateResult:
    step: int
    weights: WeightsOnDisk | None
    """The HF weights after `step`; None when the learner pushed them itself."""
    metrics: dict[str, float]
    pushed: bool = False
    """True: the servers already hold these weights (weight_sync tensor|nccl)."""

    @property
    def weights_dir(self) -> str | None:
        return None if self.weights is None else self.weights.path


@dataclass
class SyncRequest:
    step: int
    method: str
    """The learner's weight_sync path: tensor or nccl."""


@dataclass
class FinalResult:
    step: int | None
    weights_dir: str | None
    checkpoint: str | None


class LearnerHandle(abc.ABC):
    """The orchestrator's side (module doc). One handle per run; methods run on the orchestrator's loop."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Start the learner (it loads its model, resumes from its newest checkpoint when asked)."""

    @abc.abstractmethod
    async def wait_ready(self, timeout_s: float) -> LearnerInfo:
        """Until the learner has loaded and reports ready; LearnerTimeout / LearnerDiedError."""

    @abc.abstractmethod
    async def wait_caught_up(self, step_timeout_s: float) -> LearnerInfo:
        """After `wait_ready`: until the learner has trained every batch submitted before a stop (each may take
        `step_timeout_s`); its info then says where the run stands."""

    @abc.abstractmethod
    def submitted(self, step: int) -> bool:
        """Whether step's batch reached the learner already (a resumed run keeps that step's rollouts)."""

    @abc.abstractmethod
    async def submit(self, step: int, batch: Any, *, data_position: Any = None) -> None:
        """Hand the learner step's batch (agentloop.train.batch.format.TrainBatch) and the data state to store
        with it; a step submitted before is not submitted again."""

    @abc.abstractmethod
    async def wait_update_or_sync(self, step: int, timeout_s: float) -> UpdateResult | SyncRequest:
        """Step's update, or the learner's request for paused servers (answer with `allow_sync`)."""

    @abc.abstractmethod
    async def allow_sync(self, step: int, order: Any) -> None:
        """The servers are paused: push step's weights as `order` (weight_sync.PushOrder) says."""

    @abc.abstractmethod
    async def wait_update(self, step: int, timeout_s: float) -> UpdateResult:
        """Step's update; LearnerFailedError / LearnerDiedError / LearnerTimeout."""

    @abc.abstractmethod
    async def finished_metrics(self, step: int) -> dict[str, float] | None:
        """The learner metrics of a step it finished (None: not finished, or the learner could not tell in time),
        for a row a resumed run restores."""

    @abc.abstractmethod
    async def weights(self, step: int) -> WeightsOnDisk | None:
        """The HF weights of `step` where the learner keeps them, None when they are missing."""

    @abc.abstractmethod
    async def stop(self, *, final: bool = False) -> None:
        """The learner exits after its current step; `final` (the run ended normally): after saving the final
        model (`wait_final`)."""

    @abc.abstractmethod
    async def wait_final(self, timeout_s: float) -> FinalResult:
        """After `stop(final=True)`: the final save; LearnerDiedError if the learner ended without it."""

    @abc.abstractmethod
    async def failure_context(self) -> str:
        """Lines that help read a learner failure (its log's tail), appended to errors; bounded in time, "" when
        nothing can be read."""

    @abc.abstractmethod
    def where(self) -> str:
        """Where the learner runs and logs, for the run's opening lines."""

    @abc.abstractmethod
    async def close(self) -> int | None:
        """End the learner (a stop, then a bounded wait, then force); its exit code when it has one."""


class LearnerInbox(abc.ABC):
    """Learner rank 0's side (module doc); called from the learner's own thread, blocking is fine here."""

    @abc.abstractmethod
    def start(self) -> None:
        """Begin reporting (a heartbeat where the carrier needs one)."""

    @abc.abstractmethod
    def report(self, **fields: Any) -> None:
        """Update what the learner says of itself: status (loading, ready, training, failed, stopped), next_step,
        resumed_step, data_position, world_size, layout, error."""

    @abc.abstractmethod
    def poll(self, step: int) -> tuple[Any, ...] | None:
        """The next message: ("batch", source, meta) for `step` (source: the batch file's path, or its bytes, with
        its header checked: every rank reads its own share, agentloop.train.batch.format.RankBatch.read),
        ("bad_batch", why) when step's batch cannot be read, ("stop", final), or None (nothing yet)."""

    @abc.abstractmethod
    def done(self, step: int, weights_dir: str | None, metrics: dict[str, float], *, pushed: bool) -> None:
        """Step trained and its weights published."""

    @abc.abstractmethod
    def failed(self, step: int, exc: BaseException) -> None:
        """Step failed (the orchestrator's wait raises LearnerFailedError with the traceback)."""

    @abc.abstractmethod
    def ask_push(self, step: int, method: str, timeout_s: float) -> Any:
        """Ask the orchestrator to pause the servers and wait for its answer: a weight_sync.PushOrder."""

    @abc.abstractmethod
    def final(self, step: int, weights_dir: str | None, checkpoint: str | None) -> None:
        """The final model is saved."""

    @abc.abstractmethod
    def forget_after(self, step: int) -> None:
        """Forget results of steps > step (the learner resumed from a checkpoint of `step`)."""

    def submitted_through(self, step: int) -> int:
        """The last step k >= `step` whose batches `step`..k were submitted before this learner started (a resumed
        learner trains them again first, as they are); step - 1 when none was. Default: none (a carrier whose
        batches do not outlive the learner, Ray's)."""
        return step - 1

    @abc.abstractmethod
    def close(self, status: str = "stopped", **fields: Any) -> None:
        """Stop reporting, with a last status."""


__all__ = [
    "FinalResult",
    "LearnerDiedError",
    "LearnerError",
    "LearnerFailedError",
    "LearnerHandle",
    "LearnerInbox",
    "LearnerInfo",
    "LearnerTimeout",
    "PushOrder",
    "SyncRequest",
    "UpdateResult",
    "WeightsOnDisk",
]
