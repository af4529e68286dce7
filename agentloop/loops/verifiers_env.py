"""verifiers_loop: a verifiers environment (`load_environment(...)` of an installed module or a .py file: its
SingleTurnEnv / MultiTurnEnv / ToolEnv / StatefulToolEnv and its Rubric, unchanged) runs its own rollout code
against the gateway's OpenAI endpoint, and its rubric gives the reward.

verifiers cannot live in agentloop's interpreter (it needs openai >= 2.9; sglang pins openai 2.8.0), so it runs in
a virtualenv of its own, as a long-lived harness worker of `openai_agent_loop` (agent.workers): the worker
(agentloop/loops/verifiers_worker.py, run by that virtualenv's Python) loads the environment once and runs each
episode as verifiers' `env.run_rollout(input, client, "policy", sampling_args)` on the episode's gateway
session; the gateway records the exact tokens (model turns mask 1, the environment's messages and tool results
mask 0) and the worker sends back the rubric's reward (and metrics) on the result channel. Every gateway rule
holds: sampling is the policy's, failures are error records with verifiers' message (a rollout that ended in
verifiers' error state, a rubric that gave no reward, an exception: AgentError; past envs.verifiers.timeout_s:
the policy's timeout).

    VerifiersLoop        openai_agent_loop with agent.* made from envs.verifiers (the worker command, workers,
                         concurrency, timeout, the answer sent: the rubric needs the row's answer and info)
    verifiers_python     the virtualenv's interpreter: envs.verifiers.python, else the one
                         `agentloop envs setup verifiers` built
    export_rows          the environment's dataset / eval_dataset as verl rows (the worker's `export` mode)
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

from agentloop.config import Config
from agentloop.envs_config import VerifiersEnvConfig
from agentloop.errors import ConfigError, EnvError
from agentloop.gateway.config import AgentConfig
from agentloop.loops.openai_agent import OpenAIAgentLoop
from agentloop.loops.registry import register_agent_loop

WORKER = Path(__file__).with_name("verifiers_worker.py")
VERIFIERS_PIN = "verifiers==0.3.1"
"""The verifiers release whose classic environments (SingleTurnEnv, MultiTurnEnv, ToolEnv, StatefulToolEnv, Rubric:
`import verifiers as vf`) `agentloop envs setup verifiers` installs: the last one that has them (0.4.0 keeps only
the new `verifiers.v1` stack)."""


def env_venvs_dir() -> Path:
    """`$AGENTLOOP_ENV_VENVS`, else ~/.cache/agentloop/env-venvs (or under $AGENTLOOP_CACHE_DIR)."""
    if os.environ.get("AGENTLOOP_ENV_VENVS"):
        return Path(os.environ["AGENTLOOP_ENV_VENVS"])
    cache = os.environ.get("AGENTLOOP_CACHE_DIR")
    return (Path(cache) if cache else Path.home() / ".cache" / "agentloop") / "env-venvs"


def default_venv() -> Path:
    return env_venvs_dir() / VERIFIERS_PIN.replace("==", "-")


def verifiers_python(cfg: VerifiersEnvConfig) -> str:
    """The interpreter that runs the worker (ConfigError naming how to get one when there is none)."""
    if cfg.python:
        if not Path(cfg.python).is_file():
            raise ConfigError(f"envs.verifiers.python={cfg.python!r} does not exist")
        return cfg.python
    py = default_venv() / "bin" / "python"
    if not (default_venv() / "ok").is_file():
        raise ConfigError(f"no verifiers virtualenv at {default_venv()}: run `agentloop envs setup verifiers` (it "
                          f"installs {VERIFIERS_PIN}), or set envs.verifiers.python to the Python of one")
    return str(py)


def setup_venv(extra: list[str] | None = None, *, timeout_s: float = 1800) -> Path:
    """Build (once) the virtualenv of `agentloop envs setup verifiers`: python -m venv, pip install the pin and
    `extra` (your environment's package). Built aside and renamed when complete."""
    import shutil
    import sys

    path = default_venv()
    if (path / "ok").is_file() and not extra:
        return path
    tmp = path.with_name(path.name + ".tmp")
    target = path if not (path / "ok").is_file() else None
    if target is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True, timeout=timeout_s)
        subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", VERIFIERS_PIN, *(extra or [])],
                       check=True, timeout=timeout_s)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        (path / "ok").touch()
    else:
        subprocess.run([str(path / "bin" / "python"), "-m", "pip", "install", "-q", *extra], check=True,
                       timeout=timeout_s)
    return path


def worker_command(cfg: VerifiersEnvConfig) -> str:
    if not cfg.env:
        raise ConfigError("verifiers_loop needs the environment: envs.verifiers.env=MODULE or path/to/env.py (or "
                          "--env verifiers:MODULE)")
    return " ".join(shlex.quote(a) for a in (
        verifiers_python(cfg), str(WORKER), "serve", "--env", cfg.env, "--args", json.dumps(cfg.args),
        "--sampling-args", json.dumps(cfg.sampling_args)))


def agent_config(cfg: Config) -> AgentConfig:
    """agent.* for the verifiers worker (agent.env, agent.cwd and agent.max_tokens_per_call are kept)."""
    v = cfg.envs.verifiers
    return cfg.agent.model_copy(update={"command": worker_command(v), "entry": None, "workers": v.workers,
                                        "worker_concurrency": v.worker_concurrency, "timeout_s": v.timeout_s,
                                        "send_answer": True})


_CONFIGS: dict[int, tuple[Config, Config]] = {}


@register_agent_loop("verifiers_loop")
class VerifiersLoop(OpenAIAgentLoop):
    """See the module doc; settings in `config.envs.verifiers`."""

    def __init__(self, *, config: Config, **kwargs: Any):
        made = _CONFIGS.get(id(config))
        if made is None or made[0] is not config:  # once per config object: the episodes of a run share it
            made = _CONFIGS[id(config)] = (config, config.model_copy(update={"agent": agent_config(config)}))
        super().__init__(config=made[1], **kwargs)


def export_rows(cfg: VerifiersEnvConfig, split: str, out: Path, n: int | None = None,
                timeout_s: float = 600) -> Path:
    """The environment's `split` dataset as verl rows in `out` (JSON lines), by the worker in the virtualenv."""
    if not cfg.env:
        raise ConfigError("envs.verifiers.env is not set")
    cmd = [verifiers_python(cfg), str(WORKER), "export", "--env", cfg.env, "--args", json.dumps(cfg.args),
           "--split", split, "--out", str(out)] + (["--n", str(n)] if n is not None else [])
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise EnvError(f"exporting the {split} rows of verifiers environment {cfg.env!r} failed (rc "
                       f"{proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return out


__all__ = ["VERIFIERS_PIN", "VerifiersLoop", "agent_config", "default_venv", "env_venvs_dir", "export_rows",
           "setup_venv", "verifiers_python", "worker_command"]
