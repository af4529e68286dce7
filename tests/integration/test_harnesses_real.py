"""Real agent harnesses, each in its own virtualenv (installed by this module from PyPI, cached), trained as their
users run them: `agent.command="ENV/bin/python examples/harnesses/X.py"` against the real CPU SGLang server
serving the warm-started calculator model. Each runs a few episodes through openai_agent_loop: no error
records, every model token's recorded logprob what the server gives it re-reading the record (token exact).

    agents_sdk (Responses)   the OpenAI Agents SDK's default model path, POST /v1/responses
    agents_sdk (chat)        the same SDK on chat completions (AGENT_API=chat)
    langgraph_react          LangGraph's prebuilt ReAct agent on langchain-openai
    smolagents               smolagents' ToolCallingAgent on its OpenAIServerModel

The envs: HARNESS_PINS below, built once into $AGENTLOOP_HARNESS_ENVS (default ~/.cache/agentloop/harness-envs),
all three at once, keyed by their pins (a changed pin builds a new one). They hold openai 3.x, which the main
environment cannot (sglang pins openai 2.x): that is why command mode is the way to run these SDKs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_gateway_real import ROOT, TOL, _rollout, rescore, warm  # noqa: F401 - the fixture

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

HARNESS_PINS = {
    "agents_sdk": ["openai-agents==0.24.0"],
    "langgraph": ["langgraph==1.2.24", "langchain-openai==1.7.4"],
    "smolagents": ["smolagents[openai]==1.26.0"],
}
"""The harness envs: each a `python -m venv` with exactly these installed (their dependencies resolved by pip)."""

HARNESSES = ROOT / "examples" / "harnesses"


def env_dir(name: str) -> Path:
    root = Path(os.environ.get("AGENTLOOP_HARNESS_ENVS", Path.home() / ".cache" / "agentloop" / "harness-envs"))
    tag = hashlib.sha256(" ".join(HARNESS_PINS[name]).encode()).hexdigest()[:10]
    return root / f"{name}-{tag}"


def build_envs(names: list[str], timeout_s: float = 900) -> dict[str, Path]:
    """Each env of `names`, built (in parallel) unless a complete one is cached; a failed build names its log."""
    todo = {n: env_dir(n) for n in names if not (env_dir(n) / "ok").exists()}
    procs = {}
    for name, path in todo.items():
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        script = (f"{sys.executable} -m venv {tmp} && {tmp}/bin/python -m pip install -q "
                  + " ".join(f"'{p}'" for p in HARNESS_PINS[name]))
        log = open(tmp.parent / f"{name}.log", "w")
        procs[name] = (subprocess.Popen(["sh", "-c", script], stdout=log, stderr=subprocess.STDOUT), log, tmp, path)
    for name, (proc, log, tmp, path) in procs.items():
        try:
            rc = proc.wait(timeout_s)
        finally:
            log.close()
        if rc != 0:
            raise RuntimeError(f"installing the {name} harness env failed (rc {rc}); see {log.name}")
        # built aside and renamed when complete: a build cut midway is never taken for a cached env (its bin/python
        # is a symlink to the interpreter, so it runs from the new place; console scripts are not used)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        (path / "ok").touch()
    return {n: env_dir(n) for n in names}


@pytest.fixture(scope="module")
def envs() -> dict[str, Path]:
    return build_envs(list(HARNESS_PINS))


CASES = {
    "agents_sdk_responses": ("agents_sdk", "agents_sdk.py", {}),
    "agents_sdk_chat": ("agents_sdk", "agents_sdk.py", {"AGENT_API": "chat"}),
    "langgraph_react": ("langgraph", "langgraph_react.py", {}),
    "smolagents": ("smolagents", "smolagents_tool_calling.py", {}),
}


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", list(CASES))
def test_a_real_harness_through_agent_command_is_token_exact(warm, envs, case):  # noqa: F811 - the fixture
    url, model = warm
    env_name, script, env = CASES[case]
    python = envs[env_name] / "bin" / "python"
    extra = [f"agent.command=\"{python} {HARNESSES / script}\"", "agent.timeout_s=300",
             "sampling.max_new_tokens=160", *(f"agent.env.{k}={v}" for k, v in env.items())]
    recs = _rollout(url, model, {case: ("openai_agent_loop", None)}, 2, 2, *extra)[case]
    errors = [r.error for r in recs if r.error is not None]
    assert not errors, errors
    assert recs and all(r.num_model_tokens > 0 and r.reward is not None for r in recs)
    worst = rescore(url, recs)
    print(f"{case}: {len(recs)} records, {sum(r.num_turns for r in recs)} turns, mean reward "
          f"{sum(r.reward for r in recs) / len(recs):.2f}, max |recorded - re-scored| logprob {worst:.2e}")
    assert worst < TOL
