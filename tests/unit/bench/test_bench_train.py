"""`agentloop bench train` (the FLOP model: tests/unit/train/test_flops.py): synthetic batch invariants, a 2-step learner bench on
CPU with the tiny model, and the step time split of a handwritten metrics.jsonl."""

from __future__ import annotations

import json
import math

import pytest

from agentloop.bench.train import (
    TrainBenchConfig,
    read_metrics,
    step_split,
    synthetic_records,
)
from agentloop.cli import main
from agentloop.train.flops import step_flops, step_flops_from_sums


def test_synthetic_batch_shape_and_masks():
    from agentloop.train.batch.episodes import prepare_episodes
    from agentloop.train.config import AlgoConfig
    from agentloop.train.trainer.collate import plan_micro_batches

    b = TrainBenchConfig(sequences=12, group_size=4, prompt_tokens=7, response_tokens=10, env_tokens=3, seed=1)
    recs = synthetic_records(b, vocab_size=50, step=2)
    assert len(recs) == 12
    for r in recs:
        assert len(r.prompt_ids) == 7
        assert len(r.response_ids) == len(r.response_mask) == len(r.response_logprobs) == 10
        assert r.num_model_tokens == 7 and r.response_mask[:3] == [1, 1, 1] and r.response_mask[3:6] == [0, 0, 0]
        assert all(0 <= t < 50 for t in r.prompt_ids + r.response_ids)
        assert all((lp == 0.0) == (m == 0) for lp, m in zip(r.response_logprobs, r.response_mask))
        assert all(lp == pytest.approx(-math.log(50)) for lp, m in zip(r.response_logprobs, r.response_mask) if m)
        assert 0.0 <= r.reward < 1.0 and r.error is None and r.step == 2
    groups = {}
    for r in recs:
        groups.setdefault(r.index, []).append(r)
    assert sorted(groups) == [0, 1, 2] and all(len(g) == 4 for g in groups.values())
    assert all(len({tuple(r.prompt_ids) for r in g}) == 1 for g in groups.values())  # a group shares its prompt
    assert synthetic_records(b, 50, step=2)[5].response_ids == recs[5].response_ids  # seeded
    assert synthetic_records(b, 50, step=3)[5].response_ids != recs[5].response_ids  # fresh batch per step

    # the learner's own batching takes them as they are: every episode kept, masks where they belong
    prepared = prepare_episodes(recs, AlgoConfig())
    assert len(prepared.episodes) == 12 and prepared.metrics["batch/model_tokens"] == 12 * 7
    assert any(e.advantage != 0 for e in prepared.episodes)
    mbs = plan_micro_batches(prepared.episodes, list(range(12)), "token-mean", budget=64)
    assert sum(len(mb.episode_ids) for mb in mbs) == 12
    for mb in mbs:
        assert mb.input_ids.shape[1] == 16  # 7 + 10 - 1, no padding
        assert mb.loss_mask.sum(1).tolist() == [7.0] * len(mb.episode_ids)
        assert mb.loss_mask[:, :6].sum() == 0  # prompt positions (the first response token is predicted at 6)

    assert all(r.token_versions == [] for r in recs)  # synchronous records by default
    lagged = synthetic_records(b.model_copy(update={"max_lag": 2}), 50, step=3)
    # token k lags k mod 3 versions behind the step's starting weights (2), never below version 0
    assert lagged[0].token_versions == [2, 1, 0, None, None, None, 2, 1, 0, 2]

    with pytest.raises(ValueError, match="multiple of group_size"):
        TrainBenchConfig(sequences=10, group_size=4)
    with pytest.raises(ValueError, match="env_tokens"):
        TrainBenchConfig(response_tokens=4, env_tokens=4)


