"""RayServerPool: each SGLang server a Ray actor (ServerActor) on the node Ray places it on.

A ServerActor launches today's LocalServer (agentloop.inference.launcher) from its constructor, on its node's
address and a port the pool chose, and waits until it serves; the server's process group dies with the actor
(the launcher arms the parent-death signal: Ray's sync actors run their methods on the main thread). Ray restarts
a dead actor up to `cluster.server_restarts` times: the constructor runs again, at the same port, so the server
comes back at its URL and the ServerManager re-admits it once it serves the current weights (resynced through
`stage`, or at the next push).

Weights without a shared filesystem (`stage`): every server reads an HF directory of the learner's from its own
node. One copy per node, shared by that node's servers: the first of them to take the node's lock fetches the
directory from its holder (the learner's rank-0 actor, `WeightsOnDisk.host`) through Ray's object store, file by
file in chunks of `CHUNK_BYTES` (a few in flight; never an object the size of the model), into the node's temp
dir, and marks it complete; the others find it there. A server that dies mid-fetch releases the lock, and the
next one fetches afresh. The node keeps the newest `KEEP_WEIGHTS` copies (each fetch noted in the node's
weights.jsonl, each copy a server was given in its own, beside its log); with `cluster.shared_fs` the path is
used as it is.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import shutil
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import ray

from agentloop.config import ClusterConfig, ServerConfig
from agentloop.errors import ServerError, ServerStartError
from agentloop.inference.launcher import LocalServer, pick_free_port, resolve_device
from agentloop.inference.serving import ServerPool

NAMESPACE = "agentloop"
"""The Ray namespace of every actor a run makes (named `<run>-server<i>`, `<run>-learner-rank<r>`)."""

KEEP_WEIGHTS = 2
"""HF directories a node keeps (the newest; a resync needs the current one)."""

CHUNK_BYTES = 64 * 2**20
"""The piece of a weight file one object-store transfer carries."""

CHUNKS_IN_FLIGHT = 4
"""Chunks asked for ahead of the one being written."""

_MARK = ".agentloop-copy.json"


def scratch_dir(run: str, what: str) -> Path:
    """A directory of this node's own (its temp dir, which `ray start` may point elsewhere per node)."""
    d = Path(tempfile.gettempdir()) / "agentloop-ray" / run / what
    d.mkdir(parents=True, exist_ok=True)
    return d


