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

SERVER_START_GUARD_S = 600.0
"""How long a test's CPU SGLang server may take to come up: a guard against a hang, never a verdict on the machine's
speed (one took over 280 s on a 2-core box shared by four test runs)."""


def require_sglang() -> None:
    """Skip the calling test when real SGLang servers are switched off."""
    if SKIP_SGLANG:
        pytest.skip("AGENTLOOP_SKIP_SGLANG=1")


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    return ensure_tiny_model()


def _session_zygote(start, env_var: str, wanted: bool, tmp_path_factory: pytest.TempPathFactory,
                    name: str) -> Iterator[Path | None]:
    """A zygote for the session (`start(sock, log)`), named in os.environ by `env_var` so that every process the tests
    start inherits it; none when not `wanted` or when the caller named one already."""
    if not wanted or os.environ.get(env_var) is not None:
        yield None
        return
    base = tmp_path_factory.mktemp(name)
    sock = base / "zygote.sock"
    proc = start(sock, base / "zygote.log")
    os.environ[env_var] = str(sock)
    try:
        yield sock
    finally:
        os.environ.pop(env_var, None)
        proc.terminate()  # it kills the processes it forked, then exits
        proc.wait(timeout=30)  # a hang guard: a zygote that outlives its SIGTERM is a bug, shown at teardown


@pytest.fixture(scope="session", autouse=True)
def sglang_zygote(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path | None]:
    """One zygote for the session's CPU SGLang servers (agentloop.inference.sglang_cpu.zygote): every server a test
    starts, in this process or in the runs it starts (they inherit AGENTLOOP_SGLANG_ZYGOTE), is forked from a process
    that imported SGLang once, instead of importing it again (~20 s of a server's start on the 2-core box). Servers
    whose environment it cannot serve are spawned as without it; tests of the spawned path unset the variable.
    Started only when the session runs tests that may start servers, and not over a zygote the caller named."""
    from agentloop.inference.sglang_cpu import zygote

    wants = any(item.get_closest_marker("sglang") or item.get_closest_marker("slow") or "integration" in item.nodeid
                for item in request.session.items)
    yield from _session_zygote(zygote.start, zygote.ENV, wants and not SKIP_SGLANG, tmp_path_factory, "zygote")


@pytest.fixture(scope="session", autouse=True)
def learner_zygote(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path | None]:
    """One zygote for the session's one-rank learners (agentloop.train.trainer.zygote): every `agentloop train` a test
    runs (in this process or in a command it starts: they inherit AGENTLOOP_LEARNER_ZYGOTE) forks its learner from a
    process that imported torch, transformers and the learner once, instead of importing them again (~7 s of a
    learner's start on the 2-core box). Learners it cannot serve (torchrun's ranks, another environment) are spawned
    as without it. Started only when the session runs tests that may train, and not over a zygote the caller named."""
    from agentloop.train.trainer import zygote

    wants = any(item.get_closest_marker("slow") or "integration" in item.nodeid for item in request.session.items)
    yield from _session_zygote(zygote.start, zygote.ZYGOTE_ENV, wants, tmp_path_factory, "learner-zygote")


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
    # a hang guard, not a verdict: on a loaded 2-core box the CPU server took over 280 s to come up
    server = LocalServer(tiny_model_path, device="cpu", log_path=log, startup_timeout_s=SERVER_START_GUARD_S).start()
    try:
        asyncio.run(server.wait_ready())
        yield SGLangServerHandle(url=server.url, server=server, model_path=tiny_model_path)
    finally:
        server.stop()


@dataclass
class RayNodes:
    """One local Ray cluster of two simulated nodes for the whole session (`ray_nodes`)."""

    address: str
    a: Path
    """node_a's scratch dir (its workers' TMPDIR); the node has the custom resource node_a."""
    b: Path
    """node_b's, with the resource node_b."""
    driver: Path
    """A scratch dir of the driver's own (runs' directories)."""


@pytest.fixture(scope="session")
def ray_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayNodes]:
    """Every test that needs Ray shares this cluster (started once: a raylet pair costs tens of seconds on a loaded
    2-core box): the handle's contract tests (tests/unit/train/test_handle.py) and the runs of
    tests/integration/test_ray_cluster.py. Each test connects (`ray.init(address=...)`) and disconnects itself, and
    names its actors after its own run, so none sees another's. A test that must kill a node or change the cluster's
    settings makes its own (tests/integration/test_ray_auth.py: a `ray start` head with token auth)."""
    pytest.importorskip("ray", reason="cluster.backend=ray needs `pip install 'agentloop[ray]'` (scripts/setup.sh)")
    from ray.cluster_utils import Cluster

    base = tmp_path_factory.mktemp("ray")
    a, b, driver = base / "node_a", base / "node_b", base / "driver"
    for d in (a, b, driver):
        d.mkdir()
    common = {"num_cpus": 4, "object_store_memory": 200 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={
        **common, "resources": {"node_a": 4}, "env_vars": {"TMPDIR": str(a)}, "include_dashboard": False})
    try:
        cluster.add_node(**common, resources={"node_b": 4}, env_vars={"TMPDIR": str(b)})
        yield RayNodes(cluster.address, a, b, driver)
    finally:
        cluster.shutdown()
