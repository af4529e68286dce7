"""`agentloop train`'s rows come from the one `data` section: `--data` trains on the user's file, validation
runs on `--val-data` or on a slice held out of the training rows (never on a built-in set the user did not
ask for), `data.prompt_key` / `data.max_samples` apply, and the keys that moved fail naming their new place.
Through the CLI's `build_config` and the orchestrator's `load_data`, as `agentloop train` runs them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from agentloop.cli import build_config, main, make_parser
from agentloop.config import MOVED_KEYS, dump_config, load_config
from agentloop.data import builtin_rows, write_jsonl
from agentloop.errors import ConfigError, DataError
from agentloop.train.orchestrator.loop import load_data
from agentloop.util.rundir import make_run_dir

ROOT = Path(__file__).resolve().parents[3]


def own_rows(path: Path, n: int, *, key: str = "prompt", tag: str = "own") -> Path:
    rows = [{"data_source": "agentloop/arithmetic", key: [{"role": "user", "content": f"{tag} question {i}"}],
             "reward_model": {"style": "rule", "ground_truth": str(i)}} for i in range(n)]
    if key == "prompt":
        return write_jsonl(rows, path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # write_jsonl checks rows against `prompt`
    return path


def train_cfg(*argv: str):
    return build_config(make_parser().parse_args(["train", *argv]))


def texts(samples) -> list[str]:
    return [s.messages[-1]["content"] for s in samples]


def test_data_flag_trains_on_the_file_and_validates_on_a_held_out_slice(tmp_path):
    f = own_rows(tmp_path / "own.jsonl", 40)
    cfg = train_cfg("--data", str(f))  # the embedded default preset, whose own rows are built-in sets
    data = load_data(cfg)
    everything = [f"own question {i}" for i in range(40)]
    # min(32, 40 // 10) = 4 rows spread over the file, never trained on; the rest are the training rows
    assert texts(data.val) == ["own question 0", "own question 10", "own question 20", "own question 30"]
    assert texts(data.train) == [t for t in everything if t not in texts(data.val)]
    assert [s.index for s in data.val] == [0, 10, 20, 30]  # rows keep their place in the file
    assert {s.data_source for s in data.train + data.val} == {"agentloop/arithmetic"}
    # said in the progress output and recorded in the config saved with the run
    assert data.val_source == f"4 rows held out of {f} (data.val_holdout=4), not trained on"
    assert data.train_source == str(f)
    assert (cfg.data.path, cfg.data.val_holdout, cfg.data.val_builtin, cfg.data.val_path) == (str(f), 4, None, None)
    run = make_run_dir(cfg.model_copy(update={"run_dir": str(tmp_path / "run")}))
    saved = yaml.safe_load((run / "config.yaml").read_text())["data"]
    assert saved["path"] == str(f) and saved["val_holdout"] == 4 and saved["val_builtin"] is None
    # the same file gives the same slice in every run
    assert texts(load_data(train_cfg("--data", str(f))).val) == texts(data.val)


def test_val_data_flag_validates_on_that_file_and_trains_on_every_row(tmp_path):
    f, v = own_rows(tmp_path / "own.jsonl", 40), own_rows(tmp_path / "val.jsonl", 50, tag="val")
    cfg = train_cfg("--data", str(f), "--val-data", str(v), "data.val_max_samples=7")
    data = load_data(cfg)
    assert texts(data.train) == [f"own question {i}" for i in range(40)]
    assert texts(data.val) == [f"val question {i}" for i in range(7)]
    assert cfg.data.val_path == str(v) and cfg.data.val_holdout == 0
    assert data.val_source == f"7 rows of {v}"


def test_prompt_key_max_samples_and_holdout_size_apply_in_training(tmp_path):
    f = own_rows(tmp_path / "own.jsonl", 40, key="messages")
    cfg = train_cfg("--data", str(f), "data.prompt_key=messages", "data.max_samples=30", "data.val_holdout=3")
    data = load_data(cfg)
    assert texts(data.val) == ["own question 0", "own question 10", "own question 20"]
    assert len(data.train) == 27 and texts(data.train)[-1] == "own question 29"
    with pytest.raises(DataError, match="missing 'prompt'"):
        load_data(train_cfg("--data", str(f)))  # the file's column is not the default one
    # 0: validate nothing, train on every row; every row held out: an error naming the key
    none = load_data(train_cfg("--data", str(f), "data.prompt_key=messages", "data.val_holdout=0"))
    assert none.val == [] and len(none.train) == 40 and none.val_source.startswith("none")
    with pytest.raises(DataError, match=r"data.val_holdout=40 holds out every one of the 40 training rows"):
        load_data(train_cfg("--data", str(f), "data.prompt_key=messages", "data.val_holdout=40"))
    # validation off: nothing held out, unless a number says so (a resumed run's resolved slice: its training
    # rows, and so its data fingerprint, stay the same)
    off = load_data(train_cfg("--data", str(f), "data.prompt_key=messages", "train.val_every=0"))
    assert off.val == [] and len(off.train) == 40 and off.config.val_holdout == 0
    kept = load_data(train_cfg("--data", str(f), "data.prompt_key=messages", "train.val_every=0",
                               "data.val_holdout=4"))
    assert kept.val == [] and len(kept.train) == 36 and "own question 10" not in texts(kept.train)
    assert kept.val_source == f"none (train.val_every=0); 4 rows held out of {f} (data.val_holdout=4) are not trained on"


def test_a_built_in_training_set_without_a_validation_set_holds_out_its_own_rows():
    cfg = load_config(None, ["data.builtin=arithmetic"])  # no val_builtin: no built-in set nobody asked for
    data = load_data(cfg)
    assert len(data.val) == 6 and len(data.train) == 58 and cfg.data.val_holdout == 6
    assert not set(texts(data.val)) & set(texts(data.train))


def test_the_embedded_default_trains_and_validates_as_before():
    """`agentloop train` with no flags: all of calculator_train, validated on the first 32 calculator rows."""
    cfg = train_cfg()
    data = load_data(cfg)
    assert texts(data.train) == [r["prompt"][-1]["content"] for r in builtin_rows("calculator_train")]
    assert texts(data.val) == [r["prompt"][-1]["content"] for r in builtin_rows("calculator")[:32]]
    assert (cfg.data.builtin, cfg.data.val_builtin, cfg.data.val_holdout) == ("calculator_train", "calculator", 0)
    assert "32 rows of the built-in set calculator" == data.val_source


@pytest.mark.parametrize("old,new", [("train.data_path", "data.path"), ("train.builtin", "data.builtin"),
                                     ("train.val_path", "data.val_path"), ("train.val_builtin", "data.val_builtin"),
                                     ("train.val_max_samples", "data.val_max_samples"),
                                     ("train.sync", "learner.weight_sync"), ("learner.nproc", "learner.ranks"),
                                     ("learner.checkpoint_async", "learner.checkpoint_background")])
def test_the_moved_keys_fail_naming_their_new_key(old, new, tmp_path, capsys):
    with pytest.raises(ConfigError, match=rf"{old} is now {new}"):
        load_config(None, [f"{old}=3"])
    f = tmp_path / "old.yaml"
    f.write_text(yaml.safe_dump({old.split(".")[0]: {old.split(".")[1]: 3}}))
    with pytest.raises(ConfigError, match=rf"old.yaml\): moved keys:\n  {old} is now {new}"):
        load_config(f)
    assert main(["train", "--run-dir", str(tmp_path / "run"), f"{old}=3"]) == 2
    assert f"{old} is now {new}" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_no_shipped_config_doc_or_script_uses_a_moved_key():
    """configs, presets, benchmarks, the README and docs name no moved or renamed key (MOVED_KEYS: the data
    section's, train.sync, learner.nproc, learner.checkpoint_async); docs/training.md names the data section's old
    keys once, as errors."""
    files = [*ROOT.glob("configs/*.yaml"), *ROOT.glob("agentloop/presets/*.yaml"), *ROOT.glob("benchmarks/*.sh"),
             *ROOT.glob("benchmarks/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]
    as_errors = re.compile(r"The old keys `train\.data_path`.*? are errors naming their `data\.\*` key", re.S)
    assert len(as_errors.findall((ROOT / "docs" / "training.md").read_text())) == 1
    for path in files:
        text = as_errors.sub("", path.read_text())
        for old in MOVED_KEYS:
            assert re.search(rf"{re.escape(old)}\b", text) is None, f"{path} still names {old}"
        if path.suffix == ".yaml":
            tree = yaml.safe_load(text) or {}
            for old in MOVED_KEYS:
                section, key = old.split(".")
                assert key not in (tree.get(section) or {}), f"{path} sets {old}"
    for path in [*ROOT.glob("configs/*.yaml"), *ROOT.glob("agentloop/presets/*.yaml")]:
        dump_config(load_config(path))  # and each still loads
