"""The text each reward sees: verl's (response, special tokens skipped), TinyZero's / Search-R1's (prompt +
response, special tokens kept), ours (the loop's text); verl custom reward files unchanged."""

from __future__ import annotations

import asyncio

import pytest

from agentloop.config import load_config
from agentloop.records import AgentLoopOutput, Sample
from agentloop.rollout.scorer import Scorer
from tests.unit.loops.test_tool_loop import get_tokenizer

ONE_WORKER = "reward.workers=1"
"""Every reward here still runs in a worker process, as in a run; one, not the default four, starts for each
event loop (four starting at once on a 2-core box took 10-18 s of each test)."""


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer("modelzoo")


def _episode(tok, prompt: str, response: str) -> AgentLoopOutput:
    p = list(tok.encode(prompt, add_special_tokens=False))
    r = list(tok.encode(response, add_special_tokens=False))
    return AgentLoopOutput(prompt_ids=p, response_ids=r, response_mask=[1] * len(r), response_logprobs=[0.0] * len(r),
                           extra={"response_text": "LOOP TEXT"})


def _sample(ds: str, gt) -> Sample:
    return Sample(index=0, data_source=ds, messages=[{"role": "user", "content": "q"}], ground_truth=gt)


def test_each_name_gets_its_frameworks_text(tok):
    scorer = Scorer(load_config(None, [ONE_WORKER]))
    prompt = "<|im_start|>user\nUsing [2, 3, 4] make 24.\nAssistant: Let me solve this step by step.<|im_end|>\n"
    out = _episode(tok, prompt, " ok </think><answer>2*3*4</answer><|im_end|>")
    verl = scorer.solution_text(_sample("openai/gsm8k", "24"), out, tok)
    tz = scorer.solution_text(_sample("countdown", {"target": 24, "numbers": [2, 3, 4]}), out, tok)
    ours = scorer.solution_text(_sample("agentloop/gsm8k", "24"), out, tok)
    assert verl == " ok </think><answer>2*3*4</answer>"  # response only, <|im_end|> skipped
    assert tz == prompt + " ok </think><answer>2*3*4</answer><|im_end|>"
    assert ours == "LOOP TEXT"
    score, _ = asyncio.run(scorer.score(_sample("countdown", {"target": 24, "numbers": [2, 3, 4]}), tz))
    assert score == 1.0  # TinyZero's rule finds "Assistant:" in the prompt, the answer on the last line
    # a loop that names its solution text is scored on it, whatever the view
    out.extra["solution_str"] = "#### 24"
    assert scorer.solution_text(_sample("openai/gsm8k", "24"), out, tok) == "#### 24"


def test_verl_custom_reward_file_works_unchanged(tmp_path, tok):
    # A verl custom reward file as verl users write it: keyword call, dict return with "score".
    f = tmp_path / "my_reward.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    ok = solution_str.strip().endswith(ground_truth)\n"
                 "    return {'score': 1.0 if ok else 0.0, 'acc': ok, 'seen': solution_str}\n")
    scorer = Scorer(load_config(None, [f"reward.custom={f}:compute_score", ONE_WORKER]))
    out = _episode(tok, "<|im_start|>user\nq<|im_end|>\n", "the answer is 42<|im_end|>")
    s = _sample("anything/verl", "42")
    text = scorer.solution_text(s, out, tok)
    assert text == "the answer is 42"  # what verl's reward manager passes: no special tokens
    score, info = asyncio.run(scorer.score(s, text))
    assert score == 1.0 and info == {"acc": True, "seen": "the answer is 42"}
    tz = Scorer(load_config(None, [f"reward.custom={f}:compute_score", "reward.custom_view=prompt_response",
                                   ONE_WORKER]))
    assert tz.solution_text(s, out, tok).startswith("<|im_start|>user\nq")


