"""The text each reward sees: verl's (response, special tokens skipped), TinyZero's / Search-R1's (prompt +
response, special tokens kept), ours (the loop's text); verl custom reward files unchanged."""

from __future__ import annotations

import asyncio

import pytest

from agentloop.config import load_config
from agentloop.records import AgentLoopOutput, Sample
from agentloop.rollout.scorer import Scorer
from tests.unit.loops.test_tool_loop import get_tokenizer


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
    scorer = Scorer(load_config(None))
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
    scorer = Scorer(load_config(None, [f"reward.custom={f}:compute_score"]))
    out = _episode(tok, "<|im_start|>user\nq<|im_end|>\n", "the answer is 42<|im_end|>")
    s = _sample("anything/verl", "42")
    text = scorer.solution_text(s, out, tok)
    assert text == "the answer is 42"  # what verl's reward manager passes: no special tokens
    score, info = asyncio.run(scorer.score(s, text))
    assert score == 1.0 and info == {"acc": True, "seen": "the answer is 42"}
    tz = Scorer(load_config(None, [f"reward.custom={f}:compute_score", "reward.custom_view=prompt_response"]))
    assert tz.solution_text(s, out, tok).startswith("<|im_start|>user\nq")
