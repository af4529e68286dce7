"""Session fixtures: the tiny model (built once, cached) and one real CPU SGLang server.

Real-server tests run by default; set AGENTLOOP_SKIP_SGLANG=1 to skip them (never silently:
the skip reason names the variable). The model cache honours AGENTLOOP_CACHE_DIR.
"""

from __future__ import annotations

import asyncio
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# SWIG modules (sentencepiece, which transformers loads lazily, in whichever test first needs a
# slow tokenizer) warn "builtin type swigvarlink has no __module__ attribute" while building their
# types; under `filterwarnings = error` that warning, raised inside the module's C init, left the
# interpreter to die with SIGSEGV at exit (exit code 139 after all tests passed). pyproject.toml
# ignores exactly those warnings; importing the tokenizer stack once here keeps it out of the tests.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
        import transformers  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    except ImportError:
        pass

from agentloop.models.modelzoo import ensure_tiny_model

SKIP_SGLANG = os.environ.get("AGENTLOOP_SKIP_SGLANG") == "1"


def require_sglang() -> None:
    """Skip the calling test when real SGLang servers are switched off."""
    if SKIP_SGLANG:
        pytest.skip("AGENTLOOP_SKIP_SGLANG=1")


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    return ensure_tiny_model()


@dataclass
class SGLangServerHandle:
    url: str
    server: object  # agentloop.inference.launcher.LocalServer
    model_path: Path


@pytest.fixture(scope="session")
def sglang_server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServerHandle]:
    require_sglang()
    from agentloop.inference.launcher import LocalServer

    log = tmp_path_factory.mktemp("sglang") / "server.log"
    server = LocalServer(tiny_model_path, device="cpu", log_path=log, startup_timeout_s=280).start()
    try:
        asyncio.run(server.wait_ready())
        yield SGLangServerHandle(url=server.url, server=server, model_path=tiny_model_path)
    finally:
        server.stop()
