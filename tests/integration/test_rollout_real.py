"""The rollout engine against a real SGLang server (CPU engine) with the project's tiny model."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentloop import ServerManager
from agentloop.config import SamplingParams, load_config
from agentloop.errors import FatalRequestError
from agentloop.models.loading import load_tokenizer_for
from agentloop.records import read_records
from agentloop.rollout.run import run_rollout

pytestmark = pytest.mark.sglang


def _cfg(url: str, tmp_path: Path, *extra: str):
    return load_config(None, [f"server.urls=[\"{url}\"]", f"run_dir=\"{tmp_path / 'run'}\"",
                              "rollout.progress_interval_s=100", *extra])


def test_generate_is_token_in_token_out(sglang_server, tiny_model_path):
    async def main():
        async with ServerManager([sglang_server.url]) as sm:
            sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=123)
            a = await sm.generate("e1", prompt_ids=[5, 6, 7, 8, 9], sampling_params=sp)
            b = await sm.generate("e2", prompt_ids=[5, 6, 7, 8, 9], sampling_params=sp)
            c = await sm.generate("e3", prompt_ids=[5, 6, 7, 8, 9],
                                  sampling_params=sp.model_copy(update={"seed": 124}))
            return a, b, c, sm.gauges()

    a, b, c, g = asyncio.run(main())
    assert 1 <= len(a.token_ids) <= 12 and len(a.logprobs) == len(a.token_ids)
    assert all(lp <= 0.0 for lp in a.logprobs)
    assert a.finish_reason in ("stop", "length")
    assert a.prompt_tokens == 5
    # reproducible: the same seed gives the same tokens; another seed (almost surely) differs
    assert a.token_ids == b.token_ids
    assert c.token_ids != a.token_ids
    assert b.cached_tokens > 0 and g["server/prefix_cache_hit_rate"] > 0


def test_single_turn_rollout_records(sglang_server, tiny_model_path, tmp_path):
    cfg = _cfg(sglang_server.url, tmp_path, "data.max_samples=6", "rollout.n_samples=3",
               "sampling.max_new_tokens=16")
    run_dir, result = run_rollout(cfg, progress=False)
    recs = list(read_records(run_dir / "records.jsonl"))
    assert len(recs) == 18 and not [r for r in recs if r.error]
    assert {(r.index, r.repeat) for r in recs} == {(i, k) for i in range(6) for k in range(3)}
    tok = load_tokenizer_for(cfg, tiny_model_path)
    for r in recs:
        assert r.response_mask == [1] * len(r.response_ids)
        assert r.reward is not None and r.data_source == "agentloop/arithmetic"
        assert r.loop == "single_turn_agent_loop" and r.weight_versions and r.num_turns == 1
        # the prompt is the chat template of the row's messages, templated once
        assert tok.decode(r.prompt_ids).endswith("<|im_start|>assistant\n")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["episodes"] == 18 and "pass@1" in summary and "pass@3" in summary
    assert summary["tokens_per_s"] > 0 and "loop/lag_p99_ms" in summary
    assert (run_dir / "config.yaml").is_file()
    versions = json.loads((run_dir / "versions.json").read_text())
    assert versions["sglang"] and versions["torch"] and versions["agentloop"]


def test_rollouts_are_reproducible(sglang_server, tiny_model_path, tmp_path):
    def once(sub):
        cfg = _cfg(sglang_server.url, tmp_path / sub, "data.max_samples=4", "rollout.n_samples=2",
                   "sampling.max_new_tokens=10", "rollout.seed=7")
        _, result = run_rollout(cfg, progress=False)
        return {r.episode_id: r.response_ids for r in result.records}

    first, second = once("a"), once("b")
    assert first == second
    assert len({tuple(v) for v in first.values()}) > 1  # repeats of a prompt differ


def test_prompt_longer_than_context_is_an_episode_error(sglang_server, tiny_model_path, tmp_path):
    cfg = _cfg(sglang_server.url, tmp_path, "model.context_length=32", "data.max_samples=2", "rollout.n_samples=1")
    run_dir, result = run_rollout(cfg, progress=False)
    assert len(result.records) == 2
    assert all(r.error and r.error.startswith("PromptTooLongError") for r in result.records)
    assert result.summary["errors"] == 2 and result.stopped is None


def test_server_rejects_overlong_prompt_without_retry(sglang_server):
    async def main():
        async with ServerManager([sglang_server.url]) as sm:
            with pytest.raises(FatalRequestError):
                await sm.generate("e", prompt_ids=[5] * 100_000, sampling_params=SamplingParams(max_new_tokens=4))
            return sm.gauges()

    g = asyncio.run(main())
    assert g["server/retries"] == 0


def test_custom_loop_and_reward_plugins(sglang_server, tiny_model_path, tmp_path):
    plugin = tmp_path / "plug.py"
    plugin.write_text(
        "from agentloop import AgentLoopBase, register_agent_loop\n"
        "from agentloop.loops import TrajectoryBuilder\n"
        "@register_agent_loop('twice_loop', override=True)\n"
        "class Twice(AgentLoopBase):\n"
        "    async def run(self, sample, sampling_params):\n"
        "        ids = self.apply_chat_template(sample.messages)\n"
        "        t = TrajectoryBuilder(ids)\n"
        "        for turn in range(2):\n"
        "            t.add_model(await self.generate(sample.episode_id, t.all_ids, self.turn_params(sampling_params, turn),"
        " max_new_tokens=4))\n"
        "        return t.build()\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 0.25, 'length': len(solution_str)}\n")
    cfg = _cfg(sglang_server.url, tmp_path, f"plugins=[\"{plugin}\"]", "rollout.loop=twice_loop",
               f"reward.custom=\"{plugin}:compute_score\"", "data.max_samples=3", "rollout.n_samples=1")
    _, result = run_rollout(cfg, progress=False)
    assert [r.error for r in result.records] == [None] * 3
    assert all(r.num_turns == 2 and r.reward == 0.25 and "length" in r.reward_info for r in result.records)


def test_cli_rollout_against_running_server(sglang_server, tiny_model_path, tmp_path):
    # --random-model: the plumbing run (random tiny model, single turn, arithmetic set), one flag away
    run_dir = tmp_path / "cli-run"
    proc = subprocess.run(
        [sys.executable, "-m", "agentloop.cli", "rollout", "--random-model", "--server-url", sglang_server.url,
         "--run-dir", str(run_dir), "-n", "2", "data.max_samples=4", "sampling.max_new_tokens=8"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mean_reward" in proc.stdout and "pass@2" in proc.stdout
    assert "episodes" in proc.stderr  # progress line
    recs = list(read_records(run_dir / "records.jsonl"))
    assert len(recs) == 8 and {r.loop for r in recs} == {"single_turn_agent_loop"}
    assert {r.data_source for r in recs} == {"agentloop/arithmetic"}


async def _load_weights(url: str, path: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/update_weights_from_disk", json={"model_path": path, "weight_version": "x"},
                          timeout=aiohttp.ClientTimeout(total=120)) as r:
            assert (await r.json())["success"]


def test_cli_main_job_shows_tool_use_with_a_meaningful_reward(sglang_server, tiny_model_path, tmp_path):
    """The no-flag `agentloop rollout`: the warm-started model calls the calculator and is scored by it."""
    from agentloop.models.warmstart import ensure_warm_model

    run_dir = tmp_path / "main-job"
    asyncio.run(_load_weights(sglang_server.url, str(ensure_warm_model())))  # the server now serves the warm model
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "agentloop.cli", "rollout", "--server-url", sglang_server.url,
             "--run-dir", str(run_dir), "data.max_samples=16", "-n", "2"],
            capture_output=True, text=True, timeout=300)
    finally:
        asyncio.run(_load_weights(sglang_server.url, str(tiny_model_path)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = list(read_records(run_dir / "records.jsonl"))
    assert len(recs) == 32 and not [r for r in recs if r.error]
    assert {r.loop for r in recs} == {"tool_agent_loop"} and {r.data_source for r in recs} == {"agentloop/calculator"}
    called = [r for r in recs if r.metrics.get("tool_calls", 0) > 0]
    assert len(called) >= 4  # about half call the tool at temperature 1
    assert all(r.num_turns >= 2 and 0 in r.response_mask for r in called)  # multi-turn, tool tokens masked
    assert sum(r.reward for r in called) / len(called) > 0.5  # and answer right when they do
    assert (run_dir / "traces.html").read_text().count("tool calls of turn") >= 1


def test_cli_bad_config_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "agentloop.cli", "rollout", "rollout.n_sample=3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "rollout.n_sample: unknown key" in proc.stderr
