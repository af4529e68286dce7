"""Server pools and `serving`: a started ServerManager over the servers a pool provides.

Map:
    ServerPool     the protocol: `launch()` starts (or finds) the servers and returns their URLs, `urls`,
                   `stop()` ends what `launch` started (bounded), `stage(path)` where each server reads a
                   learner's weights directory; a pool never touches a ServerManager
    UrlPool        servers someone else runs (`server.urls`): nothing to start or stop
    LocalPool      `server.num_local` SGLang servers launched on this host (logs in the run dir)
    pool_for       the pool the config asks for on this host (the Ray backend brings its own:
                   agentloop.cluster.ray_servers.RayServerPool)
    serving        the context manager every run uses: launch, a started ServerManager that waits until
                   every server answers, always stop on exit
"""

from __future__ import annotations

import abc
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from agentloop.config import Config, ServerConfig, lent_server_indices
from agentloop.errors import ServerError
from agentloop.inference.launcher import LocalServer, launch_servers, stop_servers
from agentloop.server_manager import ResyncHook, ServerManager


class ServerPool(abc.ABC):
    """Where a run's SGLang servers come from (module doc)."""

    @abc.abstractmethod
    async def launch(self) -> list[str]:
        """Start the servers (or find them) and return their URLs, in a fixed order."""

    @property
    @abc.abstractmethod
    def urls(self) -> list[str]:
        """The URLs `launch` returned (empty before)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop what `launch` started (each server within its shutdown timeout); idempotent."""

    async def stage(self, path: str, host: Any = None) -> str | dict[str, str]:
        """Where the servers read an HF directory of the learner's at `path`: the path itself (one host, or a
        filesystem every server sees), or a path per server URL (a pool that copies it to each server's node).
        `host`: None when `path` is readable here; otherwise what holds it
        (agentloop.train.handle.protocol.WeightsOnDisk), which only a pool that can fetch from it accepts."""
        if host is not None:
            raise ServerError(f"the weights {path} are on another node and this server pool reads only paths it "
                              "sees: use a shared filesystem, or the Ray backend's pool")
        return path


class UrlPool(ServerPool):
    """Servers given by URL: started and stopped by someone else."""

    def __init__(self, urls: list[str]):
        self._urls = [u.rstrip("/") for u in urls]

    async def launch(self) -> list[str]:
        return list(self._urls)

    @property
    def urls(self) -> list[str]:
        return list(self._urls)

    async def stop(self) -> None:
        return None


class LocalPool(ServerPool):
    """`server.num_local` servers launched on this host (agentloop.inference.launcher), logs in run_dir/servers."""

    def __init__(self, server_cfg: ServerConfig, model_path: Path, run_dir: Path, *, memory_saver: Sequence[int] = ()):
        """`memory_saver`: servers started with --enable-memory-saver on CUDA (the lent ones,
        server.lend_learner_gpus: they release their KV cache while the learner trains)."""
        self.server_cfg = server_cfg
        self.model_path = model_path
        self.run_dir = run_dir
        self.memory_saver = list(memory_saver)
        self.servers: list[LocalServer] = []

    async def launch(self) -> list[str]:
        self.servers = await launch_servers(self.server_cfg, self.model_path, self.run_dir,
                                            memory_saver=self.memory_saver)
        return self.urls

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    async def stop(self) -> None:
        servers, self.servers = self.servers, []
        if servers:
            await stop_servers(servers)


def pool_for(cfg: Config, model_path: Path, run_dir: Path) -> ServerPool:
    """The servers of `server.urls`, or `server.num_local` local ones."""
    if cfg.server.urls:
        return UrlPool(list(cfg.server.urls))
    saver = lent_server_indices(cfg) if cfg.server.lend_release else []
    return LocalPool(cfg.server, model_path, run_dir, memory_saver=saver)


@contextlib.asynccontextmanager
async def serving(cfg: Config, model_path: Path, run_dir: Path, *, pool: ServerPool | None = None,
                  initial_version: int | None = None, on_event: Callable[[str], None] | None = None,
                  cache_salt: bool = False, resync: ResyncHook | None = None) -> AsyncIterator[ServerManager]:
    """A started ServerManager over the servers of `pool` (default `pool_for(cfg, ...)`), once every one answers
    /health; the pool is stopped on exit, whatever happens. `initial_version` (the weight version the servers
    serve at the start, for training runs), `on_event`, `cache_salt` and `resync`: see ServerManager."""
    pool = pool if pool is not None else pool_for(cfg, model_path, run_dir)
    try:
        vocab = json.loads((model_path / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        vocab = None
    try:
        urls = await pool.launch()
        async with ServerManager(urls, cfg.manager, vocab_size=vocab, initial_version=initial_version,
                                 on_event=on_event, cache_salt=cache_salt, resync=resync) as sm:
            try:
                await sm.wait_ready(timeout=cfg.server.startup_timeout_s)
            except ServerError as e:
                if cfg.server.urls and cfg.learner.weight_sync == "nccl":
                    # SGLang's weight-update group has no timeout: a learner killed mid-broadcast leaves the
                    # servers it was sending to blocked in the collective for good, answering /health but no
                    # /health_generate; only a restart frees them, and only the user can restart theirs
                    raise ServerError(
                        f"{e}. With learner.weight_sync=nccl, a server that was receiving weights from a learner "
                        "that died (killed, crashed) stays blocked in that broadcast: restart the server(s) you "
                        "started, then run the same command again") from e
                raise
            yield sm
    finally:
        await pool.stop()


__all__ = ["LocalPool", "ServerPool", "UrlPool", "pool_for", "serving"]
