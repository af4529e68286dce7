"""Shared start-up for commands: event loop, model resolution, tokenizer, servers.

    run_async           one event loop (uvloop when installed) for a whole command
    resolve_model       cfg.model.path, or the project's tiny model (built once, cached)
    load_tokenizer_for  tokenizer plus the context length the loops should respect
    serving             async context manager: connect to cfg.server.urls, or launch local
                        SGLang servers (logs in the run dir) and always stop them on exit
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, TypeVar

from agentloop.config import Config
from agentloop.errors import ConfigError
from agentloop.server_manager import ServerManager

T = TypeVar("T")


def run_async(coro: Awaitable[T]) -> T:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(coro)  # type: ignore[arg-type]
    return uvloop.run(coro)  # type: ignore[arg-type]


def resolve_model(cfg: Config) -> Path:
    if cfg.model.path:
        p = Path(cfg.model.path)
        if not (p / "config.json").is_file():
            raise ConfigError(f"model.path={cfg.model.path!r} is not a Hugging Face model directory "
                              "(no config.json there)")
        return p
    from agentloop.modelzoo import ensure_tiny_model

    return ensure_tiny_model()


def load_tokenizer_for(cfg: Config, model_path: Path) -> Any:
    tok_path = Path(cfg.model.tokenizer_path) if cfg.model.tokenizer_path else model_path
    try:
        if (tok_path / "tokenizer.json").is_file():
            # The fast backend straight from tokenizer.json: the same ids AutoTokenizer's fast class
            # gives, without AutoTokenizer's ~5 s of class resolution on every start.
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast.from_pretrained(str(tok_path))
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(tok_path))
    except Exception as e:  # noqa: BLE001 - re-raised with the path named
        raise ConfigError(f"cannot load a tokenizer from {str(tok_path)!r}: {e}") from e
    if getattr(tok, "chat_template", None) is None:
        raise ConfigError(f"tokenizer at {str(tok_path)!r} has no chat_template")
    ctx = cfg.model.context_length
    if ctx is None:
        try:
            mc = json.loads((model_path / "config.json").read_text())
            ctx = int(mc.get("max_position_embeddings") or 0) or None
        except (OSError, ValueError):
            ctx = None
    tok.agentloop_context_length = ctx
    return tok


@contextlib.asynccontextmanager
async def serving(cfg: Config, model_path: Path, run_dir: Path) -> AsyncIterator[ServerManager]:
    """A started ServerManager over external or freshly launched local servers."""
    servers: list[Any] = []
    if cfg.server.urls:
        urls = list(cfg.server.urls)
    else:
        from agentloop.launcher import launch_servers

        servers = await launch_servers(cfg.server, model_path, run_dir)
        urls = [s.url for s in servers]
    try:
        vocab = json.loads((model_path / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        vocab = None
    try:
        async with ServerManager(urls, cfg.manager, vocab_size=vocab) as sm:
            if cfg.server.urls:
                await sm.wait_ready(timeout=cfg.server.startup_timeout_s)
            yield sm
    finally:
        if servers:
            from agentloop.launcher import stop_servers

            await stop_servers(servers)