@pytest.mark.parametrize("share", ["off", "on"])
def test_learner_bench_tiny_model_cpu(tmp_path, capsys, share):
    out = tmp_path / "report.json"
    rc = main(["bench", "train", "--model", "tiny", "--bench-sequences", "4", "--bench-group-size", "2",
               "--bench-prompt-tokens", "16", "--bench-response-tokens", "16", "--bench-env-tokens", "4",
               "--bench-warmup", "0", "--bench-steps", "2", "--peak-tflops", "0.5", "--out", str(out),
               f"runs_dir={tmp_path / 'runs'}", "learner.device=cpu", "learner.micro_batch_tokens=64",
               f"learner.share_prompt={share}"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "MFU" in printed
    report = json.loads(out.read_text())
    run_dir = next((tmp_path / "runs").glob("bench-train-*"))
    assert json.loads((run_dir / "bench_train.json").read_text()) == report
    assert "| tiny | cpu | 1 | float32 |" in (run_dir / "bench_train.md").read_text()
    r = report["learner"]
    assert r["device_type"] == "cpu" and r["ranks"] == 1 and len(r["step_s"]["all"]) == 2
    assert r["tokens_per_step"] == 4 * 31 and r["response_tokens_per_step"] == 4 * 12
    assert r["step_s"]["mean"] > 0 and r["tokens_per_s"] == pytest.approx(4 * 31 / r["step_s"]["mean"])
    assert r["response_tokens_per_s"] == pytest.approx(4 * 12 / r["step_s"]["mean"])
    # off: a row per episode, 2 x 31 tokens fit in 64. on: a row per group, the 15 prompt positions
    # once and then both 16-token responses (47 tokens), one such row per micro-batch.
    rows = [31] * 4 if share == "off" else [47] * 2
    assert r["episodes_per_step"] == 4 and r["micro_batches_per_step"] == 2
    assert r["computed_tokens_per_step"] == sum(rows) and r["shared_rows_per_step"] == (share == "on") * 2
    assert f"| {share} | {sum(rows)} of 124 |" in (run_dir / "bench_train.md").read_text()
    shape = r["model_shape"]
    # the attention term: each episode's own 31^2 pairs; a shared row needs the 15 prompt positions' pairs once
    pairs = 4 * 31**2 if share == "off" else 2 * (15**2 + 2 * (31**2 - 15**2))
    expect = step_flops_from_sums(shape["matmul_params"], shape["layers"], shape["hidden"], float(sum(rows)),
                                  float(pairs), forward_passes=0)
    if share == "off":
        assert expect == step_flops(shape["matmul_params"], shape["layers"], shape["hidden"], rows, forward_passes=0)
    assert r["flops_per_step"] == expect  # one epoch of one mini-batch: no separate old-logprob pass
    assert r["mfu"] == pytest.approx(expect["total"] / r["step_s"]["mean"] / 0.5e12)
    assert 0 < r["mfu"] < 1 and r["peak_memory_gib"]["rss"] > 0
    assert all(math.isfinite(x) for x in r["loss"] + r["grad_norm"])


def _row(step, rollout, reward, learner, sync, total, **extra):
    return {"step": float(step), "train/reward": 0.1, "time/rollout_s": rollout, "time/reward_s": reward,
            "time/learner_s": learner, "time/sync_s": sync, "time/step_s": total, **extra}


def test_split_table_from_metrics_jsonl(tmp_path, capsys):
    rows = [
        {"step": 0.0, "val/reward": 0.0},  # the validation-only row before step 1: not a step
        _row(1, 20.0, 1.0, 8.0, 2.0, 31.0, **{"learner/time/update_s": 5.0, "learner/perf/mfu": 0.3,
                                              "learner/perf/peak_memory_gib": 20.0}),
        _row(2, 9.0, 0.5, 8.0, 1.0, 18.5, **{"learner/time/update_s": 5.5, "learner/perf/mfu": 0.1,
                                             "learner/perf/peak_memory_gib": 22.0}),
        _row(3, 99.0, 9.0, 99.0, 9.0, 999.0),  # superseded by the resumed run's line below
        _row(3, 10.0, 0.5, 6.0, 1.0, 16.5, **{"learner/time/update_s": 4.5}),
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = read_metrics(tmp_path)
    assert [r["step"] for r in got] == [1.0, 2.0, 3.0] and got[2]["time/step_s"] == 16.5

    s = step_split(got)
    assert s["steps"] == [1, 2, 3] and s["step_s"] == pytest.approx(22.0)
    p = s["phases"]
    assert p["rollout"]["seconds"] == pytest.approx(13.0) and p["rollout"]["share"] == pytest.approx(13 / 22)
    assert p["learner"]["seconds"] == pytest.approx(22 / 3) and p["sync"]["seconds"] == pytest.approx(4 / 3)
    assert p["other"]["seconds"] == pytest.approx(22 - 13 - 22 / 3 - 4 / 3)
    assert p["reward (in rollout)"]["seconds"] == pytest.approx(2 / 3)
    assert p["learner: update"]["seconds"] == pytest.approx(5.0)
    assert s["learner_perf"] == {"mfu": pytest.approx(0.2), "peak_memory_gib": pytest.approx(21.0)}
    later = step_split(got, skip_first=1)
    assert later["steps"] == [2, 3] and later["phases"]["rollout"]["share"] == pytest.approx(9.5 / 17.5)

    assert main(["bench", "train", "--run-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "step time split" in printed and "rollout" in printed and "59.1%" in printed  # 13 / 22
    assert "learner train_step: MFU 20.0%, peak 21.0 GiB" in printed
    report = json.loads((tmp_path / "bench_train.json").read_text())
    assert report["mode"] == "split" and report["split"]["step_s"] == pytest.approx(22.0)
    assert report["split_after_first"]["steps"] == [2, 3]
    md = (tmp_path / "bench_train.md").read_text()
    assert "| rollout | 13.000 | 59.1% |" in md


def test_cli_errors(tmp_path, capsys):
    assert main(["bench", "train", "--run-dir", str(tmp_path)]) == 2  # no metrics.jsonl
    assert main(["bench", "train", "--run-dir", str(tmp_path), "--full"]) == 2
    assert main(["bench", "train", "--bench-sequences", "10", "--bench-group-size", "4",
                 f"runs_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl" in err and "give one of them" in err and "multiple of group_size" in err


def test_full_mode_runs_a_short_train_and_reports_its_split(tmp_path, monkeypatch, capsys):
    """--full: the train preset, `--full-steps` steps, then the split of that run (train itself faked)."""
    from agentloop.train.orchestrator import loop as orchestrator

    seen = {}

    def fake_run_train(cfg):
        seen.update(steps=cfg.train.steps, name=cfg.name, loop=cfg.rollout.loop, lr=cfg.learner.lr)
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        rows = [_row(s, 4.0, 0.5, 3.0, 1.0, 8.5) for s in (1, 2)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return run_dir, {}

    monkeypatch.setattr(orchestrator, "run_train", fake_run_train)
    assert main(["bench", "train", "--full", "--full-steps", "2", "learner.lr=0.5"]) == 0
    assert seen == {"steps": 2, "name": "bench-train-full", "loop": "tool_agent_loop", "lr": 0.5}
    report = json.loads((tmp_path / "run" / "bench_train.json").read_text())
    assert report["split"]["phases"]["rollout"]["share"] == pytest.approx(4 / 8.5)
    assert "split_after_first" not in report  # only with 3+ steps
    assert "step time split" in capsys.readouterr().out


def test_shape_model_is_built_once_with_the_tiny_tokenizer(tmp_path, monkeypatch):
    """ensure_shape_model on a small stand-in shape (the 0.5B one is the same code, ~1 GB to write)."""
    from transformers import AutoConfig

    from agentloop.models import modelzoo

    tiny = modelzoo.ensure_tiny_model()
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / tiny.name).symlink_to(tiny)  # the cached tiny model, found under tmp_path
    small = dict(modelzoo.MODEL_SHAPES["qwen2.5-0.5b-shape"], vocab_size=4096, hidden_size=64,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setitem(modelzoo.MODEL_SHAPES, "small-shape", small)
    d = modelzoo.ensure_shape_model("small-shape", tmp_path)
    assert d.parent == tmp_path / "models" and d.name.startswith("small-shape-")
    cfg, tiny_cfg = AutoConfig.from_pretrained(d), AutoConfig.from_pretrained(tiny)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.tie_word_embeddings) == (4096, 64, 2, True)
    assert (cfg.eos_token_id, cfg.pad_token_id) == (tiny_cfg.eos_token_id, tiny_cfg.pad_token_id)
    assert (d / "tokenizer.json").is_file() and (d / "model.safetensors").is_file()
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert modelzoo.ensure_shape_model("small-shape", tmp_path) == d
    assert (d / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not rebuilt
    with pytest.raises(ValueError, match="unknown model shape"):
        modelzoo.ensure_shape_model("no-such-shape", tmp_path)
