"""Config tree (YAML + overrides, clear errors), records' invariants, seeds (the public API: test_public_api.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agentloop.config import (
    Config,
    SamplingParams,
    derive_seed,
    dump_config,
    load_config,
    validate_for_training,
)
from agentloop.errors import ConfigError
from agentloop.records import AgentLoopOutput, EpisodeRecord, TokenOutput, read_records

ROOT = Path(__file__).resolve().parents[2]


def test_every_config_field_has_a_docstring():
    def walk(model, prefix=""):
        for name, f in model.model_fields.items():
            assert f.description, f"{prefix}{name} has no docstring"
            ann = f.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann, prefix + name + ".")

    walk(Config)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    load_config(path)


def test_overrides_parse_yaml_values():
    cfg = load_config(None, ["rollout.n_samples=8", "sampling.temperature=0.5", "server.urls=[\"http://h:1/\"]",
                             "data.max_samples=null", "plugins=[a.py]"])
    assert cfg.rollout.n_samples == 8 and cfg.sampling.temperature == 0.5
    assert cfg.server.urls == ["http://h:1"] and cfg.plugins == ["a.py"]


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"rollout\.n_sample: unknown key"):
        load_config(None, ["rollout.n_sample=3"])


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match=r"sampling\.top_p"):
        load_config(None, ["sampling.top_p=2"])
    with pytest.raises(ConfigError, match="must start with http"):
        load_config(None, ["server.urls=[localhost:3000]"])
    with pytest.raises(ConfigError, match="not of the form"):
        load_config(None, ["rollout.seed"])


def test_cross_field_check():
    with pytest.raises(ConfigError, match="no servers"):
        load_config(None, ["server.num_local=0"])


def test_yaml_file_and_roundtrip(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  n_samples: 2\nsampling:\n  max_new_tokens: 9\n")
    cfg = load_config(p, ["rollout.seed=5"])
    assert (cfg.rollout.n_samples, cfg.sampling.max_new_tokens, cfg.rollout.seed) == (2, 9, 5)
    again = load_config(None, [])
    again = Config.model_validate(yaml.safe_load(dump_config(cfg)))
    assert again == cfg
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "bad.yaml")


def test_seeds_are_stable_and_distinct():
    assert derive_seed(0, 1, 2) == derive_seed(0, 1, 2)
    seeds = {derive_seed(0, i, r) for i in range(100) for r in range(8)}
    assert len(seeds) == 800
    assert derive_seed(1, 0, 0) != derive_seed(0, 0, 0)
    assert derive_seed(0, 3, 1) == 2144065776  # pinned: must not change across versions


def test_sampling_params_to_sglang():
    d = SamplingParams(temperature=0.7, max_new_tokens=5, seed=9, stop=["x"]).to_sglang(max_new_tokens=3)
    assert d["max_new_tokens"] == 3 and d["sampling_seed"] == 9 and d["stop"] == ["x"]
    assert d["skip_special_tokens"] is False


def test_output_invariants():
    AgentLoopOutput(prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 0], response_logprobs=[-0.1, 0.0])
    with pytest.raises(ValueError, match="same length"):
        AgentLoopOutput(prompt_ids=[1], response_ids=[2, 3], response_mask=[1], response_logprobs=[0.0, 0.0])
    with pytest.raises(ValueError, match="0 or 1"):
        AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[2], response_logprobs=[0.0])
    with pytest.raises(ValueError, match="mask-0 token"):
        AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[0], response_logprobs=[-1.0])
    with pytest.raises(ValueError, match="differ in length"):
        TokenOutput(token_ids=[1, 2], logprobs=[0.0], finish_reason="stop")


def test_records_roundtrip_and_bad_line(tmp_path):
    rec = EpisodeRecord(prompt_ids=[1], response_ids=[2], response_mask=[1], response_logprobs=[-0.3], reward=1.0,
                        episode_id="0-0", index=0, repeat=0, data_source="d", loop="l", seed=3)
    p = tmp_path / "r.jsonl"
    p.write_text(rec.model_dump_json() + "\n{broken\n")
    it = read_records(p)
    assert next(it) == rec
    with pytest.raises(ValueError, match=r"r\.jsonl:2"):
        next(it)


# ---------------------------------------------------------------- training-only rules


def test_training_takes_the_learner_temperature_from_sampling():
    cfg = validate_for_training(load_config(None, ["sampling.temperature=0.7"]))
    assert cfg.algo.temperature == 0.7
    assert validate_for_training(load_config(None, [])).algo.temperature == 1.0
    # the same value stated twice is fine; the resolved config reloads and validates again
    both = load_config(None, ["sampling.temperature=0.7", "algo.temperature=0.7"])
    assert validate_for_training(both).algo.temperature == 0.7
    again = load_config(None, [f"{k}={v}" for k, v in (("sampling.temperature", 0.7),
                                                       ("algo.temperature", cfg.algo.temperature))])
    validate_for_training(again)


def test_training_rejects_two_temperatures():
    with pytest.raises(ConfigError, match=r"algo\.temperature=0\.5 differs from sampling\.temperature=0\.7"):
        validate_for_training(load_config(None, ["sampling.temperature=0.7", "algo.temperature=0.5"]))
    # a resolved config.yaml hand-edited to disagree is refused too
    tree = yaml.safe_load(dump_config(validate_for_training(load_config(None, ["sampling.temperature=0.7"]))))
    tree["algo"]["temperature"] = 1.0
    with pytest.raises(ConfigError, match=r"algo\.temperature=1 differs"):
        validate_for_training(Config.model_validate(tree))


def test_training_rejects_greedy_and_truncated_sampling_naming_the_keys():
    with pytest.raises(ConfigError, match=r"sampling\.temperature=0 \(greedy\) cannot train"):
        validate_for_training(load_config(None, ["sampling.temperature=0"]))
    for over, key in (("sampling.top_p=0.9", r"sampling\.top_p=0\.9"), ("sampling.top_k=20", r"sampling\.top_k=20"),
                      ("sampling.min_p=0.05", r"sampling\.min_p=0\.05")):
        with pytest.raises(ConfigError, match=key + r" truncates sampling.*train\.accept_biased_ratios=true"):
            validate_for_training(load_config(None, [over]))
        validate_for_training(load_config(None, [over, "train.accept_biased_ratios=true"]))
    # every problem at once
    with pytest.raises(ConfigError) as e:
        validate_for_training(load_config(None, ["sampling.temperature=0", "sampling.top_p=0.5", "algo.temperature=2"]))
    assert all(k in str(e.value) for k in ("sampling.temperature=0", "algo.temperature=2", "sampling.top_p=0.5"))


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("train*.yaml")) + [ROOT / "agentloop/presets/train_tiny.yaml"],
                         ids=lambda p: p.name)
def test_shipped_training_configs_pass_the_training_rules(path):
    cfg = validate_for_training(load_config(path))
    assert cfg.algo.temperature == cfg.sampling.temperature


def test_eval_rollouts_may_sample_any_way():
    cfg = load_config(None, ["sampling.temperature=0", "sampling.top_p=0.5", "sampling.top_k=3", "sampling.min_p=0.1",
                             "algo.temperature=0.3"])
    assert (cfg.sampling.temperature, cfg.sampling.top_k) == (0, 3)


def test_agentloop_train_fails_at_once_on_a_bad_combination(capsys, tmp_path, monkeypatch):
    import agentloop.train.orchestrator.loop as orch
    from agentloop.cli import main

    def too_far(cfg):
        raise AssertionError("agentloop train went past its config check")

    monkeypatch.setattr(orch, "make_run_dir", too_far)
    rc = main(["train", "--server-url", "http://127.0.0.1:9", "--run-dir", str(tmp_path / "run"),
               "sampling.temperature=0.7", "algo.temperature=1.0", "sampling.top_k=5"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "algo.temperature=1 differs from sampling.temperature=0.7" in err and "sampling.top_k=5" in err
    assert not (tmp_path / "run").exists()  # nothing started


def test_configs_train_tiny_is_the_embedded_default():
    """configs/train_tiny.yaml is documented as a copy of the preset `agentloop train` runs without --config."""
    ours = load_config(ROOT / "configs/train_tiny.yaml").model_dump()
    preset = load_config(ROOT / "agentloop/presets/train_tiny.yaml").model_dump()
    assert ours == preset


def test_overrides_may_come_before_and_between_flags(capsys):
    """`agentloop rollout a.b=1 -n 2 c.d=3`: argparse alone refuses overrides on both sides of a flag."""
    from agentloop.cli import main

    rc = main(["config", "sampling.temperature=0.5", "-n", "3", "--seed", "7", "rollout.loop=tool_agent_loop",
               "--data", "rows.jsonl", "sampling.max_new_tokens=9"])
    out = yaml.safe_load(capsys.readouterr().out)
    assert rc == 0
    assert out["sampling"]["temperature"] == 0.5 and out["sampling"]["max_new_tokens"] == 9
    assert out["rollout"]["n_samples"] == 3 and out["rollout"]["seed"] == 7
    assert out["rollout"]["loop"] == "tool_agent_loop" and out["data"]["path"] == "rows.jsonl"
