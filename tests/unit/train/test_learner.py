"""The learner on a throwaway tiny Qwen2 model (CPU, gloo): train steps, micro-batch equivalence,
save_hf, checkpoints, the mailbox protocol, kill + resume of a learner process, and 2 ranks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from agentloop.errors import ConfigError
from agentloop.records import EpisodeRecord
from agentloop.train.config import AlgoConfig, LearnerConfig
from agentloop.train.handle.mailbox import (
    LearnerDiedError,
    LearnerFailedError,
    LearnerMailbox,
    MailboxClient,
    MailboxError,
    MailboxPaths,
    MailboxTimeout,
)
from agentloop.train.orchestrator.learner_process import learner_command
from agentloop.train.trainer.checkpoint import latest_checkpoint, list_checkpoints, read_meta
from agentloop.train.trainer.learner import Learner, lr_at
from agentloop.train.trainer.main import load_sections
from agentloop.train.trainer.serve import FinalPlan, _prune_weights, plan_final_save
from tests.unit.api_check import assert_public_api

VOCAB = 96
ALGO = AlgoConfig()
"""The learners these tests start run the default algorithm: batches are prepared with it (agentloop.train.batch.prepare)."""
JIT_WARNING = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
"""torch 2.11's inductor import (GPU machines) warns from torch's own code; nothing of ours."""


def _save_tiny(tmp_path_factory, name: str, hidden: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    d = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    d = _save_tiny(tmp_path_factory, "tiny-model", 32)
    (d / "tokenizer_config.json").write_text("{}")  # stands in for tokenizer files: must be copied
    return d


@pytest.fixture(scope="module")
def tiny_model16(tmp_path_factory) -> Path:
    """The tiny model with a head dimension of 16, the least FlexAttention's kernels take (the other has 8)."""
    return _save_tiny(tmp_path_factory, "tiny-model16", 64)


def make_records(step: int, *, groups: int = 2, n: int = 4, seed: int = 0) -> list[EpisodeRecord]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    recs = []
    for idx in range(groups):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        for rep in range(n):
            r = int(torch.randint(3, 9, (1,), generator=g))
            resp = torch.randint(0, VOCAB, (r,), generator=g).tolist()
            mask = [1] * r
            if r > 4:  # a tool segment in the middle
                mask[2] = mask[3] = 0
            recs.append(EpisodeRecord(
                prompt_ids=prompt, response_ids=resp, response_mask=mask,
                response_logprobs=[-3.0 - 0.1 * k if m else 0.0 for k, m in enumerate(mask)],
                reward=float((rep + idx) % 2), episode_id=f"{idx}-{rep}", index=idx, repeat=rep,
                data_source="t", loop="single_turn", seed=rep, step=step))
    recs.append(recs[0].model_copy(update={"error": "RuntimeError: boom", "reward": 0.0, "repeat": 99}))
    return recs


def with_logprobs(records, lps):
    return [r.model_copy(update={"response_logprobs": [lp if m else 0.0 for lp, m in zip(lp_row, r.response_mask)]})
            for r, lp_row in zip(records, lps)]


def load_weights(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


def assert_weights_close(a: Path, b: Path, atol=1e-6):
    wa, wb = load_weights(a), load_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=atol, rtol=0, msg=k)


def one_step(model_dir: Path, algo: AlgoConfig, cfg: LearnerConfig, records, out: Path, *, logprobs: bool = False,
             step: int = 1):
    """A fresh Learner: (compute_logprobs(records) if asked, else None), train_step(records, step)'s
    metrics, and the HF weights it saved to `out`."""
    learner = Learner(model_dir, algo, cfg)
    try:
        lps = learner.compute_logprobs(records) if logprobs else None
        return lps, learner.train_step(records, step), learner.save_hf(out)
    finally:
        learner.close()


# ---- schedule / config --------------------------------------------------------------------

def test_lr_schedule():
    c = LearnerConfig(lr=1.0, warmup_steps=2, schedule="cosine", total_steps=6, min_lr_ratio=0.1)
    assert [lr_at(s, c) for s in (1, 2)] == [0.5, 1.0]
    assert lr_at(4, c) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(6, c) == pytest.approx(0.1)
    assert lr_at(9, c) == pytest.approx(0.1)
    assert lr_at(5, LearnerConfig(lr=2.0)) == 2.0
    # warmup longer than the run: clipped to it, so a one-step run trains at the full rate
    short = LearnerConfig(lr=1.0, warmup_steps=10, total_steps=1)
    assert lr_at(1, short) == 1.0
    assert [lr_at(s, LearnerConfig(lr=1.0, warmup_steps=10, total_steps=4)) for s in (1, 4)] == [0.25, 1.0]


