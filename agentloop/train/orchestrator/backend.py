"""Where a training run's parts run: `cluster.backend`.

    Backend        the protocol: `server_pool` (the servers: agentloop.inference.serving.ServerPool), `learner`
                   (the learner: agentloop.train.handle.protocol.LearnerHandle), `start` / `close` around the run
    LocalBackend   this host (or a shared filesystem): launched or given servers, the learner as a child process
                   group talking through the file mailbox (FileLearner)
The Ray backend (agentloop.cluster.RayBackend: server, learner-rank and rollout actors) implements the same
protocol; `agentloop train` picks it for `cluster.backend=ray`, and `run_train(cfg, backend=...)` takes one.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, Callable

from agentloop.config import Config
from agentloop.inference.serving import ServerPool, pool_for
from agentloop.rollout.stream import GroupStreamProtocol
from agentloop.train.handle.protocol import LearnerHandle
from agentloop.train.orchestrator.learner_process import FileLearner


class Backend(abc.ABC):
    """What a run asks of the place it runs in (module doc)."""

    name = ""

    async def start(self) -> None:
        """Before anything else of the run (connect to a cluster); nothing for one host."""
        return None

    @abc.abstractmethod
    def server_pool(self, cfg: Config, model_path: Path, run_dir: Path) -> ServerPool:
        """The run's servers."""

    @abc.abstractmethod
    def learner(self, cfg: Config, run_dir: Path, model_path: Path) -> LearnerHandle:
        """The run's learner (not started yet)."""

    async def rollout_streams(self, cfg: Config, sm: Any, model_path: Path,
                              run_dir: Path) -> Callable[[Any], GroupStreamProtocol] | None:
        """What makes the asynchronous schedule's group stream (given the run's episode journal, or None), once the
        servers serve (`sm`, the run's ServerManager): None, the engine's own (episodes on the orchestrator's
        event loop)."""
        return None

    async def close(self) -> None:
        """After everything else of the run (bounded); nothing for one host."""
        return None


class LocalBackend(Backend):
    """Servers and learner on this host (module doc)."""

    name = "local"

    def server_pool(self, cfg: Config, model_path: Path, run_dir: Path) -> ServerPool:
        return pool_for(with_lora_server_args(cfg), model_path, run_dir)

    def learner(self, cfg: Config, run_dir: Path, model_path: Path) -> LearnerHandle:
        return FileLearner.for_run(cfg, run_dir, model_path)


def with_lora_server_args(cfg: Config) -> Config:
    """With learner.lora, the config whose launched servers serve the run's adapters (agentloop.train.lora.server_args
    before server.extra_args, which win); the config itself otherwise."""
    if not cfg.learner.lora.enabled:
        return cfg
    from agentloop.inference.launcher import resolve_device
    from agentloop.train.lora import server_args

    args = [*server_args(cfg.learner.lora, resolve_device(cfg.server.device)), *cfg.server.extra_args]
    return cfg.model_copy(update={"server": cfg.server.model_copy(update={"extra_args": args})})


__all__ = ["Backend", "LocalBackend", "with_lora_server_args"]
