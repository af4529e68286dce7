"""Asynchronous training against the real CPU SGLang server.

- η = 0 async reproduces the synchronous schedule: the same records and the same weights after 2 steps.
- η = 2 over several steps: no trained token older than η versions, versions monotone within an
  episode, and each token's recorded logprob is what that token's version of the weights gives it
  (re-scored with the learner's saved weights of each version).
- A weight update forced mid-episode in each interrupt mode: the episode continues, is token-exact,
  and its tokens carry both versions (abort/retract tokens re-scored under their own version).
- kill -9 during an asynchronous run, then resume: every prompt trained exactly once.
The shared server gets its original weights back after each test.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agentloop.config import ManagerConfig, load_config
from agentloop.errors import RequestError
from agentloop.interrupt import interrupt_policy
from agentloop.loops.base import TrajectoryBuilder
from agentloop.records import read_records
from agentloop.server_manager import ServerManager
from agentloop.train.handle.mailbox import read_batch
from agentloop.train.orchestrator.loop import run_train
from tests.integration.test_train_real import FIXED, _load, _server_logprobs

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
          "    return float(len(solution_str) > 0 and ord(solution_str[0]) % 2 == 0)\n")


def _cfg(url, model, run_dir, plugin, *extra):
    return load_config(None, [
        f"server.urls=[\"{url}\"]", f"model.path=\"{model}\"", f"run_dir=\"{run_dir}\"", "train.val_every=0",
        "rollout.loop=single_turn_agent_loop", "sampling.max_new_tokens=8", "learner.lr=0.001",
        f"reward.custom=\"{plugin}:compute_score\"", "train.tensorboard=false", "learner.checkpoint_every=null",
        "learner.keep_weights=10", *extra])


def _by_episode(run_dir: Path, step: int) -> dict:
    return {r.episode_id: r for r in read_records(run_dir / "rollouts" / f"step-{step:06d}.jsonl")}


def _safetensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _hf_token_logprobs(model_dir, ids: list[int], start: int) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= start, under the HF weights in `model_dir`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lp[start - 1:].tolist()


@pytest.fixture
def restore(sglang_server, tiny_model_path):
    yield
    asyncio.run(_load(sglang_server.url, str(tiny_model_path)))


def test_eta0_async_equals_the_synchronous_schedule(sglang_server, tiny_model_path, tmp_path, restore):
    url, plugin = sglang_server.url, tmp_path / "reward.py"
    plugin.write_text(REWARD)
    # The server's logprobs of the same tokens differ run to run by up to ~1e-4 (CPU batching), and with
    # tis_cap on they weight the loss: Adam turns that into O(lr) flips on weights whose gradient
    # terms cancel (CI saw it). Without the importance weight the loss reads only the token ids, so the
    # weights must match exactly.
    common = ["train.steps=2", "train.prompts_per_step=3", "rollout.n_samples=2", "algo.tis_cap=null"]
    runs = {}
    for schedule in ("sync", "async"):
        run_dir = tmp_path / schedule
        runs[schedule], _ = run_train(_cfg(url, tiny_model_path, run_dir, plugin, *common,
                                           f"train.schedule={schedule}", "train.max_staleness=0"))
        asyncio.run(_load(url, str(tiny_model_path)))
    for step in (1, 2):
        a, b = _by_episode(runs["sync"], step), _by_episode(runs["async"], step)
        assert sorted(a) == sorted(b) and len(a) == 6, f"step {step}: different episodes"
        for k in a:
            ra, rb = a[k], b[k]
            assert (ra.prompt_ids, ra.response_ids, ra.reward, ra.seed, ra.uid) == \
                (rb.prompt_ids, rb.response_ids, rb.reward, rb.seed, rb.uid), f"step {step} {k}"
            assert ra.token_versions == rb.token_versions == [step - 1] * len(ra.response_ids)
            assert max(abs(x - y) for x, y in zip(ra.response_logprobs, rb.response_logprobs)) < 1e-4
    wa, wb = _safetensors(runs["sync"] / "weights" / "step-000002"), _safetensors(runs["async"] / "weights" / "step-000002")
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=1e-6, msg=name)
    w0 = _safetensors(tiny_model_path)
    assert max((wa[n].float() - w0[n].float()).abs().max().item() for n in wa if n in w0) > 1e-4, "no update"


def test_eta0_resumed_async_trains_the_batches_of_a_resumed_sync_run(sglang_server, tiny_model_path, tmp_path,
                                                                    restore):
    """A run stopped after checkpoint 2 of 4, resumed once with each schedule at η = 0: the async run must
    admit B prompts per version again (before the fix it counted from zero against version 2, admitted the
    rest of the run at once and cancelled stale groups, whose prompts came back with other seeds), so both
    train the same records at steps 3 and 4 and end with the same weights."""
    url, plugin = sglang_server.url, tmp_path / "reward.py"
    plugin.write_text(REWARD)
    common = ["train.steps=4", "train.prompts_per_step=2", "rollout.n_samples=2", "algo.tis_cap=null",
              "learner.checkpoint_every=2", "train.max_staleness=0"]
    base = tmp_path / "base"
    run_train(_cfg(url, tiny_model_path, base, plugin, *common, "train.schedule=sync"))
    asyncio.run(_load(url, str(tiny_model_path)))
    # as if killed right after checkpoint 2: nothing of steps 3 and 4 is left
    for s in (3, 4):
        shutil.rmtree(base / "mailbox" / f"step-{s:06d}")
        shutil.rmtree(base / "weights" / f"step-{s:06d}")
    shutil.rmtree(base / "checkpoints" / "step-000004")
    for s in (3, 4):
        (base / "rollouts" / f"step-{s:06d}.jsonl").unlink()
    runs = {}
    for schedule in ("sync", "async"):
        shutil.copytree(base, tmp_path / schedule)
        runs[schedule], final = run_train(_cfg(url, tiny_model_path, tmp_path / schedule, plugin, *common,
                                               f"train.schedule={schedule}"))
        asyncio.run(_load(url, str(tiny_model_path)))
        assert "ready for step 3 (resumed from checkpoint" in (runs[schedule] / "learner.log").read_text()
        rows = [json.loads(ln) for ln in (runs[schedule] / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1.0, 2.0, 3.0, 4.0], schedule
    assert final["async"].get("groups_cancelled", 0) == 0
    for step in (3, 4):
        a, b = _by_episode(runs["sync"], step), _by_episode(runs["async"], step)
        assert sorted(a) == sorted(b) and len(a) == 4, f"step {step}: different episodes {sorted(a)} {sorted(b)}"
        for k in a:
            ra, rb = a[k], b[k]
            assert (ra.prompt_ids, ra.response_ids, ra.seed, ra.uid) == \
                (rb.prompt_ids, rb.response_ids, rb.seed, rb.uid), f"step {step} {k}"
            assert ra.token_versions == rb.token_versions == [step - 1] * len(ra.response_ids)
        assert {r.uid for r in a.values()} == {2 * (step - 1), 2 * (step - 1) + 1}  # positions 4..7, in order
    wa, wb = (_safetensors(runs[s] / "weights" / "step-000004") for s in ("sync", "async"))
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=1e-6, msg=name)


def test_eta2_bounds_versions_and_rescoring(sglang_server, tiny_model_path, tmp_path, restore):
    url, plugin = sglang_server.url, tmp_path / "reward.py"
    plugin.write_text(REWARD)
    run_dir, final = run_train(_cfg(url, tiny_model_path, tmp_path / "run", plugin, "train.steps=4",
                                    "train.prompts_per_step=2", "rollout.n_samples=2", "train.schedule=async",
                                    "train.max_staleness=2"))
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    lags = set()
    weights = {0: tiny_model_path, **{v: run_dir / "weights" / f"step-{v:06d}" for v in (1, 2, 3)}}
    for step in range(1, 5):
        recs = list(_by_episode(run_dir, step).values())
        assert len(recs) == 4 and rows[step - 1]["versions/violations"] == 0
        for r in recs:
            vs = [v for v, m in zip(r.token_versions, r.response_mask) if m]
            assert vs and all(step - 1 - 2 <= v <= step - 1 for v in vs), (step, vs)
            assert vs == sorted(vs)  # monotone within the episode
            lags.update(step - 1 - v for v in vs)
        # re-score each token under the version recorded for it
        for r in recs[:2]:
            v = r.token_versions[0]
            lp = _hf_token_logprobs(weights[v], r.prompt_ids + r.response_ids, len(r.prompt_ids))
            assert max(abs(a - b) for a, b in zip(lp, r.response_logprobs)) < 2e-3, (step, v)
    assert max(lags) >= 1, "the run never trained on an older version: nothing was asynchronous"
    assert final["async"]["groups_left_at_end"] >= 0 and rows[-1]["staleness/lag_max"] <= 2


class TwoTurn:
    """A 2-turn token-only episode through a ServerManager (turn 1 complete, turn 2 long)."""

    def __init__(self, sm: ServerManager, prompt: list[int]):
        self.sm, self.prompt = sm, prompt
        self.turn2_sent = asyncio.Event()

    async def run(self) -> TrajectoryBuilder:
        traj = TrajectoryBuilder(self.prompt)
        sp = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
        traj.add_model(await self.sm.generate("ep-0", prompt_ids=traj.all_ids, sampling_params=sp))
        traj.add_env([7, 8])
        self.turn2_sent.set()
        sp2 = {**sp, "max_new_tokens": 600}
        traj.add_model(await self.sm.generate("ep-0", prompt_ids=traj.all_ids, sampling_params=sp2))
        return traj


def _refuse_first_flush(post):
    """Wrap ManagerState.admin_post so the first /flush_cache is refused as SGLang 0.5.17 refuses it."""
    refused = []

    async def wrapped(url, path, payload, timeout=None):
        if path == "/flush_cache" and not refused:
            refused.append(url)
            raise RequestError(f"{url}/flush_cache answered HTTP 400: Cache not flushed (injected)", server=url,
                               status=400)
        return await post(url, path, payload, timeout)

    return wrapped


def _scaled_copy(tiny_model_path, out: Path, factor: float = 1.05) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)
    model.save_pretrained(str(out))
    return out


@pytest.mark.parametrize("mode,refused_flush", [("abort", False), ("retract", False), ("retract", True),
                                                ("in_place", False)])
def test_update_forced_mid_episode(sglang_server, tiny_model_path, tmp_path, restore, mode, refused_flush):
    """Each mode through the trainer's sequence (agentloop.interrupt): pause, update with the mode's flush,
    finish_update, resume. retract with the flush refused (as on 0.5.17): the retracted call is aborted while
    paused, answers with its partial tokens and continues under the new weights, still token-exact."""
    url = sglang_server.url
    v1 = _scaled_copy(tiny_model_path, tmp_path / "v1")

    async def main():
        policy = interrupt_policy(mode)
        async with ServerManager([url], ManagerConfig(health_interval_s=60), initial_version=0,
                                 cache_salt=policy.cache_salt) as sm:
            if refused_flush:  # play SGLang 0.5.17, which refuses to flush with retracted requests waiting
                sm.state.admin_post = _refuse_first_flush(sm.state.admin_post)
            ep = TwoTurn(sm, FIXED)
            task = asyncio.create_task(ep.run())
            await ep.turn2_sent.wait()
            await sm.pause(policy.pause_mode)
            await sm.update_weights_from_disk(str(v1), weight_version=1, flush_cache=policy.flush_in_update)
            await sm.finish_update(policy)
            await sm.resume()
            return (await task).build(), sm.gauges()

    out, g = asyncio.run(asyncio.wait_for(main(), 300))
    vs = [v for v, m in zip(out.token_versions, out.response_mask) if m]
    assert len(out.response_ids) == 6 + 2 + 600 and out.response_mask == [1] * 6 + [0, 0] + [1] * 600
    assert vs[:6] == [0] * 6 and vs == sorted(vs) and vs[-1] == 1, "tokens must carry both versions"
    if mode == "abort":
        assert g["server/interrupted_calls"] >= 0  # a call still queued at the pause is continued whole
    assert g["server/flushes_refused"] == float(refused_flush)
    if refused_flush:
        assert g["server/interrupted_calls"] == 1 and g["server/continued_calls"] == 1
    if mode != "in_place":  # in_place keeps KV of the old weights: its new tokens are not re-scorable
        ids = out.prompt_ids + out.response_ids
        start = len(out.prompt_ids)
        for version, weights in ((0, tiny_model_path), (1, v1)):
            lp = _hf_token_logprobs(weights, ids, start)
            mine = [(a, b) for a, b, m, v in zip(lp, out.response_logprobs, out.response_mask, out.token_versions)
                    if m and v == version]
            assert mine and max(abs(a - b) for a, b in mine) < 2e-3, (mode, version)


def test_in_place_never_reuses_a_prefix_cached_under_older_weights(sglang_server, tiny_model_path, tmp_path,
                                                                      restore):
    """in_place keeps the cache (no flush), so the per-version cache key is what keeps KV of version v out of
    version v+1: the same prompt after the push has no cached tokens (and is cached again within v+1), and
    its tokens carry v+1. Without the key (cache_salt off) the v+1 request reuses v's prefix."""
    url = sglang_server.url
    v1 = _scaled_copy(tiny_model_path, tmp_path / "v1")
    prompt = [(7 * i + 3) % 500 + 10 for i in range(96)]  # long enough to span several cache pages
    sp = {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 1}

    async def main(salt: bool):
        policy = interrupt_policy("in_place")
        async with ServerManager([url], ManagerConfig(health_interval_s=60), initial_version=0,
                                 cache_salt=salt and policy.cache_salt) as sm:
            await sm.flush_cache()
            await sm.generate("a", prompt_ids=prompt, sampling_params=sp)
            v0_again = await sm.generate("b", prompt_ids=prompt, sampling_params=sp)
            await sm.pause(policy.pause_mode)
            await sm.update_weights_from_disk(str(v1), weight_version=1, flush_cache=policy.flush_in_update)
            await sm.finish_update(policy)
            sm.expect_version(1)
            await sm.resume()
            first_v1 = await sm.generate("c", prompt_ids=prompt, sampling_params=sp)
            v1_again = await sm.generate("d", prompt_ids=prompt, sampling_params=sp)
            await _load(url, str(tiny_model_path))
            return v0_again, first_v1, v1_again

    v0_again, first_v1, v1_again = asyncio.run(asyncio.wait_for(main(salt=True), 300))
    assert v0_again.cached_tokens >= 64, "the prefix cache must work within a version"
    assert first_v1.cached_tokens == 0, "a version-1 request reused a prefix cached under version 0"
    assert first_v1.token_versions == [1] * 4
    assert v1_again.cached_tokens >= 64, "and it is reused again within version 1"
    _, unsalted, _ = asyncio.run(asyncio.wait_for(main(salt=False), 300))
    assert unsalted.cached_tokens >= 64, "without the key the stale prefix is reused (what the key prevents)"


