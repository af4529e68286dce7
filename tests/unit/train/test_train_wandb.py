"""Optional W&B logging of `agentloop train`: a recording stand-in for the wandb package (not a
dependency of the project) checks what StepLog sends, and that a resumed run continues the same run."""

from __future__ import annotations

import sys
import types

import pytest

from agentloop.config import load_config
from agentloop.errors import ConfigError
from agentloop.train.orchestrator.loop import StepLog


class _FakeRun:
    def __init__(self, calls: list, kwargs: dict):
        self.calls, self.kwargs = calls, kwargs

    def log(self, data, step):
        self.calls.append(("log", step, dict(data)))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls: list = []
    mod = types.ModuleType("wandb")
    ids = iter(["run-a", "run-b"])
    mod.util = types.SimpleNamespace(generate_id=lambda: next(ids))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return _FakeRun(calls, kwargs)

    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


def _cfg(*extra: str):
    return load_config(None, ['server.urls=["http://127.0.0.1:1"]', "train.tensorboard=false", *extra])


def test_steps_go_to_wandb_and_a_resumed_run_continues_it(fake_wandb, tmp_path):
    log = StepLog(_cfg("train.wandb_project=agentloop-test"), tmp_path)
    log.log({"step": 1.0, "train/reward": 0.5, "learner/actor/kl_ref": 0.01, "note": "text"})
    log.close()
    (kind, init), logged, finished = fake_wandb
    assert kind == "init" and init["project"] == "agentloop-test" and init["name"] == tmp_path.name
    assert init["id"] == "run-a" and init["resume"] == "allow" and init["config"]["train"]["wandb_project"]
    assert logged == ("log", 1, {"train/reward": 0.5, "learner/actor/kl_ref": 0.01})
    assert finished == ("finish",)

    fake_wandb.clear()
    StepLog(_cfg("train.wandb_project=agentloop-test", "train.wandb_run_name=mine"), tmp_path).close()
    assert fake_wandb[0][1]["id"] == "run-a" and fake_wandb[0][1]["name"] == "mine"  # same W&B run


def test_missing_wandb_is_a_clear_config_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ConfigError, match="wandb package is not installed"):
        StepLog(_cfg("train.wandb_project=p"), tmp_path)


def test_off_by_default(tmp_path):
    assert StepLog(_cfg(), tmp_path).wandb is None
