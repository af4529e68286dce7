"""One real GRPO step end to end: real SGLang CPU server, learner process, weight push.

Afterwards the server's logprobs for a fixed sequence have changed and equal the learner's
saved weights' logprobs (computed with plain transformers); the original weights are restored
at the end so other tests see the untouched model.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch

from agentloop.config import load_config
from agentloop.records import read_records
from agentloop.train.orchestrator.loop import run_train

pytestmark = pytest.mark.sglang

FIXED = [5, 17, 99, 230, 41, 7, 88, 150, 12, 64, 301, 9]


async def _server_logprobs(url: str, ids: list[int]) -> list[float]:
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
               "return_logprob": True, "logprob_start_len": 0}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/generate", json=payload, timeout=aiohttp.ClientTimeout(total=60)) as r:
            body = await r.json()
    return [e[0] for e in body["meta_info"]["input_token_logprobs"][1:]]


async def _load(url: str, path: str) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/update_weights_from_disk", json={"model_path": path, "weight_version": "orig"},
                          timeout=aiohttp.ClientTimeout(total=120)) as r:
            assert (await r.json())["success"]


def _hf_logprobs(model_dir, ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lp.tolist()


def test_one_training_step_changes_server_weights(sglang_server, tiny_model_path, tmp_path):
    url = sglang_server.url
    plugin = tmp_path / "reward.py"
    # A reward with variance on a random model, so GRPO advantages are non-zero.
    plugin.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) > 0 and ord(solution_str[0]) % 2 == 0)\n")
    before = asyncio.run(_server_logprobs(url, FIXED))
    cfg = load_config(None, [
        f"server.urls=[\"{url}\"]", f"model.path=\"{tiny_model_path}\"", f"run_dir=\"{tmp_path / 'run'}\"",
        "train.steps=1", "train.prompts_per_step=3", "rollout.n_samples=4", "train.val_every=0",
        "sampling.max_new_tokens=8", f"reward.custom=\"{plugin}:compute_score\"", "learner.lr=0.001",
        "train.tensorboard=false"])
    try:
        run_dir, final = run_train(cfg)
        after = asyncio.run(_server_logprobs(url, FIXED))
        weights = run_dir / "weights" / "step-000001"
        assert weights.is_dir() and final["last_weights"] == str(weights)
        learner_lp = _hf_logprobs(weights, FIXED)
    finally:
        asyncio.run(_load(url, str(tiny_model_path)))
    restored = asyncio.run(_server_logprobs(url, FIXED))

    diff_before = max(abs(a - b) for a, b in zip(before, after))
    assert diff_before > 1e-3, "server weights did not change"
    assert max(abs(a - b) for a, b in zip(after, learner_lp)) < 2e-3, "server != learner after sync"
    assert max(abs(a - b) for a, b in zip(before, restored)) < 1e-4

    recs = list(read_records(run_dir / "rollouts" / "step-000001.jsonl"))
    assert len(recs) == 12 and all(r.step == 1 and r.error is None for r in recs)
    assert len({r.reward for r in recs}) == 2  # the reward had variance
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and rows[-1]["learner/actor/grad_norm"] > 0
    assert (run_dir / "curves.html").read_text().count("<svg") >= 2
    assert final["learner_exit"] == 0
    log = (run_dir / "learner.log").read_text()  # the learner's own lines reach it (not just library noise)
    assert "learner[0] INFO step 1 done: loss " in log and "exiting with code 0" in log
    assert "temperature 1" in log  # sampling.temperature, taken by the learner