def test_load_sections(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("model: {path: x}\nalgo: {kl_coef: 0.1}\nlearner: {lr: 0.5}\n")
    algo, cfg = load_sections(f, ["algo.loss_agg_mode=seq-mean-token-sum", "learner.grad_clip=null"])
    assert (algo.kl_coef, algo.loss_agg_mode, cfg.lr, cfg.grad_clip) == (0.1, "seq-mean-token-sum", 0.5, None)
    # YAML reads a bare off/on as a boolean
    assert load_sections(None, ["learner.share_prompt=off"])[1].share_prompt == "off"
    assert load_sections(None, ["learner.share_prompt=on"])[1].share_prompt == "on"
    assert load_sections(None, ["learner.checkpoint_background=off"])[1].checkpoint_background == "off"
    # learner.compile was a boolean before it had auto: true/false still mean on/off
    assert [load_sections(None, [f"learner.compile={v}"])[1].compile for v in ("true", "false", "auto")] == \
        ["on", "off", "auto"]
    with pytest.raises(ConfigError, match="share_prompt"):
        load_sections(None, ["learner.share_prompt=sometimes"])
    with pytest.raises(ConfigError, match="clip_ratio_lo"):
        load_sections(None, ["algo.clip_ratio_lo=0.1"])
    with pytest.raises(ConfigError, match="expected algo.KEY=VALUE"):
        load_sections(None, ["model.path=x"])
    # the learner's temperature is the rollouts' sampling temperature; a second, different one is refused
    f.write_text("sampling: {temperature: 0.7}\n")
    assert load_sections(f, [])[0].temperature == 0.7
    with pytest.raises(ConfigError, match=r"algo\.temperature=1 differs from sampling\.temperature=0\.7"):
        load_sections(f, ["algo.temperature=1.0"])


# ---- in-process learner -------------------------------------------------------------------

def _hf_logprobs(model_dir: Path, rec: EpisodeRecord) -> list[float]:
    """Independent reference: plain transformers forward on the unpadded sequence."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([rec.prompt_ids + rec.response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(m(input_ids=ids).logits.float(), -1)[0]
    p = len(rec.prompt_ids)
    pairs = enumerate(zip(rec.response_ids, rec.response_mask))
    return [float(logp[p + k - 1, t]) if mk else 0.0 for k, (t, mk) in pairs]


def test_train_step_changes_weights_lowers_loss_and_saves_hf(tiny_model, tmp_path):
    cfg = LearnerConfig(device="cpu", lr=2e-3, micro_batch_tokens=40)
    learner = Learner(tiny_model, AlgoConfig(old_logprobs="rollout"), cfg)
    try:
        recs = make_records(1)
        # padded, micro-batched logprobs equal a plain unpadded HF forward
        lps = learner.compute_logprobs(recs)
        assert lps[3] == pytest.approx(_hf_logprobs(tiny_model, recs[3]), abs=1e-5)
        recs = with_logprobs(recs, lps)  # on-policy rollout logprobs: the first ratio is exactly 1
        m1 = learner.train_step(recs, 1)
        assert m1["batch/failed"] == 1.0 and m1["batch/episodes"] == 8.0
        assert m1["mismatch/logprob_abs_diff_max"] < 1e-5
        assert m1["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        assert m1["actor/micro_batches"] >= 2
        assert m1["actor/grad_norm"] > 0 and m1["actor/optimizer_steps"] == 1.0
        m2 = learner.train_step(recs, 2)
        m3 = learner.train_step(recs, 3)
        # the surrogate against fixed rollout logprobs goes down on a repeated batch
        assert m3["actor/loss"] < m2["actor/loss"] < m1["actor/loss"]
        out = learner.save_hf(tmp_path / "w")
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json",
                                                         "model.safetensors", "tokenizer_config.json"]
        assert "lm_head.weight" not in load_weights(out)  # tied: saved once, as HF does
        before, after = load_weights(tiny_model), load_weights(out)
        assert any(not torch.equal(before[k], after[k]) for k in before)
        assert learner.compute_logprobs(recs[:1])[0] == pytest.approx(_hf_logprobs(out, recs[0]), abs=1e-5)
        assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    finally:
        learner.close()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batching_matches_full_batch_update(tiny_model, tmp_path, mode):
    """Same step with one big micro-batch vs many small ones: same loss, grad norm and weights.

    adam_eps = 1 makes Adam's first update ~ lr * g / (|g| + 1), about linear in the gradient, so
    equal weights mean equal gradients (with eps = 1e-8 the update is ~ lr * sign(g), which would
    hide a wrong scale and amplifies rounding on near-zero gradients).
    """
    algo = AlgoConfig(loss_agg_mode=mode, kl_coef=0.05, entropy_coef=0.01)
    recs = make_records(1, seed=3)
    (_, big, w_big), (_, small, w_small) = [
        one_step(tiny_model, algo, LearnerConfig(device="cpu", lr=1.0, adam_eps=1.0, grad_clip=None,
                                                 micro_batch_tokens=budget), recs, tmp_path / f"w-{budget}")
        for budget in (10_000, 12)]
    assert big["actor/micro_batches"] == 1 and small["actor/micro_batches"] > 4
    for k in ("actor/loss", "actor/grad_norm", "actor/kl_ref", "actor/entropy"):
        assert small[k] == pytest.approx(big[k], rel=1e-5, abs=1e-7), k
    assert_weights_close(w_big, w_small, atol=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_shared_prompt_rows_give_the_same_logprobs_and_update(tiny_model, tmp_path, mode):
    """learner.share_prompt=on (a GRPO group's prompt once per row, a 4-D mask) vs off (a row per
    episode): same logprobs, loss, KL, entropy and weights, with fewer tokens computed. Two mini-batches,
    so the old-logprob pass and the reference pass run on shared rows too."""
    algo = AlgoConfig(loss_agg_mode=mode, kl_coef=0.05, entropy_coef=0.01)
    recs = make_records(1, seed=7, groups=3, n=4)
    (lp_off, off, w_off), (lp_on, on, w_on) = [
        one_step(tiny_model, algo, LearnerConfig(device="cpu", lr=1.0, adam_eps=1.0, grad_clip=None,
                                                 micro_batch_tokens=40, mini_batches=2, share_prompt=share),
                 recs, tmp_path / f"w-{share}", logprobs=True)
        for share in ("off", "on")]
    for a, b in zip(lp_off, lp_on):
        assert b == pytest.approx(a, abs=1e-5)
    assert on["batch/shared_rows"] > 0 and off["batch/shared_rows"] == 0
    assert on["batch/computed_tokens"] < off["batch/computed_tokens"]
    assert off["batch/prompt_share_saving"] == 0 < on["batch/prompt_share_saving"]
    for k in ("actor/loss", "actor/grad_norm", "actor/kl_ref", "actor/entropy", "actor/clip_frac"):
        assert on[k] == pytest.approx(off[k], rel=1e-4, abs=1e-6), k
    assert_weights_close(w_off, w_on, atol=1e-5)


def test_on_policy_step_skips_the_old_logprob_pass_with_the_same_update(tiny_model, tmp_path, monkeypatch):
    """One epoch of one mini-batch: the loss pass's own logprobs stand in for the recomputed ones.

    Also the regression test of an FSDP2 bug: root parameters gathered by the no-grad recompute pass
    served the loss pass, and the forced path's gradient norm was 14-57% off (now resharded).
    """
    import agentloop.train.trainer.learner as learner_mod

    algo = AlgoConfig(old_logprobs="recompute")
    recs = make_records(1, seed=5)
    cfg = LearnerConfig(device="cpu", lr=1.0, adam_eps=1.0, grad_clip=None)
    assert not learner_mod.old_logprob_pass(algo, cfg)
    assert learner_mod.old_logprob_pass(algo, cfg.model_copy(update={"mini_batches": 2}))
    _, fast, w_fast = one_step(tiny_model, algo, cfg, recs, tmp_path / "w-fast")
    # the general path: a separate no-grad forward for the old logprobs
    monkeypatch.setattr(learner_mod, "old_logprob_pass", lambda a, c: True)
    _, full, w_full = one_step(tiny_model, algo, cfg, recs, tmp_path / "w-full")
    for k in ("actor/loss", "actor/grad_norm", "actor/clip_frac"):
        if k in full:
            assert fast[k] == pytest.approx(full[k], rel=1e-5, abs=1e-7), k
    assert_weights_close(w_fast, w_full, atol=1e-6)


def test_progress_line_and_curves_name_metrics_the_learner_emits(tiny_model, tmp_path):
    from agentloop.report.progress import fmt_fields
    from agentloop.report.steplog import ENTROPY_KEY, KL_KEY, StepLog
    from agentloop.train.orchestrator.loop import _PROGRESS_LABELS

    def _fmt(row, keys):
        return " | ".join(fmt_fields(row, _PROGRESS_LABELS, keys))

    learner = Learner(tiny_model, AlgoConfig(kl_coef=0.1), LearnerConfig(device="cpu", lr=1e-3))
    try:
        m = learner.train_step(make_records(1, seed=2), 1)
    finally:
        learner.close()
    row = {"step": 1.0, "train/reward": 0.5, **{f"learner/{k}": v for k, v in m.items()}}
    assert KL_KEY in row and ENTROPY_KEY in row
    assert "kl " in _fmt(row, [KL_KEY]) and "entropy " in _fmt(row, [ENTROPY_KEY])
    log = StepLog.__new__(StepLog)  # only the chart code: no TensorBoard, no files but the page
    log.rows, log.run_dir = [row, {**row, "step": 2.0}], tmp_path
    page = log.curves().read_text()
    assert "KL to the reference / entropy" in page and "<polyline" in page.split("KL to the reference")[1]


def test_checkpoint_roundtrip_is_exact(tiny_model, tmp_path):
    cfg = LearnerConfig(device="cpu", lr=1e-2, keep_checkpoints=2, mini_batches=2, ppo_epochs=2)
    learner = Learner(tiny_model, AlgoConfig(), cfg)
    try:
        learner.train_step(make_records(1), 1)
        ck = learner.save_checkpoint(tmp_path / "ck", data_position={"row": 7})
        m2 = learner.train_step(make_records(2), 2)
        assert "actor/loss_epoch1" in m2 and m2["actor/optimizer_steps"] == 4.0
        w2 = learner.save_hf(tmp_path / "w2a")
        meta = learner.load_checkpoint(ck)
        assert (meta.step, meta.data_position, learner.step) == (1, {"row": 7}, 1)
        learner.train_step(make_records(2), 2)  # needs the restored Adam moments to match
        assert_weights_close(w2, learner.save_hf(tmp_path / "w2b"), atol=0)
        for s in (2, 3):
            learner.step = s
            learner.save_checkpoint(tmp_path / "ck")
        assert [p.name for p in list_checkpoints(tmp_path / "ck")] == ["step-000002", "step-000003"]
    finally:
        learner.close()


def test_latest_checkpoint_ignores_incomplete(tmp_path):
    root = tmp_path / "ck"
    assert latest_checkpoint(root) is None
    (root / "step-000002").mkdir(parents=True)
    (root / "step-000002" / "meta.json").write_text(json.dumps({"step": 2}))
    (root / "step-000004.tmp").mkdir()  # killed mid-save
    (root / "step-000004.tmp" / "meta.json").write_text(json.dumps({"step": 4}))
    (root / "step-000003").mkdir()  # no meta.json: not complete
    assert latest_checkpoint(root).name == "step-000002"


# ---- mailbox protocol (no model) ----------------------------------------------------------

def _heartbeat(run_dir: Path) -> float:
    return json.loads((run_dir / "mailbox" / "learner.json").read_text())["heartbeat"]


def test_mailbox_protocol_and_errors(tmp_path):
    client = MailboxClient(tmp_path, heartbeat_timeout_s=30, poll_s=0.02)
    box = LearnerMailbox(tmp_path, heartbeat_s=0.02)
    recs = make_records(1)
    client.submit_records(1, recs, ALGO, data_position=5)
    client.submit_records(1, recs[:1], ALGO)  # already ready: no-op
    assert box.batch_ready(1) and not box.batch_ready(2)
    got, meta = box.read_batch(1)
    # the learner gets the episodes that enter the loss (the errored record is not one), not records
    assert got.num_episodes == len(recs) - 1 and meta["data_position"] == 5
    assert got.tokens(0) == recs[0].prompt_ids + recs[0].response_ids
    with pytest.raises(MailboxTimeout):
        client.wait_ready(0.1)
    box.start_heartbeat()
    box.update_info(status="ready", next_step=1)
    assert client.wait_ready(1.0)["next_step"] == 1
    box.write_done(1, tmp_path / "weights" / "step-000001", {"actor/loss": 0.5})
    res = client.wait_update(1, 1.0)
    assert res.metrics == {"actor/loss": 0.5} and Path(res.weights_dir).name == "step-000001"
    try:
        raise ValueError("bad batch")
    except ValueError as e:
        box.write_failed(2, e)
    with pytest.raises(LearnerFailedError, match="ValueError: bad batch") as ei:
        client.wait_update(2, 1.0)
    assert "Traceback" in ei.value.traceback
    with pytest.raises(MailboxTimeout):
        client.wait_update(3, 0.1)
    # the heartbeat thread beats on its own ...
    first = _heartbeat(tmp_path)
    deadline = time.monotonic() + 30
    while _heartbeat(tmp_path) == first:
        assert time.monotonic() < deadline, "the heartbeat thread never rewrote learner.json"
    client.check_alive()
    # ... and once it has stopped, a heartbeat older than heartbeat_timeout_s means a dead learner (the file is
    # back-dated instead of waiting out the timeout)
    box._stop.set()
    box._thread.join()
    info = json.loads(box.paths.learner_info.read_text())
    box.paths.learner_info.write_text(json.dumps({**info, "heartbeat": time.time() - 60}))
    with pytest.raises(LearnerDiedError, match="heartbeat is 60s old"):
        client.wait_update(3, 5.0)
    box.close()
    client.stop()
    assert box.stop_requested()
    os.utime(box.paths.stop, (time.time() - 60, time.time() - 60))
    assert not LearnerMailbox(tmp_path, started=time.time() - 30).stop_requested()  # stale STOP removed
    # a process handle takes precedence over the heartbeat
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(LearnerDiedError, match="code 3"):
        MailboxClient(tmp_path, process=proc).wait_update(3, 5.0)
    # a torn batch is detected
    (tmp_path / "mailbox" / "step-000001" / "batch.safetensors").write_bytes(b"torn")
    with pytest.raises(MailboxError, match="batch.ready says"):
        box.read_batch(1)


# ---- learner processes --------------------------------------------------------------------

def _env():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _launch(run_dir: Path, model: Path, overrides: list[str], *, nproc: int = 1, log: str = "learner.log"):
    cmd = learner_command(run_dir, model, nproc=nproc, overrides=overrides)
    fh = open(run_dir / log, "ab")
    try:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env())
    finally:
        fh.close()


def _finish(proc, client, run_dir, log="learner.log"):
    client.stop()
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    assert rc == 0, (run_dir / log).read_text()[-3000:]


def _reference_run(model: Path, algo: AlgoConfig, cfg: LearnerConfig, batches, out: Path, save_at):
    learner = Learner(model, algo, cfg)
    try:
        saved = {}
        for step, recs in enumerate(batches, 1):
            learner.train_step(recs, step)
            if step in save_at:
                saved[step] = learner.save_hf(out / f"ref-{step}")
        return saved
    finally:
        learner.close()


def test_learner_killed_and_resumed_continues_from_checkpoint(tiny_model, tmp_path):
    """SIGKILL after step 3 (checkpoint at 2), restart: steps 3 and 4 are trained once more from the
    checkpoint, and every saved step equals an uninterrupted run. adam_eps = 1 keeps gradients that
    are zero up to rounding (e.g. k_proj biases) from turning thread-count noise into lr-sized steps."""
    run = tmp_path / "run"
    run.mkdir()
    overrides = ["learner.device=cpu", "learner.checkpoint_every=2", "learner.lr=0.1", "learner.adam_eps=1.0",
                 "learner.poll_s=0.05", "learner.keep_weights=null", "learner.micro_batch_tokens=48", "learner.seed=5"]
    batches = [make_records(s, seed=11) for s in range(1, 5)]
    t0 = time.time()
    proc = _launch(run, tiny_model, overrides)
    try:
        client = MailboxClient(run, process=proc, poll_s=0.05)
        assert client.wait_ready(120)["next_step"] == 1
        for s in (1, 2, 3):
            client.submit_records(s, batches[s - 1], ALGO, data_position={"row": 10 * s})
            client.wait_update(s, 120)
    finally:
        proc.kill()  # SIGKILL after step 3: its update is not in any checkpoint
        proc.wait()
    assert latest_checkpoint(run / "checkpoints").name == "step-000002"

    t1 = time.time()
    proc = _launch(run, tiny_model, overrides)
    try:
        client = MailboxClient(run, process=proc, poll_s=0.05)
        info = client.wait_ready(120, since=t1)
        assert (info["next_step"], info["resumed_step"], info["data_position"]) == (3, 2, {"row": 20})
        assert not (run / "weights" / "step-000003").exists()
        assert not (run / "mailbox" / "step-000003" / "update.done").exists()
        client.submit_records(3, batches[2], ALGO)  # already in the mailbox: reused
        client.submit_records(4, batches[3], ALGO, data_position={"row": 40})
        assert client.wait_update(4, 120).weights_dir == str(run / "weights" / "step-000004")
        # a step that raises: update.failed with the traceback, then the learner exits 1
        bad = [r.model_copy(update={"prompt_ids": [VOCAB + 1000]}) for r in batches[0]]
        client.submit_records(5, bad, ALGO)
        with pytest.raises(LearnerFailedError, match="IndexError") as ei:
            client.wait_update(5, 120)
        assert "train_batch" in ei.value.traceback
        assert proc.wait(timeout=60) == 1
        assert client.learner_info()["status"] == "failed"
        log = (run / "learner.log").read_text()
        assert "learner[0] INFO step 4 done: loss " in log and "learner[0] ERROR failed: IndexError" in log
        assert "exiting with code 1" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert latest_checkpoint(run / "checkpoints").name == "step-000004"
    # an uninterrupted in-process run over the same batches gives the same weights at every step
    algo, cfg = load_sections(None, overrides)
    ref = _reference_run(tiny_model, algo, cfg, batches, tmp_path, save_at={2, 3, 4})
    for s in (2, 3, 4):
        assert_weights_close(ref[s], run / "weights" / f"step-{s:06d}", atol=1e-6)
    print(f"kill+resume: first learner {t1 - t0:.1f}s, total {time.time() - t0:.1f}s")


def test_a_push_path_learner_resumed_with_pending_batches_replays_them_without_a_push(tiny_model, tmp_path,
                                                                                      monkeypatch):
    """learner.weight_sync tensor|nccl (the GPU defaults), resumed from checkpoint 1 with the batches of steps 2 and
    3 submitted before the stop: it trains them again without asking for paused servers (the orchestrator waits in
    wait_caught_up, with no step loop to answer) and writes weights/step-3, which the orchestrator loads into the
    servers; step 4 is pushed as usual; the weights equal an uninterrupted run's. A CPU learner stands in for the
    GPU one: the push itself is recorded, not sent."""
    import threading

    import agentloop.train.weights.sync as ws
    from agentloop.train.handle.protocol import PushOrder
    from agentloop.train.handle.protocol import SyncRequest as _SyncRequest
    from agentloop.train.trainer.serve import serve

    pushes: list[str] = []

    class RecordingPush(ws.WeightSync):
        name = "tensor"

        def check(self, learner):  # a CPU learner stands in for the GPU one
            pass

        def push(self, model, *, dtype, device, rank, urls, version, flush_cache=False):
            pushes.append(version)
            return {}

    monkeypatch.setattr(ws, "sync_from_config", lambda cfg: RecordingPush(timeout_s=cfg.weight_sync_timeout_s))
    run = tmp_path / "run"
    overrides = ["learner.weight_sync=tensor", "learner.checkpoint_every=1", "learner.checkpoint_background=off",
                 "learner.lr=0.1", "learner.adam_eps=1.0", "learner.poll_s=0.02", "learner.keep_weights=null",
                 "learner.micro_batch_tokens=48", "learner.seed=5", "learner.weight_sync_timeout_s=5"]
    algo, cfg = load_sections(None, overrides)
    batches = [make_records(s, seed=13) for s in range(1, 5)]
    client = MailboxClient(run, poll_s=0.02)

    def start() -> threading.Thread:
        th = threading.Thread(target=serve, args=(run, tiny_model, algo, cfg), daemon=True)
        th.start()
        return th

    def push(step: int) -> None:  # the orchestrator's part: pause the servers, then let the learner push
        req = client.wait_update_or_sync(step, 60)
        assert isinstance(req, _SyncRequest), req
        client.allow_sync(PushOrder(step=step, urls=("http://server:1",), interrupt="abort"))
        assert client.wait_update(step, 60).pushed

    th = start()
    client.wait_ready(120)
    client.submit_records(1, batches[0], algo, data_position={"row": 10})
    push(1)
    client.stop()
    th.join(60)
    assert not th.is_alive() and pushes == ["1"]
    # submitted before the stop, never trained: the run was killed here
    client.submit_records(2, batches[1], algo, data_position={"row": 20})
    client.submit_records(3, batches[2], algo, data_position={"row": 30})
    client.paths.stop.unlink()

    t1 = time.time()
    th = start()
    info = client.wait_ready(120, since=t1)
    assert (info["next_step"], info["resumed_step"]) == (2, 1)
    info = client.wait_caught_up(60)
    assert (info["next_step"], info["data_position"]) == (4, {"row": 30})
    assert pushes == ["1"]  # nothing pushed, nothing asked for
    assert not client.paths.sync_request(2).exists() and not client.paths.sync_request(3).exists()
    assert (run / "weights" / "step-000003").is_dir() and not (run / "weights" / "step-000002").exists()
    client.submit_records(4, batches[3], algo, data_position={"row": 40})
    push(4)
    assert pushes == ["1", "4"]
    client.stop(final=True)
    final = client.wait_final(120)
    th.join(60)
    assert final["step"] == 4 and (run / "weights" / "step-000004").is_dir()
    ref = _reference_run(tiny_model, algo, cfg.model_copy(update={"weight_sync": "disk"}), batches, tmp_path,
                         save_at={3, 4})
    for s in (3, 4):
        assert_weights_close(ref[s], run / "weights" / f"step-{s:06d}", atol=1e-6)


def _two_ranks_vs_one(tiny_model, tmp_path, device_overrides, *, atol, algo_overrides=("algo.kl_coef=0.05",)):
    run = tmp_path / "run"
    run.mkdir()
    overrides = device_overrides + [
        "learner.lr=0.1", "learner.adam_eps=1.0", "learner.poll_s=0.05", "learner.micro_batch_tokens=30",
        "learner.mini_batches=2", "learner.grad_clip=0.5", *algo_overrides]
    batch = make_records(1, seed=21, groups=3)
    proc = _launch(run, tiny_model, overrides, nproc=2)
    try:
        client = MailboxClient(run, process=proc, poll_s=0.05)
        info = client.wait_ready(180)
        assert info["world_size"] == 2
        client.submit_records(1, batch, load_sections(None, overrides)[0])
        res = client.wait_update(1, 120)
        # through torchrun too, rank 0's step line is in learner.log as soon as the step is done; rank 1 is quiet
        log = (run / "learner.log").read_text()
        assert "learner[0] INFO step 1 done: loss " in log and "learner[1] INFO" not in log
        _finish(proc, client, run)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    algo, cfg = load_sections(None, overrides)
    _, m, ref = one_step(tiny_model, algo, cfg, batch, tmp_path / "ref")
    for k in ("actor/loss", "actor/grad_norm", "actor/kl_ref", "batch/episodes", "mismatch/rs_masked_frac"):
        if k in m:
            assert res.metrics[k] == pytest.approx(m[k], rel=1e-4, abs=1e-6), k
    assert_weights_close(ref, Path(res.weights_dir), atol=atol)
    assert math.isfinite(res.metrics["actor/entropy"])
    return res.metrics


def test_a_learner_over_two_nodes_with_torchruns_rendezvous_matches_one_rank(tiny_model, tmp_path):
    """Without Ray: learner.nnodes=2 on one host standing in for two. The run's LearnerProcess starts the first
    node (torchrun, c10d rendezvous), `agentloop learner-node --run-dir` the second, from the run dir alone (the
    shared filesystem); the two ranks train the step as one rank does."""
    from agentloop.config import dump_config, load_config
    from agentloop.inference.launcher import pick_free_port
    from agentloop.train.orchestrator.learner_process import LearnerProcess

    run = tmp_path / "run"
    run.mkdir()
    overrides = ["learner.device=cpu", "learner.nnodes=2", f"learner.rdzv_endpoint=127.0.0.1:{pick_free_port()}",
                 "learner.lr=0.1", "learner.adam_eps=1.0", "learner.poll_s=0.05", "learner.micro_batch_tokens=30",
                 "learner.mini_batches=2", "learner.checkpoint_every=null"]
    cfg = load_config(None, overrides)
    (run / "config.yaml").write_text(dump_config(cfg))
    batch = make_records(1, seed=21, groups=3)
    lp = LearnerProcess(cfg, run, tiny_model)
    proc = lp.start()
    with (run / "node2.log").open("wb") as log:
        node2 = subprocess.Popen([sys.executable, "-m", "agentloop.cli", "learner-node", "--run-dir", str(run)],
                                 stdout=log, stderr=subprocess.STDOUT, env=_env())
    try:
        client = MailboxClient(run, process=proc, poll_s=0.05)
        assert client.wait_ready(180)["world_size"] == 2
        client.submit_records(1, batch, cfg.algo)
        res = client.wait_update(1, 120)
        client.stop()
        assert lp.stop(grace_s=60) == 0 and node2.wait(60) == 0, (run / "node2.log").read_text()[-2000:]
    finally:
        for p in (proc, node2):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert "--nnodes=2" in (run / "node2.log").read_text()
    _, m, ref = one_step(tiny_model, cfg.algo, cfg.learner, batch, tmp_path / "ref")
    for k in ("actor/loss", "actor/grad_norm", "batch/episodes"):
        assert res.metrics[k] == pytest.approx(m[k], rel=1e-4, abs=1e-6), k
    assert_weights_close(ref, Path(res.weights_dir), atol=1e-5)


def test_a_learner_over_two_nodes_whose_other_node_never_joins_names_the_command(tmp_path):
    """learner.nnodes=2 and no `agentloop learner-node` started: the first node's ranks wait in the rendezvous, and
    the ready timeout says so, with the command to run on the other host (not only "learner not ready")."""
    import asyncio

    from agentloop.config import dump_config, load_config
    from agentloop.inference.launcher import pick_free_port
    from agentloop.train.handle.protocol import LearnerTimeout
    from agentloop.train.orchestrator.learner_process import FileLearner, LearnerProcess

    run = tmp_path / "run"
    run.mkdir()
    endpoint = f"127.0.0.1:{pick_free_port()}"
    cfg = load_config(None, ["learner.device=cpu", "learner.nnodes=2", f"learner.rdzv_endpoint={endpoint}"])
    (run / "config.yaml").write_text(dump_config(cfg))
    lp = LearnerProcess(cfg, run, tmp_path / "model")
    learner = FileLearner(run, process=lp, poll_s=0.05)
    try:
        asyncio.run(learner.start())
        with pytest.raises(LearnerTimeout) as e:
            asyncio.run(learner.wait_ready(3))
    finally:
        lp.stop(grace_s=0)
    assert f"rendezvous at {endpoint}" in str(e.value)
    assert f"run `agentloop learner-node --run-dir {run}` on each of the other 1" in str(e.value)


def test_learner_log_holds_each_step_as_it_happens(tiny_model, tmp_path):
    """The learner as `agentloop train` starts it (LearnerProcess, stdout to learner.log): the step's line
    is in learner.log by the time its update.done is visible, while the learner is still running; the
    stop is logged too."""
    from agentloop.config import dump_config, load_config
    from agentloop.train.orchestrator.learner_process import LearnerProcess

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(None, ["learner.device=cpu", "learner.poll_s=0.05", "learner.lr=0.01"])
    (run / "config.yaml").write_text(dump_config(cfg))
    lp = LearnerProcess(cfg, run, tiny_model)
    proc = lp.start()
    try:
        client = MailboxClient(run, process=proc, poll_s=0.05)
        client.wait_ready(120)
        client.submit_records(1, make_records(1), ALGO)
        client.wait_update(1, 120)
        log = lp.log_path.read_text()
        assert proc.poll() is None  # still running: nothing was flushed by an exit
        assert "agentloop train: starting the learner: " in log.splitlines()[0]
        assert "learner[0] INFO ready for step 1 (fresh start)" in log
        step = [ln for ln in log.splitlines() if "learner[0] INFO step 1 done: loss " in ln]
        assert len(step) == 1 and "grad_norm " in step[0] and f"weights in {run / 'weights' / 'step-000001'}" in step[0]
        client.stop()
        assert lp.stop(grace_s=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = lp.log_path.read_text()
    assert "STOP received before step 2: exiting" in log and "exiting with code 0" in log


def test_learner_log_lines_are_flushed_line_by_line(tmp_path):
    """With stdout a block-buffered file and no PYTHONUNBUFFERED, a logged line is in the file even if the
    process dies right after it (os._exit skips every flush, like SIGKILL)."""
    out = tmp_path / "learner.log"
    code = ("from agentloop.train.trainer.main import log_to_stdout, logger\n"
            "log_to_stdout(0)\nlogger.info('step 7 done: loss 0.5')\nlogger.debug('hidden')\n"
            "print('a print is buffered')\nimport os\nos._exit(3)\n")
    env = {k: v for k, v in _env().items() if k != "PYTHONUNBUFFERED"}
    with open(out, "wb") as fh:
        assert subprocess.run([sys.executable, "-c", code], stdout=fh, stderr=subprocess.STDOUT, env=env,
                              timeout=60).returncode == 3
    lines = out.read_text().splitlines()
    assert len(lines) == 1 and lines[0].endswith("learner[0] INFO step 7 done: loss 0.5"), lines


def test_two_ranks_torchrun_matches_one_rank(tiny_model, tmp_path):
    """torchrun, 2 CPU ranks (gloo): sharded data, padded micro-batch counts, FSDP gradient
    averaging undone by the world-size factor; the result equals one rank on the whole batch."""
    _two_ranks_vs_one(tiny_model, tmp_path, ["learner.device=cpu"], atol=1e-5)


def test_two_ranks_match_one_rank_with_verls_rejection_and_reinforce_pp(tiny_model, tmp_path):
    """verl's order across ranks: the rejection's kept-token counts (denominators of each mini-batch) and
    REINFORCE++'s token whitening are sums over both ranks' episodes (one all-reduce each)."""
    m = _two_ranks_vs_one(tiny_model, tmp_path, ["learner.device=cpu"], atol=1e-5, algo_overrides=(
        "algo.kl_coef=0.05", "algo.estimator=reinforce_pp", "algo.rollout_rs=token_k1",
        "algo.rollout_rs_threshold=0.1_5.0"))
    assert 0 < m["mismatch/rs_masked_frac"] < 1


@pytest.mark.gpu
@JIT_WARNING
def test_gpu_two_ranks_nccl_matches_one_rank(tiny_model, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    _two_ranks_vs_one(tiny_model, tmp_path, ["learner.dtype=float32"], atol=1e-5)


@pytest.mark.gpu
@JIT_WARNING
@pytest.mark.parametrize("compile_", ["off", "on"])
def test_gpu_bf16_step(tiny_model, tmp_path, compile_):
    """On CUDA: nccl, bf16 compute with float32 master weights, bf16 HF export. Eager, the step's own logprobs equal
    `compute_logprobs`' (the same bf16 forward both times); compiled (learner.compile auto = on for a CUDA learner),
    inductor lowers the no-grad and the training graph apart, so they agree within bf16 rounding (1.1e-3 seen on an
    H200)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    algo = AlgoConfig(kl_coef=0.01, entropy_coef=0.001)
    learner = Learner(tiny_model, algo, LearnerConfig(lr=1e-3, micro_batch_tokens=40, compile=compile_))
    try:
        assert learner.device.type == "cuda" and learner.compute_dtype == torch.bfloat16
        recs = make_records(1)
        recs = with_logprobs(recs, learner.compute_logprobs(recs))
        m1 = learner.train_step(recs, 1)
        assert m1["mismatch/logprob_abs_diff_max"] < (1e-6 if compile_ == "off" else 2e-2)
        m2 = learner.train_step(recs, 2)
        assert all(math.isfinite(v) for v in m2.values())
        assert m2["actor/loss"] < m1["actor/loss"]
        out = learner.save_hf(tmp_path / "w")
        w = load_weights(out)
        assert {t.dtype for t in w.values()} == {torch.bfloat16}
        assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
        before = load_weights(tiny_model)
        assert any(not torch.equal(before[k].to(torch.bfloat16), w[k]) for k in w)
    finally:
        learner.close()


def test_public_api_and_light_config_import():
    import importlib

    import agentloop.train as train

    assert_public_api(train, names=train._EXPORTS)  # resolved lazily, from the module _EXPORTS names
    for name, mod in train._EXPORTS.items():
        assert getattr(train, name) is getattr(importlib.import_module(f"agentloop.train.{mod}"), name), name
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        train.Nope  # noqa: B018
    # the root config mounts AlgoConfig/LearnerConfig: importing them must not import torch
    code = "import sys, agentloop.train.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), timeout=60)


# ---- packed layout, meta init, chunked head ------------------------------------------------

@pytest.mark.parametrize("packed", ["packed_sdpa", "varlen"])
@pytest.mark.parametrize("share", ["off", "on"])
def test_packed_rows_match_padded_rows(tiny_model, tmp_path, share, packed):
    """learner.attention=packed_sdpa / varlen (one packed row per micro-batch, position ids per sequence, the
    document/shared-prompt boundaries as a dense mask / as varlen segments whose responses gather their
    prompt's keys; on CPU varlen runs its exact reference) vs padded (today's rows): same logprobs, loss, KL,
    entropy, gradient norm and weights after a step, with two mini-batches (old-logprob and reference passes
    on packed rows too) and a logprob chunk smaller than a micro-batch."""
    algo = AlgoConfig(kl_coef=0.05, entropy_coef=0.01)
    recs = make_records(1, seed=7, groups=3, n=4)
    res = {}
    for attention in ("padded", packed):
        cfg = LearnerConfig(device="cpu", lr=1.0, adam_eps=1.0, grad_clip=None, micro_batch_tokens=40, mini_batches=2,
                            share_prompt=share, attention=attention,
                            logprob_chunk_tokens=7 if attention == packed else 2048)
        res[attention] = one_step(tiny_model, algo, cfg, recs, tmp_path / f"w-{attention}", logprobs=True)
    (lp_pad, pad, w_pad), (lp_pk, pk, w_pk) = res["padded"], res[packed]
    for a, b in zip(lp_pad, lp_pk):
        assert b == pytest.approx(a, abs=1e-5)
    assert pk["batch/padded_tokens"] < pad["batch/padded_tokens"]  # no padding between sequences
    assert pk["batch/computed_tokens"] == pad["batch/computed_tokens"]
    for k in ("actor/loss", "actor/grad_norm", "actor/kl_ref", "actor/entropy", "actor/clip_frac"):
        assert pk[k] == pytest.approx(pad[k], rel=1e-4, abs=1e-6), k
    assert_weights_close(w_pad, w_pk, atol=1e-5)


def test_meta_device_init_gives_the_loaded_weights(tiny_model):
    """Every rank builds on the meta device and receives rank 0's weights: parameters and the buffers a meta
    build leaves empty (rotary frequencies) equal a plain from_pretrained."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    learner = Learner(tiny_model, AlgoConfig(kl_coef=0.1), LearnerConfig(device="cpu"))
    try:
        assert not learner.compiled  # learner.compile auto: off on CPU
        for model in (learner.model, learner.ref_model):
            got = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
            want = dict(ref.named_parameters())
            assert got.keys() == want.keys()
            for n in want:
                torch.testing.assert_close(got[n], want[n].detach(), atol=0, rtol=0, msg=n)
            for n, b in ref.named_buffers():
                torch.testing.assert_close(dict(model.named_buffers())[n], b, atol=0, rtol=0, msg=n)
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    finally:
        learner.close()


# ---- asynchronous records -----------------------------------------------------------------

def with_versions(records, step: int, lags: list[int]):
    """Records whose model tokens carry versions (step - 1) - lag, lag cycling over `lags` per token."""
    out = []
    for r in records:
        tv = [None if not m else (step - 1) - lags[k % len(lags)] for k, m in enumerate(r.response_mask)]
        out.append(r.model_copy(update={"token_versions": tv}))
    return out


def test_token_versions_give_staleness_metrics_and_change_nothing_else(tiny_model, tmp_path):
    """Versions add async/* metrics (and the interpolation error in recompute mode) but train exactly as
    records without versions."""
    algo = AlgoConfig(kl_coef=0.05)
    cfg = LearnerConfig(device="cpu", lr=1.0, adam_eps=1.0, grad_clip=None, micro_batch_tokens=40, mini_batches=2)
    recs = make_records(3, seed=9)
    _, plain, w_plain = one_step(tiny_model, algo, cfg, recs, tmp_path / "plain", step=3)
    _, ver, w_ver = one_step(tiny_model, algo, cfg, with_versions(recs, 3, [0, 0, 1]), tmp_path / "ver", step=3)
    assert "async/staleness_mean" not in plain and "mismatch/interpolate_abs_err" not in plain
    vrecs = with_versions(recs, 3, [0, 0, 1])
    lags = [2 - v for r in vrecs if r.error is None for v in r.token_versions if v is not None]
    assert ver["async/lag_share_0"] == pytest.approx(lags.count(0) / len(lags)) and ver["async/staleness_max"] == 1.0
    assert ver["mismatch/interpolate_abs_err"] > 0
    for k in ("actor/loss", "actor/grad_norm", "actor/kl_ref"):
        assert ver[k] == pytest.approx(plain[k], rel=1e-6, abs=1e-8), k
    assert_weights_close(w_plain, w_ver, atol=0)


def test_rollout_logprobs_reach_the_update_only_through_the_importance_weight(tiny_model, tmp_path):
    """In recompute mode with tis_cap=None the behaviour logprobs are metrics only: noise on them (the real
    server's logprobs of the same tokens vary by ~1e-4 run to run) leaves the weights bit-identical. With
    the importance weight on, the same noise moves weights by O(lr) (Adam flips the sign of updates whose
    gradient terms cancel), which is why test_async_real's η=0 equality turns it off."""
    recs = make_records(1)
    cfg = LearnerConfig(device="cpu", lr=1e-3)
    lps, _, _ = one_step(tiny_model, AlgoConfig(), cfg, recs, tmp_path / "lp", logprobs=True)
    g = torch.Generator().manual_seed(0)
    noisy = [[lp + 5e-5 * float(torch.randn(1, generator=g)) for lp in row] for row in lps]
    diffs = {}
    for tis in (None, 2.0):
        _, _, a = one_step(tiny_model, AlgoConfig(tis_cap=tis), cfg, with_logprobs(recs, lps), tmp_path / f"{tis}a")
        _, _, b = one_step(tiny_model, AlgoConfig(tis_cap=tis), cfg, with_logprobs(recs, noisy), tmp_path / f"{tis}b")
        wa, wb = load_weights(a), load_weights(b)
        diffs[tis] = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert diffs[None] == 0.0
    assert diffs[2.0] > 1e-5  # the noise does reach the update through the weight


def test_interpolated_proximal_skips_the_old_logprob_pass(tiny_model, tmp_path, monkeypatch):
    """algo.proximal=interpolate: no no-grad forward of the policy; the first mini-batch still uses its exact
    logprobs (nothing has moved), later ones AReaL's interpolation. Records without versions are refused."""
    import agentloop.train.trainer.learner as learner_mod

    passes = {"n": 0}
    orig = learner_mod.Learner._forward

    def counting(self, model, mb, *, entropy, entropy_grad):
        if model is self.model and not torch.is_grad_enabled():
            passes["n"] += 1
        return orig(self, model, mb, entropy=entropy, entropy_grad=entropy_grad)

    monkeypatch.setattr(learner_mod.Learner, "_forward", counting)
    cfg = LearnerConfig(device="cpu", lr=1e-2, micro_batch_tokens=40, mini_batches=2)
    recs = with_versions(make_records(2, seed=4), 2, [0, 1])
    _, rec_m, w_rec = one_step(tiny_model, AlgoConfig(proximal="recompute"), cfg, recs, tmp_path / "r", step=2)
    n_recompute = passes["n"]
    passes["n"] = 0
    _, int_m, w_int = one_step(tiny_model, AlgoConfig(proximal="interpolate"), cfg, recs, tmp_path / "i", step=2)
    assert n_recompute > 0 and passes["n"] == 0
    assert "mismatch/interpolate_abs_err" in rec_m and "mismatch/interpolate_abs_err" not in int_m
    assert math.isfinite(int_m["actor/loss"]) and int_m["actor/optimizer_steps"] == 2.0
    with pytest.raises(ValueError, match="token_versions"):
        one_step(tiny_model, AlgoConfig(proximal="interpolate"), cfg, make_records(2, seed=4), tmp_path / "x")


def test_k1_in_reward_lowers_advantages_by_the_penalty_return(tiny_model, tmp_path):
    """kl_type=k1_reward: no KL loss term; the advantages carry the penalty (so the loss differs from no KL
    at all), reported as actor/kl_penalty (mean k1)."""
    cfg = LearnerConfig(device="cpu", lr=1e-3, micro_batch_tokens=40)
    recs = make_records(1, seed=2)
    _, none, _ = one_step(tiny_model, AlgoConfig(), cfg, recs, tmp_path / "a")
    _, rew, _ = one_step(tiny_model, AlgoConfig(kl_coef=1.0, kl_type="k1_reward"), cfg, recs, tmp_path / "b")
    # step 1 starts at the reference: k1 = 0 on every token, so the advantages, loss and gradient are unchanged
    assert rew["actor/kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    assert rew["actor/loss"] == pytest.approx(none["actor/loss"], rel=1e-5)


def _reject_some(recs, lps, every=3):
    """Behaviour logprobs equal to the policy's, except every `every`-th model token, 3 nats higher (k1 = 3,
    rejected by token_k1 0.5_2.0); and the same records with those tokens taken out of the mask instead."""
    shifted, masked = [], []
    k = 0
    for r, row in zip(recs, lps):
        lp, mask = [], []
        for v, m in zip(row, r.response_mask):
            hit = bool(m) and k % every == 0
            k += bool(m)
            lp.append(v + 3.0 if hit else v)
            mask.append(0 if hit else m)
        shifted.append(r.model_copy(update={"response_logprobs": lp}))
        masked.append(r.model_copy(update={"response_mask": mask,
                                           "response_logprobs": [v if m else 0.0 for v, m in zip(row, mask)]}))
    return shifted, masked


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_rejected_tokens_train_as_if_they_were_not_model_tokens(tiny_model, tmp_path, mode):
    """algo.rollout_rs (verl's decoupled rejection): a rejected token leaves the loss and its denominators, so
    the update equals the one of the same records with that token's mask set to 0 (GRPO's advantages come
    from rewards only, so they agree too)."""
    recs = [r for r in make_records(1) if r.error is None]
    cfg = LearnerConfig(device="cpu", lr=1e-3, micro_batch_tokens=40, mini_batches=2)
    lps, _, _ = one_step(tiny_model, AlgoConfig(), cfg, recs, tmp_path / "lp", logprobs=True)
    shifted, masked = _reject_some(recs, lps)
    rs = AlgoConfig(rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0", loss_agg_mode=mode, tis_cap=None)
    _, m_rs, w_rs = one_step(tiny_model, rs, cfg, shifted, tmp_path / "rs")
    _, m_mask, w_mask = one_step(tiny_model, AlgoConfig(loss_agg_mode=mode, tis_cap=None), cfg, masked,
                                 tmp_path / "mask")
    n_model = sum(sum(r.response_mask) for r in recs)
    n_rejected = n_model - sum(sum(r.response_mask) for r in masked)
    assert m_rs["mismatch/rs_masked_frac"] == pytest.approx(n_rejected / n_model)
    assert m_rs["actor/loss"] == pytest.approx(m_mask["actor/loss"], rel=1e-4, abs=1e-7)
    assert_weights_close(w_rs, w_mask, atol=1e-6)


def test_kl_in_reward_loads_the_reference_and_adapts_its_coefficient(tiny_model, tmp_path):
    """algo.use_kl_in_reward: the reference model is loaded with kl_coef = 0; after the policy moved, the
    penalty is reported (verl's actor/reward_kl_penalty) and changes the update; the adaptive beta moves after
    each step and comes back from a checkpoint."""
    cfg = LearnerConfig(device="cpu", lr=1e-2, micro_batch_tokens=40)
    algo = AlgoConfig(use_kl_in_reward=True, kl_penalty="low_var_kl", kl_ctrl="adaptive", kl_ctrl_coef=0.5,
                      kl_ctrl_target=1e-6, kl_ctrl_horizon=10)
    learner = Learner(tiny_model, algo, cfg)
    try:
        assert learner.ref_model is not None
        first = learner.train_step(make_records(1), 1)
        assert first["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)  # policy == reference
        beta1 = learner.kl_ctrl.value
        n = first["batch/episodes"]
        assert beta1 == pytest.approx(0.5 * (1 - 0.2 * n / 10))  # kl 0 < target: the largest step down
        second = learner.train_step(make_records(2), 2)
        assert second["actor/reward_kl_penalty"] > 0 and second["actor/reward_kl_penalty_coeff"] == beta1
        assert learner.kl_ctrl.value == pytest.approx(beta1 * (1 + 0.2 * second["batch/episodes"] / 10))  # up
        ck = learner.save_checkpoint(tmp_path / "ck")
        saved = learner.kl_ctrl.value
        learner.kl_ctrl.value = 123.0
        learner.load_checkpoint(ck)
        assert learner.kl_ctrl.value == saved
    finally:
        learner.close()
    no_kl = Learner(tiny_model, AlgoConfig(), cfg)
    try:
        no_kl.train_step(make_records(1), 1)
        plain = no_kl.train_step(make_records(2), 2)
    finally:
        no_kl.close()
    assert plain["actor/loss"] != pytest.approx(second["actor/loss"], rel=1e-4)


# ---- checkpoints --------------------------------------------------------------------------

_CKPT_CHILD = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import torch
    from agentloop.train.trainer import checkpoint as ck
    from agentloop.train.config import AlgoConfig, LearnerConfig
    from agentloop.train.trainer.learner import Learner
    sys.path.insert(0, {root!r})
    from tests.unit.train.test_learner import make_records

    mode, model, root = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    learner = Learner(model, AlgoConfig(), LearnerConfig(device="cpu", lr=1e-2, keep_checkpoints=1))
    learner.train_step(make_records(1), 1)
    learner.save_checkpoint(root, data_position=1)
    learner.save_hf(root.parent / "w1")
    kill = lambda: os.kill(os.getpid(), signal.SIGKILL)
    if mode == "resave":  # a second save of the same step, killed between its two renames
        ck._between_renames = kill
        learner.save_checkpoint(root, data_position=2)
    else:  # step 2 saved in the background, killed while its files are being written
        import torch.distributed.checkpoint.filesystem as fs
        orig = fs.FileSystemWriter.write_data
        def write_then_die(self, plan, planner):
            fut = orig(self, plan, planner)
            fut.wait()
            kill()
        fs.FileSystemWriter.write_data = write_then_die
        learner.train_step(make_records(2), 2)
        learner.save_checkpoint(root, data_position=2, background=True)
        learner.wait_checkpoint()
    print("not killed")
""")


@pytest.mark.parametrize("mode", ["resave", "background"])
def test_a_checkpoint_killed_mid_save_leaves_the_previous_one_usable(tiny_model, tmp_path, mode):
    """SIGKILL inside a save (keep_checkpoints=1): between the renames of a re-save of the same step, or while
    a background save writes its files. The latest complete checkpoint is still step 1 and loads exactly."""
    root = tmp_path / "ck"
    repo = str(Path(__file__).resolve().parents[3])
    proc = subprocess.run([sys.executable, "-c", _CKPT_CHILD.format(root=repo), mode, str(tiny_model), str(root)],
                          env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == -9, proc.stdout[-2000:] + proc.stderr[-3000:]
    leftovers = sorted(p.name for p in root.iterdir())
    # resave: the old step 1 renamed aside, the new one not yet in place; background: step 2 never completed
    assert leftovers == (["step-000001.prev", "step-000001.tmp"] if mode == "resave"
                         else ["step-000001", "step-000002.tmp"])
    ck = latest_checkpoint(root)
    assert ck is not None and json.loads((ck / "meta.json").read_text())["step"] == 1
    learner = Learner(tiny_model, AlgoConfig(), LearnerConfig(device="cpu", lr=1e-2, keep_checkpoints=1))
    try:
        assert learner.load_checkpoint(ck).step == 1
        assert_weights_close(tmp_path / "w1", learner.save_hf(tmp_path / "w1-loaded"), atol=0)
        learner.save_checkpoint(root)  # the next save cleans up and replaces step 1 in place
        assert sorted(p.name for p in root.iterdir()) == ["step-000001"]
    finally:
        learner.close()


def test_every_background_checkpoint_of_a_run_is_written(tiny_model, tmp_path, monkeypatch):
    """Three background checkpoints in a row all land. torch 2.11's DefaultStager clears its copy table when
    a staging ends, so its second use failed (KeyError: <class 'type'>, the second checkpoint of a GPU run);
    the stand-in below behaves that way, on any torch."""
    from torch.distributed.checkpoint import staging

    class OneShotStager(staging.DefaultStager):
        used = 0

        def stage(self, state_dict, **kw):
            if getattr(self, "_spent", False):
                raise KeyError(type)
            self._spent = True
            OneShotStager.used += 1
            return super().stage(state_dict, **kw)

    monkeypatch.setattr(staging, "DefaultStager", OneShotStager)
    learner = Learner(tiny_model, AlgoConfig(), LearnerConfig(device="cpu", lr=1e-2))
    try:
        for step in (1, 2, 3):
            learner.train_step(make_records(step), step)
            learner.save_checkpoint(tmp_path / "ck", data_position=step, background=True)
        assert learner.wait_checkpoint().name == "step-000003"
        assert OneShotStager.used == 3
        assert [p.name for p in list_checkpoints(tmp_path / "ck")][-2:] == ["step-000002", "step-000003"]
    finally:
        learner.close()


def test_background_checkpoint_equals_a_synchronous_one(tiny_model, tmp_path):
    """learner.checkpoint_background: training goes on while the files are written; the checkpoint appears once
    complete and restores the state of its step exactly (the next step's update waited for the copy)."""
    learner = Learner(tiny_model, AlgoConfig(), LearnerConfig(device="cpu", lr=1e-2, ppo_epochs=2))
    try:
        learner.train_step(make_records(1), 1)
        w1 = learner.save_hf(tmp_path / "w1")
        final = learner.save_checkpoint(tmp_path / "ck", data_position={"row": 3}, background=True)
        # on CUDA the copy to host memory runs on a side stream: every optimizer step must wait for it first
        events: list[str] = []
        ck_wait, opt_step = learner._ckpt.wait_staged, learner.optimizer.step
        learner._ckpt.wait_staged = lambda: (events.append("wait_staged"), ck_wait())[1]
        learner.optimizer.step = lambda *a, **k: (events.append("step"), opt_step(*a, **k))[1]
        learner.train_step(make_records(2), 2)  # runs while the checkpoint of step 1 is written
        assert events == ["wait_staged", "step", "wait_staged", "step"]  # ppo_epochs=2
        assert learner.wait_checkpoint() == final and final.is_dir()
        meta = learner.load_checkpoint(final)
        assert (meta.step, meta.data_position) == (1, {"row": 3})
        assert_weights_close(w1, learner.save_hf(tmp_path / "w1b"), atol=0)
    finally:
        learner.close()


def test_background_checkpoint_is_published_while_the_learner_waits(tiny_model, tmp_path):
    """The mailbox learner checkpoints step 1 in the background and then waits for step 2's batch (rollouts can
    take long): the checkpoint goes into place as soon as it is written, not at the next step."""
    run = tmp_path / "run"
    run.mkdir()
    proc = _launch(run, tiny_model, ["learner.device=cpu", "learner.poll_s=0.05", "learner.checkpoint_every=1",
                                     "learner.checkpoint_background=on"])
    try:
        client = MailboxClient(run, process=proc, poll_s=0.05)
        client.wait_ready(120)
        client.submit_records(1, make_records(1), ALGO)
        client.wait_update(1, 120)
        deadline = time.monotonic() + 60
        while latest_checkpoint(run / "checkpoints") is None:
            assert time.monotonic() < deadline, "the step-1 checkpoint never appeared while the learner waited"
            client.check_alive()
            time.sleep(0.05)
        assert latest_checkpoint(run / "checkpoints").name == "step-000001"
        _finish(proc, client, run)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_pruning_never_deletes_the_newest_checkpoints_weights(tmp_path):
    paths = MailboxPaths(tmp_path)
    for s in range(1, 10):
        (paths.weights(s)).mkdir(parents=True)
    _prune_weights(paths, 3, protect={5})
    assert sorted(d.name for d in paths.weights_root.iterdir()) == [f"step-00000{s}" for s in (5, 7, 8, 9)]
    _prune_weights(paths, 1, protect=set())
    assert [d.name for d in paths.weights_root.iterdir()] == ["step-000009"]


def test_wait_caught_up_waits_for_the_batches_already_submitted(tmp_path):
    client = MailboxClient(tmp_path, heartbeat_timeout_s=30, poll_s=0.02)
    box = LearnerMailbox(tmp_path)
    client.submit_records(3, make_records(3), ALGO, data_position={"next": 6})
    box.update_info(status="ready", next_step=3, data_position={"next": 4})  # resumed at 3, batch 3 waiting
    with pytest.raises(MailboxTimeout, match="submitted batch of step 3"):
        client.wait_caught_up(0.2)
    box.update_info(status="ready", next_step=4, data_position={"next": 6})
    assert client.wait_caught_up(1.0)["data_position"] == {"next": 6}
    client.submit_records(4, make_records(4), ALGO)
    try:
        raise ValueError("bad batch")
    except ValueError as e:
        box.write_failed(4, e)
    with pytest.raises(LearnerFailedError, match="ValueError: bad batch"):
        client.wait_caught_up(5.0)


def test_final_save_plan():
    """The last step N needs an HF directory (tensor|nccl never wrote one) and a checkpoint (unless the newest
    complete one is of step N); a learner that trained nothing writes nothing."""
    assert plan_final_save(7, weights_on_disk=True, checkpoint_step=5) == FinalPlan(False, True)  # disk sync
    assert plan_final_save(7, weights_on_disk=False, checkpoint_step=5) == FinalPlan(True, True)  # tensor|nccl
    assert plan_final_save(8, weights_on_disk=True, checkpoint_step=8) == FinalPlan(False, False)
    assert plan_final_save(8, weights_on_disk=False, checkpoint_step=None) == FinalPlan(True, True)
    assert plan_final_save(0, weights_on_disk=False, checkpoint_step=None) == FinalPlan(False, False)


def test_resume_weights_survive_pruning_and_a_final_stop_saves_the_last_step(tiny_model, tmp_path):
    """keep_weights=1 with a checkpoint every 2 steps: after step 3 the weights of checkpoint 2 are still
    there (a resume loads them into the servers). Deleted anyway (pruned by an older learner), a restarted
    learner writes them again from the checkpoint before it reports ready. A final STOP after step 3 (not a
    checkpoint step, its HF weights gone as with a pushing sync path) writes both and names them in
    final.json; a plain STOP would not."""
    run = tmp_path / "run"
    run.mkdir()
    overrides = ["learner.device=cpu", "learner.checkpoint_every=2", "learner.keep_weights=1",
                 "learner.poll_s=0.05", "learner.lr=0.01"]
    proc = _launch(run, tiny_model, overrides)
    try:
        client = MailboxClient(run, process=proc, poll_s=0.05)
        client.wait_ready(120)
        for s in (1, 2, 3):
            client.submit_records(s, make_records(s), ALGO, data_position={"next": 2 * s, "requeue": []})
            client.wait_update(s, 120)
        assert sorted(d.name for d in (run / "weights").iterdir()) == ["step-000002", "step-000003"]
    finally:
        proc.kill()
        proc.wait()
    os.replace(run / "weights" / "step-000002", tmp_path / "w2")

    t1 = time.time()
    proc = _launch(run, tiny_model, overrides)
    try:
        client = MailboxClient(run, process=proc, poll_s=0.05)
        assert client.wait_ready(120, since=t1)["resumed_step"] == 2
        assert_weights_close(tmp_path / "w2", run / "weights" / "step-000002", atol=0)  # from checkpoint 2
        assert "weights of checkpoint step 2 were missing" in (run / "learner.log").read_text()
        # step 3's batch is still in the mailbox: trained again, and learner.json then pairs next_step 4 with
        # the data position stored with that batch
        info = client.wait_caught_up(120)
        assert (info["next_step"], info["data_position"]) == (4, {"next": 6, "requeue": []})
        client.wait_update(3, 1)
        os.replace(run / "weights" / "step-000003", tmp_path / "w3")  # as weight_sync tensor|nccl leave it
        client.stop(final=True)
        final = client.wait_final(120)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert final["step"] == 3 and final["weights_dir"] == str(run / "weights" / "step-000003")
    assert final["checkpoint"] == str(run / "checkpoints" / "step-000003")
    assert_weights_close(tmp_path / "w3", run / "weights" / "step-000003", atol=0)
    assert (run / "weights" / "step-000003" / "tokenizer_config.json").is_file()
    assert read_meta(run / "checkpoints" / "step-000003").data_position == {"next": 6, "requeue": []}
    assert client.learner_info()["status"] == "stopped"
    assert "final model of step 3" in (run / "learner.log").read_text()


def test_checkpoint_every_null_writes_no_checkpoint(tiny_model, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    proc = _launch(run, tiny_model, ["learner.device=cpu", "learner.poll_s=0.05", "learner.checkpoint_every=null"])
    try:
        client = MailboxClient(run, process=proc, poll_s=0.05)
        client.wait_ready(120)
        for s in (1, 2):
            client.submit_records(s, make_records(s), ALGO)
            client.wait_update(s, 120)
        _finish(proc, client, run)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    assert (run / "weights" / "step-000002").is_dir()


# ---- GPU ----------------------------------------------------------------------------------

@pytest.mark.gpu
@JIT_WARNING
@pytest.mark.parametrize("packed,dtype,compiled", [("flex", "float32", False), ("flex", "bfloat16", False),
                                                    ("varlen", "bfloat16", False), ("varlen", "bfloat16", True)],
                         ids=["flex-fp32", "flex-bf16", "varlen-bf16", "varlen-bf16-compiled"])
def test_gpu_packed_matches_padded(tiny_model16, tmp_path, packed, dtype, compiled):
    """On CUDA: packed rows (shared prompts on) with the FlexAttention block mask or FlashAttention varlen
    segments (eager and inside compiled decoder layers) vs padded rows: same logprobs, loss, gradient norm and
    weights after a step (float32 tight, bfloat16 within its rounding)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    algo = AlgoConfig(kl_coef=0.05, entropy_coef=0.01)
    recs = make_records(1, seed=7, groups=3, n=4)
    res = {}
    for attention in ("padded", packed):
        cfg = LearnerConfig(lr=1.0 if dtype == "float32" else 1e-3, adam_eps=1.0, grad_clip=None,
                            micro_batch_tokens=64, mini_batches=2, share_prompt="on", attention=attention, dtype=dtype,
                            compile=compiled and attention == packed)
        res[attention] = one_step(tiny_model16, algo, cfg, recs, tmp_path / f"w-{attention}", logprobs=True)
    (lp_a, a, w_a), (lp_b, b, w_b) = res["padded"], res[packed]
    tol = 1e-4 if dtype == "float32" else 5e-2
    for x, y in zip(lp_a, lp_b):
        assert y == pytest.approx(x, abs=tol)
    for k in ("actor/loss", "actor/grad_norm", "actor/kl_ref", "actor/entropy"):
        assert b[k] == pytest.approx(a[k], rel=tol * 10, abs=tol), k
    assert_weights_close(w_a, w_b, atol=1e-5 if dtype == "float32" else 2e-2)


@pytest.mark.gpu
@JIT_WARNING
def test_gpu_compiled_learner_checkpoints_in_background(tiny_model16, tmp_path):
    """learner.compile on CUDA (varlen attention): a background checkpoint is written while the next step runs
    and restores the state of its step."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cfg = LearnerConfig(lr=1e-3, compile=True, attention="varlen", dtype="bfloat16", micro_batch_tokens=64)
    learner = Learner(tiny_model16, AlgoConfig(), cfg)
    try:
        learner.train_step(make_records(1, groups=3, n=4), 1)
        learner.save_checkpoint(tmp_path / "ck", background=True)
        learner.train_step(make_records(2, groups=3, n=4), 2)  # waits for the staging, then moves the weights
        ck = learner.wait_checkpoint()
        assert ck is not None and ck.name == "step-000001"
        w2 = learner.save_hf(tmp_path / "w2a")
        learner.load_checkpoint(ck)
        learner.train_step(make_records(2, groups=3, n=4), 2)
        # FlashAttention's backward accumulates with atomics: not bitwise repeatable; within 2 x lr
        assert_weights_close(w2, learner.save_hf(tmp_path / "w2b"), atol=2e-3)
    finally:
        learner.close()


@pytest.mark.gpu
@JIT_WARNING
def test_gpu_chunked_logprobs_keep_memory_flat():
    """152k vocabulary, 8192 tokens: the chunked forward + backward peaks far below one [tokens x vocab]
    float32 tensor (4.6 GiB), and grows with the chunk, not with the tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from agentloop.train.trainer.logprobs import chunked_logprobs

    dev = torch.device("cuda")
    v, h = 151_936, 896
    w = (torch.randn(v, h, device=dev) * 0.02).to(torch.bfloat16).requires_grad_(True)
    peaks = {}
    for n in (4096, 8192):
        hid = torch.randn(n, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
        y = torch.randint(0, v, (n,), device=dev)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        lp, ent = chunked_logprobs(hid, w, y, chunk=1024, entropy=True)
        (lp.sum() + ent.sum()).backward()
        torch.cuda.synchronize()
        peaks[n] = (torch.cuda.max_memory_allocated() - base) / 2**30
        w.grad = None
    assert peaks[8192] < 2.5, peaks
    assert peaks[8192] - peaks[4096] < 0.5, peaks
