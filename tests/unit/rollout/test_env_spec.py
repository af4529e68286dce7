"""`--env LIB:SPEC`: the overrides it stands for, the rows it writes (cached by settings), and the verifiers worker's
agent config; bad specs named."""

from __future__ import annotations

import json
import shlex

import pytest

from agentloop.config import load_config
from agentloop.data import load_file
from agentloop.errors import ConfigError
from agentloop.loops.verifiers_env import WORKER, agent_config, verifiers_python
from agentloop.rollout.env_spec import env_library, env_overrides, prepare_env_rows


def test_each_library_spec():
    assert env_overrides("openenv:http://h:1") == ["rollout.loop=openenv_loop", 'envs.openenv.url="http://h:1"']
    assert env_overrides("textarena:TicTacToe-v0") == ["rollout.loop=textarena_loop",
                                                       'envs.textarena.env_id="TicTacToe-v0"']
    assert env_overrides("reasoning-gym:gcd, leg_counting") == ['envs.reasoning_gym.tasks=["gcd", "leg_counting"]']
    assert env_overrides('verifiers:my_env.py:{"n": 3}') == ["rollout.loop=verifiers_loop",
                                                            'envs.verifiers.env="my_env.py"', 'envs.verifiers.args={"n": 3}']
    cfg = load_config(None, env_overrides("verifiers:vf-x") + ["envs.verifiers.args.n=5"])
    assert cfg.rollout.loop == "verifiers_loop" and cfg.envs.verifiers.env == "vf-x" and cfg.envs.verifiers.args == {"n": 5}


@pytest.mark.parametrize("spec", ["gym:x", "openenv", "openenv:", "verifiers:m:{bad json", "verifiers:m:{}x"])
def test_bad_specs_are_named(spec):
    with pytest.raises(ConfigError, match="--env"):
        env_overrides(spec)


def test_rows_written_once_per_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTLOOP_CACHE_DIR", str(tmp_path))
    cfg = load_config(None, env_overrides("openenv:http://h:1") + ["envs.openenv.episodes=5",
                                                                    "envs.openenv.system_prompt=hi"])
    assert env_library(cfg) == "openenv"
    said = prepare_env_rows(cfg)
    samples = load_file(cfg.data.path)
    assert said and len(samples) == 5 and samples[3].extra_info["openenv"]["reset"] == {"seed": 3}
    assert samples[0].messages == [{"role": "system", "content": "hi"}] and samples[0].data_source == "openenv"
    again = load_config(None, env_overrides("openenv:http://h:1") + ["envs.openenv.episodes=5",
                                                                      "envs.openenv.system_prompt=hi"])
    prepare_env_rows(again)
    assert again.data.path == cfg.data.path  # the same settings: the same file (a resumed run finds its rows)
    other = load_config(None, env_overrides("openenv:http://h:1") + ["envs.openenv.episodes=6"])
    prepare_env_rows(other)
    assert other.data.path != cfg.data.path
    given = load_config(None, env_overrides("openenv:http://h:1") + ["data.path=mine.jsonl"])
    assert prepare_env_rows(given) is None and given.data.path == "mine.jsonl"


def test_textarena_and_reasoning_gym_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTLOOP_CACHE_DIR", str(tmp_path))
    cfg = load_config(None, env_overrides("textarena:GuessTheNumber-v0") + ["envs.textarena.episodes=3"])
    prepare_env_rows(cfg)
    assert [s.extra_info["textarena"]["seed"] for s in load_file(cfg.data.path)] == [0, 1, 2]
    pytest.importorskip("reasoning_gym", reason="the envs extra (reasoning-gym) is not installed")
    cfg = load_config(None, env_overrides("reasoning_gym:gcd,products") + ["envs.reasoning_gym.size=4",
                                                                           "envs.reasoning_gym.val_size=2"])
    prepare_env_rows(cfg)
    train, val = load_file(cfg.data.path), load_file(cfg.data.val_path)
    assert len(train) == 8 and len(val) == 4 and {s.extra_info["task"] for s in train} == {"gcd", "products"}
    assert {s.messages[-1]["content"] for s in train}.isdisjoint({s.messages[-1]["content"] for s in val})


def test_verifiers_worker_command(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTLOOP_ENV_VENVS", str(tmp_path / "none"))
    cfg = load_config(None, env_overrides('verifiers:my_env.py:{"n": 2}'))
    with pytest.raises(ConfigError, match="agentloop envs setup verifiers"):
        verifiers_python(cfg.envs.verifiers)
    py = tmp_path / "python"
    py.write_text("")
    cfg = load_config(None, env_overrides('verifiers:my_env.py:{"n": 2}') + [f"envs.verifiers.python={py}",
                                                                             "envs.verifiers.workers=3"])
    agent = agent_config(cfg)
    argv = shlex.split(agent.command)
    assert argv[:3] == [str(py), str(WORKER), "serve"] and json.loads(argv[argv.index("--args") + 1]) == {"n": 2}
    assert agent.workers == 3 and agent.send_answer and agent.entry is None
