"""The environment-library adapters against the real CPU SGLang server serving the warm-started calculator model:
an OpenEnv server (examples/envs/openenv_calculator.py), a TextArena game against a fixed opponent, a verifiers
ToolEnv (examples/envs/verifiers_calculator.py, in its own virtualenv). Each: no error records, every model token's
recorded logprob what the server gives it re-reading the record (token exact, as through the gateway), environment
tokens masked (logprob 0), the conversation's chat template what the model read, and the reward the environment's
own verdict on the episode.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from agentloop.config import ManagerConfig, load_config
from agentloop.data import rows_to_samples
from agentloop.envs_config import OpenEnvConfig, TextArenaEnvConfig, VerifiersEnvConfig
from agentloop.loops import get_agent_loop
from agentloop.loops.openenv_env import openenv_rows
from agentloop.loops.textarena_env import textarena_rows
from agentloop.loops.verifiers_env import export_rows, setup_venv
from agentloop.models.loading import load_tokenizer_for
from agentloop.rollout.engine import RolloutEngine
from agentloop.server_manager import ServerManager
from agentloop.tools import ToolsConfig, get_tool
from tests.integration.test_gateway_real import TOL, rescore, warm  # noqa: F401 - the fixture
from tests.unit.loops.test_openenv_loop import free_port, start_servers, wait_healthy

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = ("You are a careful assistant. Use the calculator tool for arithmetic. "
          "Finish with the final answer on its own line as `#### <number>`.")
ANSWER = re.compile(r"####[\s*$]*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)")


def run(url: str, model: Path, rows: list[dict], n: int, *overrides: str):
    cfg = load_config(None, [f"server.urls=[\"{url}\"]", f"model.path=\"{model}\"", "sampling.max_new_tokens=48",
                             "rollout.progress_interval_s=100", *overrides])

    async def main():
        async with ServerManager([url], ManagerConfig(health_interval_s=60)) as sm:
            tok = load_tokenizer_for(cfg, model)
            engine = RolloutEngine(cfg, sm, tok, get_agent_loop(cfg.rollout.loop), progress=False)
            return (await engine.run(rows_to_samples(rows), n_samples=n)).records, tok

    return asyncio.run(asyncio.wait_for(main(), 600))


def right_answer(text: str, question: str) -> float:
    found = ANSWER.findall(text)
    return 1.0 if found and float(found[-1]) == eval(question.removeprefix("What is ").removesuffix("?")) else 0.0


def check(records, tok, tools: list[dict] | None, url: str) -> None:
    assert records and [r.error for r in records if r.error] == []
    worst = rescore(url, records)
    print(f"\n{records[0].loop}: {len(records)} records, max |recorded - re-scored| logprob {worst:.2e}, "
          f"{sum(r.response_mask.count(0) for r in records)} environment tokens (mask 0)")
    assert worst <= TOL
    for r in records:
        for m, lp in zip(r.response_mask, r.response_logprobs):
            assert (lp == 0.0) if m == 0 else (lp <= 0.0)
        rendered = tok.apply_chat_template(r.extra["messages"], tools=tools, tokenize=False, add_generation_prompt=False)
        full = tok.decode(r.prompt_ids + r.response_ids, skip_special_tokens=False)
        assert rendered.startswith(full.removesuffix("<|im_end|>")), (rendered, full)


def test_openenv_server_episodes_are_token_exact(warm, tmp_path):  # noqa: F811 - the fixture
    url, model = warm
    urls, procs = start_servers(tmp_path)
    try:
        wait_healthy(urls["calculator"], procs[1])
        cfg = OpenEnvConfig(url=urls["calculator"], episodes=4, system_prompt=SYSTEM)
        records, tok = run(url, model, openenv_rows(cfg), 2, "rollout.loop=openenv_loop",
                           f"envs.openenv.url=\"{urls['calculator']}\"", "envs.openenv.observation_role=tool",
                           "envs.openenv.tools=[calculator]", "envs.openenv.max_turns=3")
    finally:
        for p in procs:
            p.terminate()
            p.wait(20)
            p.stdout.close()
    check(records, tok, [get_tool("calculator")(ToolsConfig()).schema], url)
    for r in records:  # the server's reward: 1 for the right `####` answer, else 0
        msgs = r.extra["messages"]
        question = next(m["content"] for m in msgs if m["role"] == "user")
        last = msgs[-1]["content"] if msgs[-1]["role"] == "assistant" else ""
        if r.finish_reason == "stop":
            assert r.reward == right_answer(last, question)
    assert any(0 in r.response_mask for r in records), "no episode called the calculator"


def test_textarena_game_against_a_fixed_opponent_is_token_exact(warm):  # noqa: F811 - the fixture
    url, model = warm
    cfg = TextArenaEnvConfig(env_id="TicTacToe-v0", num_players=2, episodes=3)
    records, tok = run(url, model, textarena_rows(cfg), 2, "rollout.loop=textarena_loop",
                       "envs.textarena.env_id=TicTacToe-v0", "envs.textarena.num_players=2",
                       "envs.textarena.max_turns=5")
    check(records, tok, None, url)
    for r in records:
        assert r.reward in (-1.0, 0.0, 1.0) and "Tic Tac Toe" in r.extra["messages"][0]["content"]
        assert r.metrics["env_reward"] == r.reward


@pytest.fixture(scope="module")
def vf_python() -> str:
    return str(setup_venv() / "bin" / "python")


def test_verifiers_tool_env_is_token_exact_and_scored_by_its_rubric(warm, vf_python, tmp_path):  # noqa: F811 - the fixture
    url, model = warm
    env = str(ROOT / "examples" / "envs" / "verifiers_calculator.py")
    args = {"num_train_examples": 4, "num_eval_examples": 1}
    rows_file = export_rows(VerifiersEnvConfig(env=env, args=args, python=vf_python), "train", tmp_path / "rows.jsonl")
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    records, tok = run(url, model, rows, 2, "rollout.loop=verifiers_loop", f"envs.verifiers.env=\"{env}\"",
                       "envs.verifiers.args=" + json.dumps(args), f"envs.verifiers.python=\"{vf_python}\"",
                       "agent.max_tokens_per_call=48")
    check(records, tok, [get_tool("calculator")(ToolsConfig()).schema], url)
    for r in records:  # the rubric's reward is its verdict on the last assistant message
        question = next(m["content"] for m in r.extra["messages"] if m["role"] == "user")
        assert r.reward == right_answer(r.extra["solution_str"], question)
        assert r.extra["agent_result"]["metrics"]["correct_answer"] == r.reward


def test_an_openenv_server_that_is_down_fails_episodes_not_the_run(warm):  # noqa: F811 - the fixture
    url, model = warm
    dead = f"http://127.0.0.1:{free_port()}"
    records, _ = run(url, model, openenv_rows(OpenEnvConfig(url=dead, episodes=2)), 2, "rollout.loop=openenv_loop",
                     f"envs.openenv.url=\"{dead}\"")
    assert len(records) == 4 and all(r.error.startswith("EnvError: OpenEnv server") and "unreachable" in r.error
                                     for r in records)