class ServerActor:
    """One SGLang server on its node (module doc). Methods run on the actor's main thread, one at a time."""

    def __init__(self, server_cfg: dict[str, Any], model_path: str, run: str, index: int, port: int):
        cfg = ServerConfig(**server_cfg)
        self.index = index
        self.dir = scratch_dir(run, f"server{index}")
        self.node_weights = scratch_dir(run, "weights")  # this node's copies, shared by its servers
        self.node = ray.get_runtime_context().get_node_id()
        self.server = LocalServer(model_path, host=ray.util.get_node_ip_address(), port=port,
                                  device=resolve_device(cfg.device), gpu_id=None,  # Ray set CUDA_VISIBLE_DEVICES
                                  max_total_tokens=cfg.max_total_tokens, mem_fraction_static=cfg.mem_fraction_static,
                                  extra_args=cfg.extra_args, log_path=self.dir / "server.log",
                                  startup_timeout_s=cfg.startup_timeout_s, shutdown_timeout_s=cfg.shutdown_timeout_s)
        self.server.start()
        asyncio.run(self.server.wait_ready())
        self.weights: dict[str, str] = {}  # learner path -> the node's copy this server was given, oldest first

    def info(self) -> dict[str, Any]:
        return {"url": self.server.url, "node": self.node, "pid": self.server.pid, "dir": str(self.dir),
                "log": str(self.server.log_path)}

    def fetch_weights(self, path: str, holder: Any) -> str:
        """This node's copy of the learner's HF directory `path` (module doc): fetched from `holder` (an actor with
        `manifest` and `read_chunk`) by the first server of the node to ask, found by the others."""
        if path in self.weights:
            return self.weights[path]
        dest = self.node_weights / Path(path).name
        with (self.node_weights / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when this returns, or when this process dies mid-fetch
            if _copy_of(dest) != path:
                self._fetch(path, holder, dest)
        self.weights[path] = str(dest)
        with (self.dir / "weights.jsonl").open("a") as ledger:  # the copies this server was given, for the record
            ledger.write(json.dumps({"from": path, "to": str(dest), "time": time.time()}) + "\n")
        while len(self.weights) > KEEP_WEIGHTS:
            self.weights.pop(next(iter(self.weights)))
        return str(dest)

    def _fetch(self, path: str, holder: Any, dest: Path) -> None:
        t0 = time.monotonic()
        manifest: list[tuple[str, int]] = ray.get(holder.manifest.remote(path))
        tmp = dest.with_name(f".{dest.name}.tmp-{time.monotonic_ns()}")
        for rel, size in manifest:
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("wb") as fh:
                refs: deque[Any] = deque()
                for offset in range(0, size, CHUNK_BYTES):
                    refs.append(holder.read_chunk.remote(path, rel, offset, min(CHUNK_BYTES, size - offset)))
                    if len(refs) > CHUNKS_IN_FLIGHT:
                        fh.write(ray.get(refs.popleft()))
                while refs:
                    fh.write(ray.get(refs.popleft()))
            if target.stat().st_size != size:
                raise ServerError(f"the copy of {path}/{rel} has {target.stat().st_size} bytes, not {size}")
        total = sum(size for _, size in manifest)
        (tmp / _MARK).write_text(json.dumps({"from": path, "files": len(manifest), "bytes": total}))
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        with (self.node_weights / "weights.jsonl").open("a") as ledger:  # one line per fetch on this node
            ledger.write(json.dumps({"from": path, "to": str(dest), "files": len(manifest), "bytes": total,
                                     "server": self.index, "s": round(time.monotonic() - t0, 3),
                                     "time": time.time()}) + "\n")
        copies = sorted((d for d in self.node_weights.iterdir() if d.is_dir() and _copy_of(d) is not None),
                        key=lambda d: (d / _MARK).stat().st_mtime)
        for old in copies[:-KEEP_WEIGHTS]:
            if old != dest:
                shutil.rmtree(old, ignore_errors=True)

    def log_tail(self, n: int = 30) -> str:
        return self.server.log_tail(n)

    def stop(self) -> None:
        """Stop the server (its log stays in this node's temp dir; the node's weight copies go with the pool)."""
        self.server.stop()

    def drop_weights(self) -> None:
        """Remove this node's weight copies (the run's servers are stopping)."""
        with (self.node_weights / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            for d in self.node_weights.iterdir():
                if d.is_dir():
                    shutil.rmtree(d, ignore_errors=True)


def _copy_of(d: Path) -> str | None:
    """The learner path a complete node copy at `d` was made from, None when there is none."""
    try:
        return json.loads((d / _MARK).read_text()).get("from")
    except (OSError, ValueError):
        return None


def actor_options(cluster: ClusterConfig, gpus: float, *, name: str, resources: dict[str, float],
                  placement_group: Any = None, bundle: int | None = None, restarts: int = 0) -> dict[str, Any]:
    opts: dict[str, Any] = {"name": name, "namespace": NAMESPACE, "num_cpus": cluster.cpus_per_actor,
                            "num_gpus": gpus, "resources": dict(resources), "max_restarts": restarts}
    if placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle)
        opts["resources"] = {}  # the bundle holds them
    return opts


class RayServerPool(ServerPool):
    """`server.num_local` servers as Ray actors (module doc). `placement_group`: colocated with the learner's
    ranks (server i in bundle i)."""

    def __init__(self, server_cfg: ServerConfig, cluster: ClusterConfig, model_path: Path, run: str, *,
                 gpus: float, placement_group: Any = None, stage_timeout_s: float = 600.0):
        """`stage_timeout_s`: how long one server's copy of a weights directory may take; a server that has none by
        then (its actor is restarting, its node is gone) is given the learner's path, fails that update and is
        ejected as any server that fails one (manager.admin_timeout_s in a run)."""
        self.server_cfg = server_cfg
        self.cluster = cluster
        self.model_path = model_path
        self.run = run
        self.gpus = gpus
        self.placement_group = placement_group
        self.stage_timeout_s = stage_timeout_s
        self.actors: list[Any] = []
        self._urls: list[str] = []
        self.infos: list[dict[str, Any]] = []

    async def launch(self) -> list[str]:
        remote = ray.remote(ServerActor)
        cfg = self.server_cfg.model_dump()
        n = self.server_cfg.num_local
        for i in range(n):
            port = self.server_cfg.base_port + i if self.server_cfg.base_port else pick_free_port()
            opts = actor_options(self.cluster, self.gpus, name=f"{self.run}-server{i}",
                                 resources=self.cluster.server_resources, placement_group=self.placement_group,
                                 bundle=i if self.placement_group is not None else None,
                                 restarts=self.cluster.server_restarts)
            self.actors.append(remote.options(**opts).remote(cfg, str(self.model_path), self.run, i, port))
        # placed and serving within the server's start-up deadline (and a margin for placement), or an error that
        # names what the actors asked for: a cluster without those resources would leave them pending for good
        deadline = self.server_cfg.startup_timeout_s + 60.0
        try:
            self.infos = list(await asyncio.wait_for(asyncio.gather(*(a.info.remote() for a in self.actors)), deadline))
        except asyncio.TimeoutError:
            await self.stop()
            raise ServerStartError(
                f"{n} server actor(s) not placed and serving within {deadline:.0f}s: each asks for "
                f"{self.cluster.cpus_per_actor:g} CPU, {self.gpus:g} GPU and {self.cluster.server_resources or 'no'} "
                f"custom resources; the cluster has {ray.available_resources()} free") from None
        except ray.exceptions.RayActorError as e:
            await self.stop()
            raise ServerStartError(f"a server actor failed to start: {_cause(e)}") from None
        self._urls = [i["url"] for i in self.infos]
        return self.urls

    @property
    def urls(self) -> list[str]:
        return list(self._urls)

    async def stage(self, path: str, host: Any = None) -> str | dict[str, str]:
        if self.cluster.shared_fs:
            return path
        if host is None:
            raise ServerError(f"the weights {path} have no holder to fetch them from and cluster.shared_fs is false")
        copies = await asyncio.gather(*(asyncio.wait_for(asyncio.wrap_future(a.fetch_weights.remote(path, host)
                                                                             .future()), self.stage_timeout_s)
                                        for a in self.actors), return_exceptions=True)
        # A server whose copy did not come (its actor dead or restarting) must fail this update and be ejected:
        # never hand it the learner's own path, which on a cluster of one host (or a shared mount) it could load
        # behind the transport's back. It is resynced once its actor serves again.
        return {u: c if isinstance(c, str) else f"{path}.not-on-this-node({type(c).__name__})"
                for u, c in zip(self._urls, copies)}

    async def stop(self) -> None:
        actors, self.actors = self.actors, []
        if not actors:
            return
        refs = [a.stop.remote() for a in actors]
        grace = self.server_cfg.shutdown_timeout_s + 5
        await asyncio.to_thread(ray.wait, refs, num_returns=len(refs), timeout=grace)
        drops = [a.drop_weights.remote() for a in actors]
        await asyncio.to_thread(ray.wait, drops, num_returns=len(drops), timeout=30)
        for a in actors:
            ray.kill(a, no_restart=True)


def _cause(e: BaseException) -> str:
    """The first line of a Ray error (its cause), for messages."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


__all__ = ["CHUNK_BYTES", "KEEP_WEIGHTS", "NAMESPACE", "RayServerPool", "ServerActor", "actor_options", "scratch_dir"]