VERL_EXTRA_READER = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    # what verl reward files read from the extra_info verl's reward manager builds\n"
    "    return {'score': float(extra_info['num_turns']), 'tool_rewards': sum(extra_info['tool_rewards']),\n"
    "            'n_tool_rewards': len(extra_info['tool_rewards']), 'turn_scores': len(extra_info['turn_scores']),\n"
    "            'rollout_reward_scores': len(extra_info['rollout_reward_scores']), 'split': extra_info['split']}\n")


def test_a_verl_reward_reading_verls_extra_info_keys_gets_them(tmp_path, tok):
    """verl's reward managers add num_turns and rollout_reward_scores to the row's extra_info, and its tool
    agent loop's tool_rewards / turn_scores; a verl reward reading them must not raise KeyError here."""
    from agentloop.rollout.scorer import reward_extra_info

    f = tmp_path / "reader.py"
    f.write_text(VERL_EXTRA_READER)
    scorer = Scorer(load_config(None, [f"reward.custom={f}:compute_score", ONE_WORKER]))
    s = Sample(index=0, data_source="x", messages=[{"role": "user", "content": "q"}], ground_truth="1",
               extra_info={"split": "train", "index": 3})
    single = _episode(tok, "<|im_start|>user\nq<|im_end|>\n", "1<|im_end|>")
    score, info = asyncio.run(scorer.score(s, "1", reward_extra_info(s, single)))
    assert score == 2.0  # verl's single-turn count: the prompt and one answer
    assert info == {"tool_rewards": 0.0, "n_tool_rewards": 0, "turn_scores": 0, "rollout_reward_scores": 0,
                    "split": "train"}
    # two assistant turns around one tool round, two calls with step rewards 1.0 and -0.05
    multi = AgentLoopOutput(prompt_ids=[1], response_ids=[5, 6, 7, 8, 9], response_mask=[1, 1, 0, 0, 1],
                            response_logprobs=[-0.1, -0.1, 0.0, 0.0, -0.1], num_turns=2,
                            extra={"tool_trace": [{"name": "t", "status": "ok", "step_reward": 1.0},
                                                  {"name": "t", "status": "ok", "step_reward": -0.05},
                                                  {"name": "t", "status": "dropped"}]})
    extra = reward_extra_info(s, multi)
    assert extra["num_turns"] == 4 and extra["tool_rewards"] == [1.0, -0.05]
    assert extra["turn_scores"] == [] and extra["rollout_reward_scores"] == {}
    assert extra["split"] == "train" and "num_turns" not in s.extra_info  # the row is not changed


def test_the_engine_passes_verls_extra_info_to_the_reward(tmp_path, tok):
    """Through RolloutEngine (fake SGLang server, the single-turn loop): the custom reward sees num_turns."""
    from agentloop.loops import get_agent_loop
    from agentloop.rollout.engine import RolloutEngine
    from agentloop.server_manager import ServerManager
    from tests.fakes.fake_sglang import FakeSGLang

    f = tmp_path / "reader.py"
    f.write_text(VERL_EXTRA_READER)
    cfg = load_config(None, ["server.urls=[\"http://127.0.0.1:1\"]", "sampling.max_new_tokens=4",
                             f"reward.custom={f}:compute_score", ONE_WORKER])
    s = Sample(index=0, data_source="x", messages=[{"role": "user", "content": "q"}], ground_truth="1",
               extra_info={"split": "test"})

    async def main():
        fake = await FakeSGLang(vocab=100).start()
        try:
            async with ServerManager([fake.url], cfg.manager) as sm:
                engine = RolloutEngine(cfg, sm, tok, get_agent_loop("single_turn_agent_loop"), progress=False)
                return (await engine.run([s])).records
        finally:
            await fake.stop()

    recs = asyncio.run(asyncio.wait_for(main(), 60))
    assert recs[0].error is None, recs[0].error
    assert recs[0].reward == 2.0 and recs[0].reward_info["split"] == "test"
