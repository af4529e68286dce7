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
