"""LoRA on a real CPU SGLang server (--enable-lora, torch-native LoRA kernels): the learner's adapter, loaded as an
adapter, gives sampled tokens the learner's logprobs (the full-weight tolerance); version 0 (no adapter) is the
base model, which the zero-initialised learner equals; and `agentloop train` with learner.lora runs end to end,
every token stamped with the adapter version that produced it, the run's records matching that adapter's
merged model."""

from __future__ import annotations

import asyncio
import json

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
    models = {v: _model(tiny_model_path if v == 0 else merge_adapter_dir(
        tiny_model_path, weights / f"step-{v:06d}", tmp_path / f"merged-{v}")) for v in (0, 1, 2)}
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
    # KNOWN GAP (issue 32): in this run the adapters' tokens match their merged model to ~2e-3, not the 1e-4 of
    # the direct comparison above (the base's tokens do match to 1e-6); the cause is not found yet
    print(f"token versions seen: {sorted(seen)}; max |merged model - server| per version: {worst}")
    assert worst[0] < TOL
    assert 1 in seen
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
