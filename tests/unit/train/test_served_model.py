"""What the servers serve against model.path (agentloop.train.orchestrator.served_model), with the scripted server answering
/model_info as SGLang 0.5.23 does: another architecture or other sizes are an error naming both sides; other
weights the server was started with are an error; a server some run has updated (another weight version) is
reloaded with model.path at version 0 before step 1 of a fresh run, and left to the resume otherwise; a path
that cannot be read here is a warning. And `agentloop train` with server URLs needs --model."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch

from agentloop.config import ManagerConfig, load_config, validate_for_training
from agentloop.errors import ConfigError
from agentloop.server_manager import ServerManager
from agentloop.train.orchestrator.served_model import align_served_weights, check_served_model
from tests.fakes.fake_sglang import FakeSGLang

QWEN = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}


def _save(d: Path, *, seed: int, vocab: int = 96) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served")
    ours = _save(root / "ours", seed=0)
    shutil.copytree(ours, root / "copy")
    return {"ours": ours, "copy": root / "copy", "other_weights": _save(root / "other_weights", seed=1),
            "other_vocab": _save(root / "other_vocab", seed=0, vocab=128)}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


async def _served(ours: Path, *fakes_kw: dict, first: int = 1):
    """Start one fake per dict of attributes; check and align them against `ours`. Returns (error or None,
    warnings, the fakes' admin calls, their model_info afterwards, the manager's versions)."""
    fakes = [await FakeSGLang(**{**QWEN, **kw}).start() for kw in fakes_kw]
    said: list[str] = []
    try:
        async with ServerManager([f.url for f in fakes], ManagerConfig(health_interval_s=60),
                                 initial_version=0) as sm:
            try:
                served = await check_served_model(sm, ours, say=said.append)
                await align_served_weights(sm, served, ours, first, say=said.append)
                err = None
            except ConfigError as e:
                err = str(e)
            return (err, said, [[a for a in f.admin if a[0] != "/server_info"] for f in fakes],
                    [(f.model_path, f.weight_version) for f in fakes], sm.server_versions())
    finally:
        for f in fakes:
            await f.stop()


def test_another_architecture_or_other_sizes_are_refused_naming_both(dirs):
    err, *_ = run(_served(dirs["ours"], {"model_path": "/srv/llama", "model_type": "llama",
                                         "architectures": ["LlamaForCausalLM"]}))
    assert "serves /srv/llama (model_type llama, LlamaForCausalLM)" in err
    assert f"model.path is {dirs['ours']} (model_type qwen2, Qwen2ForCausalLM)" in err
    assert "--model" in err
    err, *_ = run(_served(dirs["ours"], {"model_path": str(dirs["other_vocab"])}))
    assert f"serves {dirs['other_vocab']}" in err and f"model.path {dirs['ours']}" in err
    assert "vocab_size 128 vs 96" in err


def test_other_weights_the_server_was_started_with_are_refused(dirs):
    err, _, admin, *_ = run(_served(dirs["ours"], {"model_path": str(dirs["other_weights"])}))
    assert f"serves {dirs['other_weights']} (weight_version 'default')" in err
    assert "same architecture and sizes as model.path" in err and "other weights" in err
    assert admin == [[]]  # nothing was loaded into it


def test_the_servers_own_model_or_a_copy_passes_untouched(dirs):
    err, said, admin, info, versions = run(_served(dirs["ours"], {"model_path": str(dirs["ours"])},
                                                   {"model_path": str(dirs["copy"])}))
    assert err is None and said == [] and admin == [[], []]
    assert set(versions.values()) == {0}


def test_a_server_at_another_version_is_reloaded_at_version_0_before_step_1(dirs):
    """One server left at version 5 with a run's weights, one at version 3 of model.path itself: both get
    model.path at version 0; the manager knows them at 0."""
    err, said, admin, info, versions = run(_served(
        dirs["ours"], {"model_path": str(dirs["other_weights"]), "weight_version": "5"},
        {"model_path": str(dirs["ours"]), "weight_version": "3"}))
    assert err is None
    for calls in admin:
        assert calls == [("/update_weights_from_disk", {"model_path": str(dirs["ours"]), "flush_cache": True,
                                                        "weight_version": "0"})]
    assert info == [(str(dirs["ours"]), "0")] * 2 and set(versions.values()) == {0}
    assert len(said) == 2 and "at weight version '5'; a fresh run starts at version 0: reloading" in said[0]


def test_a_resumed_run_leaves_the_reload_to_the_resume(dirs):
    err, said, admin, *_ = run(_served(dirs["ours"], {"model_path": str(dirs["other_weights"]),
                                                      "weight_version": "5"}, first=4))
    assert err is None and admin == [[]] and said == []


def test_a_path_that_cannot_be_read_here_is_a_warning_after_the_architecture_check(dirs):
    err, said, admin, *_ = run(_served(dirs["ours"], {"model_path": "org/some-hub-model"}))
    assert err is None and admin == [[]]
    assert len(said) == 1 and "'org/some-hub-model', which cannot be read here" in said[0]
    assert "(qwen2, Qwen2ForCausalLM)" in said[0]


def test_a_server_that_does_not_say_is_an_error(dirs):
    err, *_ = run(_served(dirs["ours"], {"healthy": False}))  # /model_info answers 503
    assert "did not answer GET /model_info" in err


def test_train_with_server_urls_needs_model():
    cfg = load_config(None, ['server.urls=["http://127.0.0.1:1"]'])
    with pytest.raises(ConfigError, match=r"server\.urls \(--server-url\) is set but model\.path \(--model\) is not"):
        validate_for_training(cfg)
    validate_for_training(load_config(None, ['server.urls=["http://127.0.0.1:1"]', 'model.path="/m"']))
    validate_for_training(load_config(None, []))  # launched servers: the run knows what they serve
