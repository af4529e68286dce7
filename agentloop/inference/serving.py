"""`serving(cfg, model_path, run_dir)`: a started ServerManager over the configured servers, or over local
SGLang servers launched for the run (logs in the run dir) and always stopped on exit."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, AsyncIterator

from agentloop.config import Config
from agentloop.inference.launcher import launch_servers, stop_servers
from agentloop.server_manager import ServerManager


@contextlib.asynccontextmanager
async def serving(cfg: Config, model_path: Path, run_dir: Path, *,
                  initial_version: int | None = None) -> AsyncIterator[ServerManager]:
    """A started ServerManager over external or freshly launched local servers (`initial_version`: the
    weight version they serve at the start, for training runs)."""
    servers: list[Any] = []
    if cfg.server.urls:
        urls = list(cfg.server.urls)
    else:
        servers = await launch_servers(cfg.server, model_path, run_dir)
        urls = [s.url for s in servers]
    try:
        vocab = json.loads((model_path / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        vocab = None
    try:
        async with ServerManager(urls, cfg.manager, vocab_size=vocab, initial_version=initial_version) as sm:
            if cfg.server.urls:
                await sm.wait_ready(timeout=cfg.server.startup_timeout_s)
            yield sm
    finally:
        if servers:
            await stop_servers(servers)
