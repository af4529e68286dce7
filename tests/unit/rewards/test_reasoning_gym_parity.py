"""reasoning-gym: the same completions scored by reasoning-gym's own path and by agentloop's, 0 disagreements.

reasoning-gym's path (what its users write): `dataset.score_answer(extract_answer(completion), entry)` on the
entries of the dataset object itself. agentloop's: the rows `agentloop data prepare reasoning_gym` writes, read
back from a Parquet file by the loader, scored by the rollout's Scorer (its reward worker processes) by
data_source. 1,200+ completions over 8 tasks: right answers, wrong ones and malformed ones (no tags, empty tags,
an unclosed tag, two answers, whitespace, the answer outside the tags, `####` lines, other tasks' answers).
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from agentloop.config import Config
from agentloop.data import load_file, write_rows
from agentloop.data.reasoning_gym import reasoning_gym_rows
from agentloop.errors import DataError, RewardError
from agentloop.rewards import get_reward
from agentloop.rewards.reasoning_gym import compute_score
from agentloop.rollout.scorer import Scorer

rg = pytest.importorskip("reasoning_gym", reason="the envs extra (reasoning-gym) is not installed")
from reasoning_gym.utils import extract_answer  # noqa: E402

TASKS = ["basic_arithmetic", "chain_sum", "products", "leg_counting", "gcd", "spell_backward", "word_sorting",
         "letter_counting"]
SIZE = 25
SEED = 7


def completions(entry: dict, other: str, rnd: random.Random) -> list[str]:
    a = str(entry["answer"])
    return [
        f"<answer>{a}</answer>",                                   # right
        f"Let me think.\n<answer> {a} </answer>",                  # right, spaced
        f"<answer>{other}</answer>",                                # another entry's answer
        a,                                                          # right, but no tags
        "<answer></answer>",                                        # empty
        f"<answer>{a}",                                             # unclosed
        f"<answer>{other}</answer> then <answer>{a}</answer>",     # two: the last counts
        f"<answer>{a}</answer><answer>{other}</answer>",           # two: the last is wrong
        f"#### {a}",                                                # another format
        f"<answer>{a.upper()}x</answer>" if rnd.random() < 0.5 else f"<ANSWER>{a}</ANSWER>",
    ]


def test_thousand_completions_agree_with_reasoning_gyms_own_scoring(tmp_path):
    rows = reasoning_gym_rows(TASKS, SIZE, SEED, system_prompt="default")
    path = write_rows(rows, tmp_path / "rg.parquet")
    samples = load_file(path)
    datasets = {t: rg.create_dataset(t, size=SIZE, seed=SEED) for t in TASKS}
    rnd = random.Random(0)
    cases = []
    for i, sample in enumerate(samples):
        task = sample.extra_info["task"]
        entry = datasets[task][i // len(TASKS)]
        assert entry["question"] == sample.messages[-1]["content"]
        other = str(samples[(i + 1) % len(samples)].ground_truth)
        for c in completions(entry, other, rnd):
            cases.append((sample, entry, c, datasets[task].score_answer(extract_answer(c), entry)))
    assert len(cases) >= 1000

    async def ours():
        scorer = Scorer(Config())
        try:
            return await asyncio.gather(*(scorer.score(s, c) for s, _, c, _ in cases))
        finally:
            await scorer.close()

    got = asyncio.run(ours())
    disagreements = [(c, theirs, score) for (_, _, c, theirs), (score, _) in zip(cases, got) if score != theirs]
    assert disagreements == []
    scores = [theirs for *_, theirs in cases]
    # the cases tell right from wrong: many full scores, many zeros, and partial credit from some tasks
    assert sum(s == 1.0 for s in scores) > 300 and sum(s == 0.0 for s in scores) > 300
    assert all(info["task"] == s.extra_info["task"] for (s, *_), (_, info) in zip(cases, got))


def test_hashes_format_reads_the_last_hashes_line():
    rows = reasoning_gym_rows(["basic_arithmetic"], 3, 1, answer_format="hashes", tools=["calculator"])
    row = rows[0]
    assert row["extra_info"]["tools_kwargs"] == {"calculator": {}}
    gt = row["reward_model"]["ground_truth"]
    score = compute_score("reasoning_gym", f"#### 1\n#### {gt}", gt, row["extra_info"])
    assert score["score"] == 1.0 and score["answer_found"]
    assert compute_score("reasoning_gym", f"<answer>{gt}</answer>", gt, row["extra_info"])["score"] == 0.0


def test_registered_under_its_data_source():
    assert get_reward("reasoning_gym") is compute_score


def test_bad_input_is_named():
    with pytest.raises(DataError, match="unknown task.*no_such_task"):
        reasoning_gym_rows(["no_such_task"], 2)
    with pytest.raises(DataError, match="create_dataset.*products"):
        reasoning_gym_rows(["products"], 2, config={"products": {"no_such_key": 1}})
    with pytest.raises(DataError, match="not among --task"):
        reasoning_gym_rows(["products"], 2, config={"gcd": {}})
    with pytest.raises(RewardError, match="no extra_info\\['reasoning_gym'\\]"):
        compute_score("reasoning_gym", "<answer>1</answer>", "1", {})
    with pytest.raises(RewardError, match="no entry with an answer"):
        compute_score("reasoning_gym", "<answer>1</answer>", "1", {"reasoning_gym": json.dumps({"x": 1})})