@pytest.mark.timeout(900)
def test_async_killed_and_resumed_trains_every_prompt_once(sglang_server, tiny_model_path, tmp_path, restore):
    url, plugin = sglang_server.url, tmp_path / "reward.py"
    plugin.write_text(REWARD)
    run_dir = tmp_path / "run"
    steps, B = 5, 2
    cmd = [sys.executable, "-m", "agentloop.cli", "train", "--quiet", "--server-url", url,
           "--model", str(tiny_model_path), "--loop", "single_turn_agent_loop", "--run-dir", str(run_dir),
           f"train.steps={steps}", f"train.prompts_per_step={B}", "rollout.n_samples=2", "train.val_every=0",
           "sampling.max_new_tokens=6", "learner.lr=0.001", "reward.custom=" + json.dumps(f"{plugin}:compute_score"),
           "learner.checkpoint_every=2", "train.tensorboard=false", "train.schedule=async", "train.max_staleness=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log1, log2 = tmp_path / "run1.log", tmp_path / "run2.log"
    procs = []
    try:
        with log1.open("wb") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        procs.append(p)
        deadline = time.monotonic() + 400
        # kill once step 3's batch is submitted (checkpoint 2 exists; groups of later steps in flight)
        while not (run_dir / "mailbox" / "step-000003" / "batch.ready").exists():
            assert p.poll() is None, log1.read_text()[-3000:]
            assert time.monotonic() < deadline, log1.read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
        with log2.open("wb") as log:
            p2 = subprocess.Popen(cmd + ["train.resume=true"], stdout=log, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
        procs.append(p2)
        assert p2.wait(500) == 0, log2.read_text()[-3000:]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert "resumed at step" in log2.read_text()
    trained: dict[int, int] = {}
    for step in range(1, steps + 1):
        uids = set(read_batch(run_dir, step).uid.tolist())
        assert len(uids) == B, (step, uids)
        for u in uids:
            assert u not in trained, f"prompt {u} trained at steps {trained[u]} and {step}"
            trained[u] = step
    summary = json.loads((run_dir / "train_summary.json").read_text())
    # every position below the highest trained one was trained, or was still in flight when the run ended
    missing = set(range(max(trained) + 1)) - set(trained)
    assert len(missing) <= summary["async"]["groups_left_at_end"], (sorted(trained), summary["async"])
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [float(s) for s in range(1, steps + 1)]
    assert len(asyncio.run(_server_logprobs(url, FIXED))) == len(FIXED) - 1
