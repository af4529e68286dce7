"""LoRA on a real CPU SGLang server (--enable-lora, torch-native LoRA kernels): the learner's adapter, loaded as an
adapter, gives sampled tokens the learner's logprobs (the full-weight tolerance); version 0 (no adapter) is the
base model, which the zero-initialised learner equals; `agentloop train` with learner.lora runs end to end, every
token stamped with the adapter version that produced it, the run's records matching that adapter's merged model
(merged in float32); in each interrupt mode (abort, retract, in_place) the same holds token by token; and a LoRA
run SIGKILLed after a checkpoint resumes with the README's command from the checkpoint's adapter and optimizer
state, the servers on the right adapter, no step repeated or lost."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import torch

from agentloop import ServerManager
from agentloop.config import ManagerConfig, SamplingParams, load_config
from agentloop.records import EpisodeRecord, read_records
from agentloop.train.config import AlgoConfig, LearnerConfig, LoraConfig
from agentloop.train.lora import adapter_name, merge_adapter_dir, server_args
from tests.conftest import require_sglang

pytestmark = pytest.mark.sglang

LORA = LoraConfig(enabled=True, rank=8, alpha=16.0)
TOL = 1e-4
"""Max |learner - server| per token, as for full weights (tests/integration/test_logprobs_real.py)."""
PROMPTS = [[5, 17, 99, 230, 41, 7], [88, 150, 12, 64, 301, 9, 14], [1200, 33, 402, 77]]


@pytest.fixture(scope="module")
def lora_server(tiny_model_path, tmp_path_factory):
    require_sglang()
    from agentloop.inference.launcher import LocalServer

    log = tmp_path_factory.mktemp("sglang-lora") / "server.log"
    server = LocalServer(tiny_model_path, device="cpu", log_path=log, startup_timeout_s=280,
                         extra_args=server_args(LORA, "cpu")).start()
    try:
        asyncio.run(server.wait_ready())
        yield server
    finally:
        server.stop()


async def _post(url: str, path: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
            return await r.json()


def _sample(url: str, versions: int) -> list[EpisodeRecord]:
    """Records sampled on `url` at T=1 through a ServerManager whose servers serve adapter version `versions`."""
    async def go():
        async with ServerManager([url], ManagerConfig(), initial_version=versions) as sm:
            sm.state.lora_adapters = True
            return await asyncio.gather(*(sm.generate(f"t-{i}", prompt_ids=p, sampling_params=SamplingParams(
                max_new_tokens=16, temperature=1.0, ignore_eos=True, seed=i)) for i, p in enumerate(PROMPTS)))

    outs = asyncio.run(go())
    assert all(o.token_versions == [versions] * len(o.token_ids) for o in outs)
    return [EpisodeRecord(prompt_ids=p, response_ids=o.token_ids, response_mask=[1] * len(o.token_ids),
                          response_logprobs=o.logprobs, episode_id=f"0-{i}", index=0, repeat=i, data_source="t",
                          loop="none", seed=i, reward=float(i % 2)) for i, (p, o) in enumerate(zip(PROMPTS, outs))]


def _max_diff(a: list[list[float]], records: list[EpisodeRecord]) -> float:
    return max(abs(x - y) for row, r in zip(a, records) for x, y in zip(row, r.response_logprobs))


@pytest.mark.timeout(900)
def test_the_servers_adapter_gives_the_learners_logprobs(lora_server, tiny_model_path, tmp_path):
    from agentloop.train.trainer.learner import Learner

    url = lora_server.url
    learner = Learner(tiny_model_path, AlgoConfig(old_logprobs="rollout"),
                      LearnerConfig(device="cpu", dtype="float32", lr=5e-2, lora=LORA))
    try:
        base = _sample(url, 0)  # version 0: no adapter named, the base model
        assert _max_diff(learner.compute_logprobs(base), base) < TOL
        for step in (1, 2, 3):  # the adapter moves far from zero
            learner.train_step(base, step)
        ad = learner.save_served(tmp_path / "adapter")
        out = asyncio.run(_post(url, "/load_lora_adapter", {"lora_name": adapter_name(7), "lora_path": str(ad)}))
        assert out["success"], out
        try:
            tuned = _sample(url, 7)  # every request names agentloop-v7
            diff = _max_diff(learner.compute_logprobs(tuned), tuned)
            moved = _max_diff(learner.compute_logprobs(base), base)
        finally:
            asyncio.run(_post(url, "/unload_lora_adapter", {"lora_name": adapter_name(7)}))
    finally:
        learner.close()
    print(f"max |learner - server| with the adapter: {diff:.2e}; the trained learner vs the base's sample: {moved:.2e}")
    assert diff < TOL
    assert moved > 50 * TOL  # the adapter changed the policy: the comparison above can fail


@pytest.mark.timeout(900)
def test_agentloop_train_with_lora_runs_end_to_end(lora_server, tiny_model_path, tmp_path):
    from agentloop.train.orchestrator.loop import run_train

    url = lora_server.url
    plugin = tmp_path / "reward.py"
    plugin.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) > 0 and ord(solution_str[0]) % 2 == 0)\n")
    cfg = load_config(None, [
        f"server.urls=[\"{url}\"]", f"model.path=\"{tiny_model_path}\"", f"run_dir=\"{tmp_path / 'run'}\"",
        "train.steps=3", "train.prompts_per_step=3", "rollout.n_samples=4", "train.val_every=0",
        "sampling.max_new_tokens=8", f"reward.custom=\"{plugin}:compute_score\"", "learner.lr=0.005",
        "train.tensorboard=false", "learner.lora.enabled=true", f"learner.lora.rank={LORA.rank}",
        f"learner.lora.alpha={LORA.alpha}", "sampling.temperature=1.0"])
    assert cfg.train.schedule == "async" and cfg.train.max_staleness >= 1
    run_dir, final = run_train(cfg)
    weights = run_dir / "weights"
    last = weights / "step-000003"
    assert final["last_weights"] == str(last)
    assert sorted(p.name for p in last.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "merged"]
    assert (last / "merged" / "model.safetensors").is_file()
    info = json.loads(urllib_get(url + "/model_info"))
    assert info["weight_version"] == "3"
    # every token names the adapter version that produced it (version v: the adapter of step v; 0: the base): a
    # record of one version is far closer to that adapter's merged model than to its neighbours'
    seen: set[int] = set()
    worst: dict[int, float] = {}
    # merged in float32: the tiny model's weights are bf16, and a merge rounded to bf16 is not the adapter's policy
    # (it moved logprobs by 2.7e-3: the "gap" issue 32 saw was the reference's rounding, not the server)
    models = {v: _model(tiny_model_path if v == 0 else merge_adapter_dir(
        tiny_model_path, weights / f"step-{v:06d}", tmp_path / f"merged-{v}", dtype=torch.float32))
        for v in (0, 1, 2)}
    for step in (1, 2, 3):
        recs = [r for r in read_records(run_dir / "rollouts" / f"step-{step:06d}.jsonl") if r.error is None]
        assert recs
        for r in recs:
            vs = {v for v in r.token_versions if v is not None}
            assert vs and all(step - 1 - cfg.train.max_staleness <= v <= step - 1 for v in vs), (step, vs)
            seen |= vs
            if len(vs) != 1:
                continue
            (v,) = vs
            d = {u: _max_abs(_hf_logprobs(m, r), r) for u, m in models.items()}
            worst[v] = max(worst.get(v, 0.0), d[v])
            assert all(d[v] * 20 < d[u] for u in d if u != v), (v, d)
    print(f"token versions seen: {sorted(seen)}; max |merged model - server| per version: {worst}")
    assert 1 in seen and all(d < TOL for d in worst.values()), worst  # measured 9.5e-7 for versions 0 and 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert any("learner/actor/loss" in row for row in rows)


def urllib_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def _model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def _hf_logprobs(m, r) -> list[float]:
    ids = torch.tensor([list(r.prompt_ids) + list(r.response_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(m(input_ids=ids).logits.float(), -1)[0]
    p = len(r.prompt_ids)
    return [float(logp[p + k - 1, t]) for k, t in enumerate(r.response_ids)]


def _max_abs(lps: list[float], r) -> float:
    return max(abs(a - b) for a, b, m in zip(lps, r.response_logprobs, r.response_mask) if m)


def _adapter_models(base, weights: Path, versions, tmp: Path) -> dict:
    """Version -> the HF model of that adapter merged in float32 (0: the base)."""
    return {v: _model(base if v == 0 else merge_adapter_dir(base, weights / f"step-{v:06d}", tmp / f"merged-{v}",
                                                            dtype=torch.float32)) for v in versions}


def _token_errors(records, models: dict) -> dict[int, float]:
    """Per stamped version, max |server logprob - the logprob of that version's model| over every sampled token
    (a record's tokens may carry several versions: each is re-scored by its own)."""
    worst: dict[int, float] = {}
    for r in records:
        lps = {v: _hf_logprobs(models[v], r) for v in {v for v in r.token_versions if v is not None}}
        for k, (v, m) in enumerate(zip(r.token_versions, r.response_mask)):
            if m:
                worst[v] = max(worst.get(v, 0.0), abs(lps[v][k] - r.response_logprobs[k]))
    return worst


def _cli(url: str, model, run_dir: Path, plugin: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "agentloop.cli", "train", "--quiet", "--server-url", url, "--model", str(model),
            "--loop", "single_turn_agent_loop", "--run-dir", str(run_dir), "train.val_every=0",
            "train.tensorboard=false", "reward.custom=" + json.dumps(f"{plugin}:compute_score"),
            "learner.lora.enabled=true", f"learner.lora.rank={LORA.rank}", f"learner.lora.alpha={LORA.alpha}",
            "sampling.temperature=1.0", *overrides]


def _plugin(tmp_path: Path) -> Path:
    plugin = tmp_path / "reward.py"
    plugin.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) > 0 and ord(solution_str[0]) % 2 == 0)\n")
    return plugin


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_each_interrupt_mode_trains_lora_with_every_token_naming_its_adapter(lora_server, tiny_model_path, tmp_path,
                                                                            mode):
    """Async `agentloop train` with LoRA in train.interrupt=mode, long answers so pushes land mid-episode: the run
    finishes, every sampled token carries the version of the adapter that sampled it (stamps in order, within
    the staleness bound) and equals that adapter's merged model's logprob; abort cuts calls, continued under the
    next adapter (tokens of two versions); retract and in_place keep a request on the adapter it named."""
    url, run_dir = lora_server.url, tmp_path / "run"
    cmd = _cli(url, tiny_model_path, run_dir, _plugin(tmp_path), "train.steps=3", "train.prompts_per_step=2",
               "rollout.n_samples=2", "sampling.max_new_tokens=160", "sampling.ignore_eos=true",
               "learner.lr=0.005", "learner.checkpoint_every=null", "learner.keep_weights=10",
               f"train.interrupt={mode}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0]
    recs = {s: list(read_records(run_dir / "rollouts" / f"step-{s:06d}.jsonl")) for s in (1, 2, 3)}
    assert all(r.error is None and r.finish_reason != "abort" for rs in recs.values() for r in rs)
    for s, rs in recs.items():
        for r in rs:
            vs = [v for v, m in zip(r.token_versions, r.response_mask) if m]
            assert vs == sorted(vs) and s - 2 <= vs[0] and vs[-1] <= s - 1, (mode, s, sorted(set(vs)))
    every = [r for rs in recs.values() for r in rs]
    continued = [r for r in every if r.metrics.get("interrupted_calls", 0) > 0]
    if mode == "abort":  # a push cut calls of the next step's episodes; they went on under the new adapter
        assert continued and sum(r["async/episodes_continued"] for r in rows) >= 1
        assert any(len(set(r.token_versions)) == 2 for r in continued)
    else:  # nothing is cut: a request keeps the adapter it named across the update
        assert not continued and all(len(set(r.token_versions)) == 1 for r in every)
    assert json.loads(urllib_get(url + "/model_info"))["weight_version"] == "3"
    versions = sorted({v for r in every for v in r.token_versions})
    worst = _token_errors(every, _adapter_models(tiny_model_path, run_dir / "weights", versions, tmp_path))
    print(f"{mode}: token versions {versions}, episodes continued {len(continued)}, max |model - server| {worst}")
    assert 1 in worst and all(d < TOL for d in worst.values()), worst


@pytest.mark.timeout(900)
def test_a_killed_lora_run_resumes_from_its_checkpoint_with_the_readme_command(lora_server, tiny_model_path,
                                                                               tmp_path):
    """SIGKILL to `agentloop train` (its process group; the learner dies with it) once step 4's batch is submitted,
    checkpoint 2 the latest; then the same command again (README: `agentloop train --run-dir X`). The learner
    resumes from checkpoint 2's adapter and optimizer state and trains the batches submitted after it as they
    are, the servers load the adapter of the step before the next one, and the run ends at step 5 with every
    step's row and batch exactly once, the optimizer's step counters at 5 (its state went on), the
    servers on adapter 5, and every token of every step equal to its adapter's logprob."""
    from agentloop.train.handle.mailbox import read_batch
    from agentloop.train.trainer.checkpoint import list_checkpoints, read_meta
    from tests.integration.test_train_resume_real import (
        _alive,
        _optimizer_steps,
        _run_to_end,
        _run_until,
        _wait_dead,
    )

    url, run_dir, steps = lora_server.url, tmp_path / "run", 5
    cmd = _cli(url, tiny_model_path, run_dir, _plugin(tmp_path), f"train.steps={steps}", "train.prompts_per_step=2",
               "rollout.n_samples=2", "sampling.max_new_tokens=6", "learner.lr=0.005", "learner.checkpoint_every=2",
               "learner.keep_weights=10", "train.update_timeout_s=300", "train.learner_ready_timeout_s=300")
    mailbox, logs = run_dir / "mailbox", [tmp_path / "run1.log", tmp_path / "run2.log"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen] = []
    pids: list[int] = []
    try:
        pids.append(_run_until(cmd, env, logs[0], procs, lambda: (
            (run_dir / "checkpoints" / "step-000002" / "meta.json").is_file()
            and (mailbox / "step-000004" / "batch.ready").exists()), "step 4's batch"))
        ck_at_kill = [p.name for p in list_checkpoints(run_dir / "checkpoints")]
        pids.append(_run_to_end(cmd, env, logs[1], procs, run_dir, 400))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    out = logs[1].read_text()
    print(f"checkpoints at the kill: {ck_at_kill}\n" + "\n".join(ln for ln in out.splitlines() if "resumed" in ln))
    assert ck_at_kill[-1] == "step-000002"  # the kill came after checkpoint 2, before checkpoint 4
    ck = run_dir / "checkpoints" / "step-000002"
    assert f"ready for step 3 (resumed from checkpoint {ck})" in (run_dir / "learner.log").read_text()
    first = int(out.split("resumed at step ")[1].split(" ")[0])
    assert first >= 4 and f"the learner resumed from checkpoint 2 and trained the {first - 3} batch(es)" in out
    assert f"servers loaded {run_dir / 'weights' / f'step-{first - 1:06d}'}" in out
    # every step once: its row, its batch (no data position trained twice)
    assert [r["step"] for r in _rows(run_dir)] == [float(s) for s in range(1, steps + 1)]
    trained: dict[int, int] = {}
    for step in range(1, steps + 1):
        for u in set(read_batch(run_dir, step).uid.tolist()):
            assert u not in trained, f"position {u} trained at steps {trained[u]} and {step}"
            trained[u] = step
    # the optimizer went on from checkpoint 2's state: 5 AdamW steps, over the adapter's tensors only
    last = list_checkpoints(run_dir / "checkpoints")[-1]
    assert read_meta(last).step == steps and _optimizer_steps(last, tmp_path) == {float(steps)}
    # the servers serve the last adapter, and every token after the resume came from the adapter it names
    assert json.loads(urllib_get(url + "/model_info"))["weight_version"] == str(steps)
    recs = [r for s in range(first, steps + 1) for r in read_records(run_dir / "rollouts" / f"step-{s:06d}.jsonl")]
    assert recs and all(r.error is None for r in recs)
    versions = sorted({v for r in recs for v in r.token_versions})
    assert min(versions) >= first - 2 and first - 1 in versions, versions
    worst = _token_errors(recs, _adapter_models(tiny_model_path, run_dir / "weights", versions, tmp_path))
    print(f"after the resume: token versions {versions}, max |model - server| {worst}")
    assert all(d < TOL for d in worst.values()), worst
    assert all(_wait_dead(pid, 60) for pid in pids) and not any(_alive(pid) for pid in pids)


@pytest.mark.timeout(900)
def test_weight_sync_tensor_loads_the_adapter_from_tensors_without_a_file(lora_server, tiny_model_path, tmp_path):
    """learner.weight_sync=tensor with LoRA: the learner hands its adapter to /load_lora_adapter_from_tensors (one
    shared-memory segment the server opens by name), nothing written. Directly: the server's tokens under the
    pushed adapter get the learner's logprobs (the full-weight tolerance). Through `agentloop train` (async, the
    servers paused around each push): no adapter directory is written while training (only the final one at the
    end), every token names its adapter version, and the servers end on the final adapter, whose tokens equal
    the final adapter's merged model's."""
    from agentloop.train.trainer.learner import Learner
    from agentloop.train.weights.tensor import TensorSync

    url = lora_server.url
    learner = Learner(tiny_model_path, AlgoConfig(old_logprobs="rollout"),
                      LearnerConfig(device="cpu", dtype="float32", lr=5e-2, lora=LORA, weight_sync="tensor"))
    try:
        base = _sample(url, 0)
        for step in (1, 2):
            learner.train_step(base, step)
        sync = TensorSync.from_config(learner.cfg)
        sync.check(learner)
        m = sync.push_adapter(learner, urls=[url], version=11)
        first = sync.segments.held[11]
        try:
            tuned = _sample(url, 11)
            diff = _max_diff(learner.compute_logprobs(tuned), tuned)
            moved = _max_diff(learner.compute_logprobs(base), base)
        finally:
            asyncio.run(_post(url, "/unload_lora_adapter", {"lora_name": adapter_name(11)}))
        # the server unloaded adapter 11 and the order says so: the next adapter is written into its memory
        learner.train_step(base, 3)
        sync.push_adapter(learner, urls=[url], version=12, released=[11])
        try:
            assert sync.segments.held[12] is first and not sync.segments.free
            again = _sample(url, 12)
            diff_again = _max_diff(learner.compute_logprobs(again), again)
        finally:
            asyncio.run(_post(url, "/unload_lora_adapter", {"lora_name": adapter_name(12)}))
        sync.close()
    finally:
        learner.close()
    print(f"tensor push {m}; max |learner - server| {diff:.2e}, moved {moved:.2e}; in reused memory {diff_again:.2e}")
    assert diff < TOL and moved > 50 * TOL and diff_again < TOL
    assert json.loads(urllib_get(url + "/model_info"))["weight_version"] == "12"

    run_dir = tmp_path / "run"
    cmd = _cli(url, tiny_model_path, run_dir, _plugin(tmp_path), "train.steps=3", "train.prompts_per_step=2",
               "rollout.n_samples=2", "sampling.max_new_tokens=8", "learner.lr=0.005",
               "learner.checkpoint_every=null", "learner.weight_sync=tensor")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0]
    assert all(r["learner/sync/adapter_mb"] > 0 for r in rows), rows[-1]
    assert sorted(p.name for p in (run_dir / "weights").iterdir() if not p.name.startswith(".")) == ["step-000003"]
    recs = [r for s in (1, 2, 3) for r in read_records(run_dir / "rollouts" / f"step-{s:06d}.jsonl")]
    assert all(r.error is None for r in recs) and 1 in {v for r in recs for v in r.token_versions}
    for r in recs:
        assert all(r.step - 2 <= v <= r.step - 1 for v in r.token_versions), (r.step, r.token_versions)
    assert json.loads(urllib_get(url + "/model_info"))["weight_version"] == "3"
    final = _sample(url, 3)  # the servers' adapter 3, pushed from tensors, is the run's final adapter
    model = _adapter_models(tiny_model_path, run_dir / "weights", [3], tmp_path)[3]
    worst = max(_max_abs(_hf_logprobs(model, r), r) for r in final)
    print(f"the servers' adapter 3 (from tensors) vs the final adapter's merged model: {worst:.2e}")
    assert worst < TOL
