"""RayBackend: `cluster.backend=ray` (agentloop.cluster's package doc).

Connects the run to the Ray cluster at `cluster.address` (or starts a local one for the run), places the learner's
ranks in one placement group (the servers share its bundles with `cluster.colocate`), and gives the run a
RayServerPool (or the URL pool of `server.urls`) and a RayLearner. Everything it made is gone when the run ends:
actors killed, the placement group removed, the driver disconnected (a local Ray instance stopped).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable

import ray

from agentloop.cluster.ray_learner import RayLearner
from agentloop.cluster.ray_servers import NAMESPACE, RayServerPool
from agentloop.config import Config
from agentloop.errors import ConfigError
from agentloop.inference.serving import ServerPool, UrlPool
from agentloop.rollout.stream import GroupStreamProtocol
from agentloop.train.handle.protocol import LearnerHandle
from agentloop.train.orchestrator.backend import Backend, with_lora_server_args


class RayBackend(Backend):
    """Servers and learner ranks as Ray actors (module doc)."""

    name = "ray"

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.placement_group: Any = None
        self._connected = False
        self._gpus = 0.0

    @staticmethod
    def run_name(run_dir: Path) -> str:
        """The run's actor name prefix (unique per run dir name; Ray names allow these characters)."""
        return "agentloop-" + re.sub(r"[^A-Za-z0-9_.-]", "-", run_dir.name)

    async def start(self) -> None:
        if not ray.is_initialized():
            c = self.cfg.cluster
            kw: dict[str, Any] = {"namespace": NAMESPACE, "log_to_driver": False}
            if c.address is None:
                # Logical CPUs only schedule actors: a small host still places every server and learner rank.
                need = (self.cfg.server.num_local + self.cfg.learner.world_size + c.rollout_workers) * c.cpus_per_actor
                kw.update(include_dashboard=False, num_cpus=max(os.cpu_count() or 1, int(need + 0.999)))
            else:
                use_ray_token(c.address)
            # "local": a new instance for the run even where another cluster runs on this machine (address None
            # would join that one, and refuse num_cpus)
            ray.init(address=c.address or "local", **kw)
            self._connected = True
        self._gpus = float(ray.cluster_resources().get("GPU", 0.0))

    def _uses_cuda(self, device: str) -> bool:
        return device == "cuda" or (device == "auto" and self._gpus > 0)

    def _pg(self) -> Any:
        """The learner's placement group, shared with the servers when colocated (made once)."""
        if self.placement_group is None and self.cfg.cluster.colocate:
            from ray.util.placement_group import placement_group

            c = self.cfg.cluster
            bundle = {"CPU": 2 * c.cpus_per_actor, **({"GPU": 1.0} if self._gpus else {}), **c.learner_resources}
            self.placement_group = placement_group([dict(bundle) for _ in range(self.cfg.learner.world_size)],
                                                   strategy="SPREAD" if c.placement == "spread" else "PACK")
        return self.placement_group

    def server_pool(self, cfg: Config, model_path: Path, run_dir: Path) -> ServerPool:
        if cfg.server.urls:
            return UrlPool(list(cfg.server.urls))
        c = cfg.cluster
        gpus = c.server_gpus if c.server_gpus is not None else (
            (0.5 if c.colocate else 1.0) if self._uses_cuda(cfg.server.device) else 0.0)
        # with learner.lora, the servers serve adapters: the LoRA flags first, server.extra_args after (they win)
        server = with_lora_server_args(cfg).server
        return RayServerPool(server, c, model_path, self.run_name(run_dir), gpus=gpus, placement_group=self._pg(),
                             stage_timeout_s=cfg.manager.admin_timeout_s)

    def learner(self, cfg: Config, run_dir: Path, model_path: Path) -> LearnerHandle:
        c = cfg.cluster
        gpus = c.learner_gpus if c.learner_gpus is not None else (
            (0.5 if c.colocate else 1.0) if self._uses_cuda(cfg.learner.device) else 0.0)
        if gpus == 0 and cfg.learner.weight_sync != "disk":
            raise ConfigError(f"learner.weight_sync={cfg.learner.weight_sync} needs GPU learner ranks; the Ray cluster "
                              "has no GPU (or cluster.learner_gpus=0)")
        return RayLearner(cfg, run_dir, model_path, run=self.run_name(run_dir), gpus=gpus,
                          placement_group=self._pg())

    async def rollout_streams(self, cfg: Config, sm: Any, model_path: Path,
                              run_dir: Path) -> Callable[[Any], GroupStreamProtocol] | None:
        """`cluster.rollout_workers` engine processes (agentloop.cluster.ray_rollout) whose managers follow `sm`,
        stopped when `sm` closes; None without them. The result makes a stream (given the run's episode journal,
        or None)."""
        n = cfg.cluster.rollout_workers
        if n == 0:
            return None
        from agentloop.cluster.ray_rollout import WorkerPool, WorkerStream

        pool = WorkerPool(n, self.run_name(run_dir), cfg.cluster.cpus_per_actor)
        try:
            await pool.start((run_dir / "config.yaml").read_text(), list(sm.urls), model_path, sm.follower_state(),
                             cfg.server.startup_timeout_s)
        except BaseException:
            await pool.stop(grace_s=5.0)
            raise
        sm.add_follower(pool.follow)
        sm.on_close(pool.stop)
        return lambda journal=None: WorkerStream(pool, sm, journal=journal)

    async def close(self) -> None:
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._connected:
            ray.shutdown()
            self._connected = False


def use_ray_token(address: str) -> bool:
    """Before joining the running cluster at `address` (cluster.address): Ray 2.60's `ray start --head` turns token
    authentication on (its token in ~/.ray/auth_token), and a client joining by address sends the token only in token
    mode; otherwise it retries "Authentication token is missing or incorrect" until it gives up. A cluster started
    without authentication (`RAY_AUTH_MODE=disabled`, Ray's own test clusters) in turn refuses a client in token mode.
    So, where RAY_AUTH_MODE is unset, the cluster is asked once without a token: when it refuses for want of one and
    Ray finds a token here, token mode is switched on for this process and its children, by Ray's own call for it.
    True if it was."""
    if "RAY_AUTH_MODE" in os.environ or address in ("auto", "local") or "://" in address:
        return False
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError
    except ImportError:  # a Ray without token authentication
        return False
    try:
        GcsClient(address=address).internal_kv_get(b"agentloop-probe", None)
        return False  # it let this client in as it is
    except AuthenticationError:
        pass
    except Exception:  # noqa: BLE001 - down, unreachable, not a GCS: ray.init says what is wrong
        return False
    return bool(maybe_enable_token_auth_if_token_available(warn_if_disabled=False))


__all__ = ["RayBackend", "use_ray_token"]
