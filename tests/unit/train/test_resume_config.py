"""The resume rule: `agentloop train --run-dir X` of an existing run goes on with X/config.yaml plus only the
values given now, refuses a changed setting that carries state unless its force flag (--force-settings for the model and optimizer state, --force-data for the rows; naming each key with
its old and new value), and rewrites config.yaml only after those checks. Through the CLI's `build_config`
and `main`, and the orchestrator's `load_data` + `make_run_dir` as `run_train` calls them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from agentloop.cli import build_config, main, make_parser
from agentloop.config import dump_config, validate_for_training
from agentloop.data import write_jsonl
from agentloop.errors import ConfigError
from agentloop.train.orchestrator.cursor import DataCursor
from agentloop.train.orchestrator.loop import load_data, resolve_learner_defaults
from agentloop.train.orchestrator.resume import config_changes, is_pinned
from agentloop.util.rundir import make_run_dir


def own_rows(path: Path, n: int) -> Path:
    return write_jsonl([{"data_source": "agentloop/arithmetic", "prompt": [{"role": "user", "content": f"q {i}"}],
                         "reward_model": {"style": "rule", "ground_truth": str(i)}} for i in range(n)], path)


def cli_cfg(*argv: str):
    return build_config(make_parser().parse_args(["train", *argv]))


def prepare(*argv: str):
    """What `run_train` does with the config before anything starts: checks, defaults, data, run dir."""
    cfg = cli_cfg(*argv)
    validate_for_training(cfg)
    resolve_learner_defaults(cfg)
    load_data(cfg)
    return cfg, make_run_dir(cfg)


@pytest.fixture
def run(tmp_path):
    """A run started as `agentloop train --data own.jsonl train.steps=2 ... --run-dir run`."""
    own = own_rows(tmp_path / "own.jsonl", 40)
    cfg, run_dir = prepare("--data", str(own), "--run-dir", str(tmp_path / "run"), "train.steps=2",
                           "train.prompts_per_step=4", "rollout.n_samples=2", "learner.lr=0.001")
    return run_dir, cfg


def test_the_run_goes_on_with_its_saved_config_plus_the_values_given_now(run, capsys):
    run_dir, first = run
    saved = (run_dir / "config.yaml").read_text()
    cfg = cli_cfg("--run-dir", str(run_dir), "train.steps=3")
    # the saved run, not the embedded preset (which has 8 samples, 8 prompts, lr 2e-4, the calculator set)
    assert (cfg.rollout.n_samples, cfg.train.prompts_per_step, cfg.learner.lr) == (2, 4, 0.001)
    assert cfg.data == first.data and cfg.data.val_holdout == 4 and cfg.train.steps == 3
    assert config_changes(first, cfg) == [("train.steps", 2, 3)]
    assert "resuming it with its config.yaml; changed: train.steps 2 -> 3" in capsys.readouterr().err
    assert (run_dir / "config.yaml").read_text() == saved  # nothing written by building the config
    # the same command again changes nothing: the config is saved byte for byte as it was
    again, _ = prepare("--run-dir", str(run_dir))
    assert (run_dir / "config.yaml").read_text() == saved and not (run_dir / "config.prev.yaml").exists()
    assert dump_config(again) == saved
    # a change that is allowed: saved after the checks, the previous config kept
    prepare("--run-dir", str(run_dir), "train.steps=3")
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["steps"] == 3
    assert (run_dir / "config.prev.yaml").read_text() == saved


def test_a_changed_setting_that_carries_state_is_refused_naming_each_key_and_its_flag(run, tmp_path, capsys):
    run_dir, first = run
    saved = (run_dir / "config.yaml").read_text()
    other = own_rows(tmp_path / "other.jsonl", 40)
    with pytest.raises(ConfigError) as e:
        cli_cfg("--run-dir", str(run_dir), "--model", str(tmp_path / "other_model"), "--data", str(other),
                "--val-data", str(other), "algo.kl_coef=0.5", "learner.lr=0.1", "train.steps=3")
    msg = str(e.value)
    for line in (f"model.path: None -> '{tmp_path / 'other_model'}' (--force-settings)",
                 f"data.path: '{first.data.path}' -> '{other}' (--force-data)",
                 f"data.val_path: None -> '{other}' (--force-data)"):
        assert line in msg
    # settings that carry no state change freely on a resume
    assert "train.steps" not in msg and "algo.kl_coef" not in msg and "learner.lr" not in msg
    # through the CLI: exit 2, the error on stderr, config.yaml untouched, nothing started
    assert main(["train", "--run-dir", str(run_dir), "--model", str(tmp_path / "other_model")]) == 2
    assert f"model.path: None -> '{tmp_path / 'other_model'}'" in capsys.readouterr().err
    assert (run_dir / "config.yaml").read_text() == saved and not (run_dir / "config.prev.yaml").exists()
    for key in ("data.max_samples=10", "data.prompt_key=messages", "data.val_holdout=0", "rollout.seed=7",
                "learner.betas=[0.8,0.9]", "learner.adam_eps=1e-6", "learner.dtype=float32"):
        with pytest.raises(ConfigError, match=rf"{key.split('=')[0]}: .* -> "):
            cli_cfg("--run-dir", str(run_dir), key)
    cfg = cli_cfg("--run-dir", str(run_dir), "learner.checkpoint_every=9", "algo.estimator=rloo", "learner.lr=0.01")
    assert (cfg.learner.checkpoint_every, cfg.algo.estimator, cfg.learner.lr) == (9, "rloo", 0.01)


def test_each_force_flag_accepts_its_own_kind_of_change_only(run, tmp_path):
    run_dir, _ = run
    with pytest.raises(ConfigError, match=r"learner.adam_eps: .* \(--force-settings\)"):
        cli_cfg("--run-dir", str(run_dir), "--force-data", "learner.adam_eps=1e-6", "rollout.seed=9")
    with pytest.raises(ConfigError, match=r"rollout.seed: 0 -> 9 \(--force-data\)"):
        cli_cfg("--run-dir", str(run_dir), "--force-settings", "learner.adam_eps=1e-6", "rollout.seed=9")
    cfg = cli_cfg("--run-dir", str(run_dir), "--force-settings", "--force-data", "learner.adam_eps=1e-6",
                  "rollout.seed=9")
    assert (cfg.learner.adam_eps, cfg.rollout.seed) == (1e-6, 9)


def test_force_accepts_the_change_and_keeps_the_old_config(run, tmp_path):
    run_dir, _ = run
    saved = (run_dir / "config.yaml").read_text()
    cfg, _ = prepare("--run-dir", str(run_dir), "--force", "learner.adam_eps=1e-6")
    assert cfg.learner.adam_eps == 1e-6 and cfg.rollout.n_samples == 2
    assert (run_dir / "config.prev.yaml").read_text() == saved
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["learner"]["adam_eps"] == 1e-6


def test_a_config_file_given_with_an_existing_run_dir_is_overrides_too(run, tmp_path):
    run_dir, first = run
    same = tmp_path / "same.yaml"
    same.write_text(yaml.safe_dump({"train": {"steps": 5}, "rollout": {"n_samples": 2}}))
    cfg = cli_cfg("--config", str(same), "--run-dir", str(run_dir))
    assert (cfg.train.steps, cfg.learner.lr, cfg.data.path) == (5, 0.001, first.data.path)  # the rest as saved
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump({"learner": {"adam_eps": 1e-6}, "train": {"steps": 5}}))
    with pytest.raises(ConfigError, match=r"learner.adam_eps: .* -> 1e-06"):
        cli_cfg("--config", str(changed), "--run-dir", str(run_dir))


def test_the_same_file_named_another_way_is_no_change(run, tmp_path, monkeypatch):
    run_dir, first = run
    monkeypatch.chdir(tmp_path)
    cfg = cli_cfg("--run-dir", str(run_dir), "--data", "own.jsonl")
    assert Path(cfg.data.path).resolve() == Path(first.data.path).resolve()


def test_a_new_or_empty_run_dir_is_a_fresh_run_from_the_preset(tmp_path):
    (tmp_path / "empty").mkdir()
    for d in (tmp_path / "new", tmp_path / "empty"):
        cfg = cli_cfg("--run-dir", str(d), "--model", str(tmp_path / "m"))
        assert cfg.data.builtin == "calculator_train" and cfg.rollout.n_samples == 8  # the embedded default


def test_a_run_dir_saved_before_the_data_section_resumes_with_the_rows_it_used(tmp_path, run):
    """config.yaml of an older run: train.data_path & co., data.* unused by its training."""
    run_dir, first = run
    old = yaml.safe_load((run_dir / "config.yaml").read_text())
    for k in ("val_path", "val_builtin", "val_max_samples", "val_holdout"):
        old["data"].pop(k)
    old["data"].update(path=None, builtin="arithmetic", prompt_key="prompt")
    old["train"].update(data_path=first.data.path, builtin="calculator_train", val_path=None,
                        val_builtin="calculator", val_max_samples=32)
    legacy = tmp_path / "legacy"
    shutil.copytree(run_dir, legacy)
    (legacy / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    cfg = cli_cfg("--run-dir", str(legacy))
    assert (cfg.data.path, cfg.data.val_holdout, cfg.data.val_builtin) == (first.data.path, 0, None)
    data = load_data(cfg)
    assert len(data.train) == 40 and data.val == []  # as it trained: every row (it validated on none of them)


def test_pinned_keys():
    assert all(is_pinned(k) for k in ("model.path", "data.path", "data.val_path", "learner.betas", "learner.adam_eps",
                                      "learner.dtype", "algo.kl_ctrl", "rollout.seed", "data.val_holdout"))
    assert not any(is_pinned(k) for k in ("train.steps", "train.val_every", "data.val_max_samples", "algo.kl_coef",
                                          "learner.lr", "learner.ranks", "learner.micro_batch_tokens",
                                          "rollout.n_samples", "server.urls", "data.apply_chat_template"))


def test_turning_validation_off_on_resume_keeps_the_training_rows(run):
    """train.val_every may change on resume; the held-out rows stay out, so the data fingerprint matches."""
    run_dir, first = run
    before = DataCursor(load_data(cli_cfg("--run-dir", str(run_dir))).train, 0)
    off = load_data(cli_cfg("--run-dir", str(run_dir), "train.val_every=0"))
    assert off.val == [] and DataCursor.from_state(off.train, 0, before.state()).matches(before.state())


@pytest.mark.parametrize("backend,nnodes,nproc,ranks", [("local", 1, 2, 2), ("local", 2, 4, 8), ("ray", 1, 3, 3)])
def test_a_run_dir_saved_before_the_renames_resumes_with_the_same_meaning(tmp_path, run, backend, nnodes, nproc,
                                                                          ranks):
    """config.yaml of an older run: train.sync (dead), learner.nproc (one host's ranks under torchrun, all of them
    under Ray), learner.checkpoint_async. Its learner keeps its ranks and its checkpoint writes; a user config
    naming the old keys is an error (tests/unit/train/test_train_data.py)."""
    run_dir, _ = run
    old = yaml.safe_load((run_dir / "config.yaml").read_text())
    old["train"]["sync"] = "disk"
    learner = old["learner"]
    learner.pop("ranks")
    learner.update(nproc=nproc, nnodes=nnodes, checkpoint_async=learner.pop("checkpoint_background") and "off")
    if nnodes > 1:
        learner["rdzv_endpoint"] = "h:29400"
    old["cluster"]["backend"] = backend
    legacy = tmp_path / "legacy"
    shutil.copytree(run_dir, legacy)
    (legacy / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    cfg = cli_cfg("--run-dir", str(legacy))
    assert (cfg.learner.world_size, cfg.learner.ranks_per_node) == (ranks, nproc)
    assert cfg.learner.checkpoint_background == "off" and "sync" not in cfg.train.model_dump()
