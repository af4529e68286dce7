"""Each recipe end to end on the CPU: its data preparation from the data set's own file format, then one
training step of its config with the tiny model against the real SGLang server (the learner on CPU).

Only the size is overridden (1 step, 2 prompts x 2 episodes, short responses); loop, reward, data source,
tools and the optimisation settings are the recipe's. The shared server's weights are restored afterwards.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentloop.cli import main
from agentloop.config import load_config
from agentloop.records import read_records
from agentloop.train.orchestrator.loop import run_train

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


async def _load(url: str, path: str) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/update_weights_from_disk", json={"model_path": path, "weight_version": "orig"},
                          timeout=aiohttp.ClientTimeout(total=120)) as r:
            assert (await r.json())["success"]


def _one_step(recipe: str, url: str, model: Path, tmp: Path, *extra: str):
    cfg = load_config(ROOT / "configs" / f"recipe_{recipe}.yaml", [
        f"server.urls=[\"{url}\"]", f"model.path=\"{model}\"", f"run_dir=\"{tmp / 'run'}\"",
        "train.steps=1", "train.prompts_per_step=2", "rollout.n_samples=2", "train.val_every=0",
        "sampling.max_new_tokens=12", "learner.mini_batches=1", "learner.micro_batch_tokens=8192",
        "learner.gradient_checkpointing=false", "train.tensorboard=false", *extra])
    try:
        run_dir, final = run_train(cfg)
    finally:
        asyncio.run(_load(url, str(model)))
    recs = list(read_records(run_dir / "rollouts" / "step-000001.jsonl"))
    assert final["learner_exit"] == 0 and len(recs) == 4
    assert (run_dir / "weights" / "step-000001").is_dir()
    return recs


def test_gsm8k_recipe(sglang_server, tiny_model_path, tmp_path):
    rows = [{"question": f"Tom has {n} apples and buys {n} more. How many apples does he have?",
             "answer": f"{n} + {n} = {2 * n}\n#### {2 * n}"} for n in (3, 5)]
    src = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    data = tmp_path / "gsm8k.parquet"
    assert main(["data", "prepare", "gsm8k", "--input", str(src), "--output", str(data)]) == 0
    recs = _one_step("gsm8k", sglang_server.url, tiny_model_path, tmp_path, f"data.path=\"{data}\"")
    assert all(r.error is None and r.data_source == "openai/gsm8k" and r.reward == 0.0 for r in recs)
    assert {r.ground_truth for r in recs} == {"6", "10"}


def test_countdown_recipe_raw_prompts(sglang_server, tiny_model_path, tmp_path):
    data = tmp_path / "countdown.parquet"
    assert main(["data", "prepare", "countdown", "--generate", "2", "--output", str(data)]) == 0
    recs = _one_step("countdown", sglang_server.url, tiny_model_path, tmp_path, f"data.path=\"{data}\"")
    from agentloop.models.loading import load_tokenizer_for

    tok = load_tokenizer_for(load_config(None), tiny_model_path)
    for r in recs:
        assert r.error is None and r.data_source == "countdown" and r.reward in (0.0, 0.1, 1.0)
        # TinyZero's raw prompt: no chat template around it
        text = tok.decode(r.prompt_ids)
        assert text.startswith("A conversation between User and Assistant.") and text.endswith("<think>")


def test_search_r1_recipe_with_the_retriever_service(sglang_server, tiny_model_path, tmp_path):
    src = tmp_path / "nq.jsonl"
    src.write_text("".join(json.dumps({"question": q, "golden_answers": a}) + "\n" for q, a in
                           [("what is the capital of australia", ["Canberra"]), ("who created python", ["Guido"])]))
    data = tmp_path / "nq.parquet"
    assert main(["data", "prepare", "search_r1", "--input", str(src), "--output", str(data), "--data-source", "nq"]) == 0
    corpus = ROOT / "agentloop" / "data" / "corpus_demo.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "agentloop.cli", "retriever", "serve", "--corpus", str(corpus),
                             "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "serving http://" in line, line
        url = line.rsplit(" ", 1)[-1].strip()
        recs = _one_step("search_r1", sglang_server.url, tiny_model_path, tmp_path, f"data.path=\"{data}\"",
                         f"tools.search.url=\"{url}\"", "tools.max_response_tokens=200", "learner.warmup_steps=0")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()
    assert all(r.error is None and r.data_source == "nq" and r.loop == "search_r1_agent_loop" for r in recs)
    # the random model writes no tags, so every round gets Search-R1's invalid-action text, masked out
    assert all(r.metrics["turns"] >= 2 and 0 in r.response_mask for r in recs)


def test_code_recipe(sglang_server, tiny_model_path, tmp_path):
    data = tmp_path / "code.jsonl"
    assert main(["data", "prepare", "code", "--builtin", "code", "--output", str(data)]) == 0
    recs = _one_step("code", sglang_server.url, tiny_model_path, tmp_path, f"data.path=\"{data}\"",
                     "tools.max_response_tokens=64", "tools.max_turns=2")
    assert all(r.error is None and r.data_source == "agentloop/code" for r in recs)
    assert all(r.reward is not None and r.reward_info for r in recs)  # the sandboxed grader ran and reported


def test_verls_search_tool_config_and_search_r1_rows_train_a_step(sglang_server, tiny_model_path, tmp_path):
    """verl's own multi-turn Search-R1 setup (its search_tool_config.yaml and its searchR1_* rows, verl's
    preprocess_search_r1_dataset shape) through tool_agent_loop and one training step: every row is offered
    verl's `search`, whose calls (query_list) reach the retrieval service through verl's SearchTool (our port
    of it: verl is not installed), and the rows are scored under verl's searchR1_* names."""
    from agentloop.tools import ToolCall
    from agentloop.tools.parsers import ParseResult, register_parser
    from tests.unit.data.test_prepare_check import _verl_search_r1_rows
    from tests.unit.tools.test_verl_tools import SEARCH_TOOL_CONFIG

    def always_search(text: str) -> ParseResult:  # the random model writes no tool calls: make one per turn
        return ParseResult(calls=[ToolCall(name="search", arguments={"query_list": ["capital of Australia"]})],
                           content=text)

    register_parser("test_always_search", always_search, override=True)
    data = tmp_path / "train.parquet"
    _verl_search_r1_rows(data)
    corpus = ROOT / "agentloop" / "data" / "corpus_demo.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "agentloop.cli", "retriever", "serve", "--corpus", str(corpus),
                             "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "serving http://" in line, line
        tools = tmp_path / "search_tool_config.yaml"
        tools.write_text(SEARCH_TOOL_CONFIG.format(url=line.rsplit(" ", 1)[-1].strip()))
        recs = _one_step("search_r1", sglang_server.url, tiny_model_path, tmp_path, f"data.path=\"{data}\"",
                         "rollout.loop=\"tool_agent_loop\"", f"tools.verl_tool_config=\"{tools}\"",
                         "tools.parser=\"test_always_search\"", "tools.max_turns=2",
                         "tools.max_response_tokens=400", "tools.max_tokens_per_turn=12", "learner.warmup_steps=0")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()
    assert all(r.error is None and r.data_source.startswith("searchR1_") and r.reward is not None for r in recs)
    for r in recs:
        trace = r.extra["tool_trace"]
        assert trace and trace[0]["name"] == "search" and trace[0]["status"] == "ok"
        assert trace[0]["text"].startswith('{"result": "Doc 1 (Title: \\"Canberra\\")')
