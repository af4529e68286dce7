"""The tool demo sets (code, search_qa): they load, their references score 1.0, wrong answers do not."""

from __future__ import annotations

import asyncio

import pytest

from agentloop.config import DataConfig
from agentloop.data import list_datasets, load_samples
from agentloop.data.tool_demos import CODE_SOURCE, SEARCH_QA_SOURCE
from agentloop.rewards import get_reward
from agentloop.rewards.qa import extract_answer_tag, normalize_answer
from agentloop.tools import ToolsConfig, get_tool


def _samples(name: str):
    return load_samples(DataConfig(builtin=name))


def test_sets_are_registered_and_load():
    assert {"code", "search_qa", "calculator"} <= set(list_datasets())
    code, qa = _samples("code"), _samples("search_qa")
    assert len(code) == 16 and len(qa) == 16
    assert all(s.data_source == CODE_SOURCE and s.tools_kwargs == {"python": {}} for s in code)
    assert all(s.data_source == SEARCH_QA_SOURCE and s.tools_kwargs == {"search": {}} for s in qa)
    assert len({s.ground_truth["entry_point"] for s in code}) == 16
    for s in code:
        assert s.messages[0]["role"] == "system" and s.ground_truth["entry_point"] in s.messages[1]["content"]
    assert get_reward(CODE_SOURCE) and get_reward(SEARCH_QA_SOURCE)


def test_code_references_score_one_and_stubs_do_not():
    fn = get_reward(CODE_SOURCE)
    samples = _samples("code")

    async def all_of(answers):
        return await asyncio.gather(*(fn(CODE_SOURCE, a, s.ground_truth, s.extra_info)
                                      for a, s in zip(answers, samples)))

    refs = [f"I tested it with the tool.\n```python\n{s.extra_info['reference_solution']}```" for s in samples]
    for s, r in zip(samples, asyncio.run(all_of(refs))):
        assert r["score"] == 1.0, (s.ground_truth["entry_point"], r)
    stubs = [f"```python\ndef {s.ground_truth['entry_point']}(*args):\n    return None\n```" for s in samples]
    for s, r in zip(samples, asyncio.run(all_of(stubs))):
        assert r["score"] < 1.0, (s.ground_truth["entry_point"], r)


def test_search_qa_answers_score_and_are_in_the_corpus():
    fn = get_reward(SEARCH_QA_SOURCE)
    tool = get_tool("search")(ToolsConfig())
    for s in _samples("search_qa"):
        aliases = s.ground_truth["target"]
        assert fn(SEARCH_QA_SOURCE, f"<think>search</think><answer> {aliases[0]} </answer>", s.ground_truth) == 1.0
        assert fn(SEARCH_QA_SOURCE, f"<answer>{aliases[0]} and more</answer>", s.ground_truth) == 0.0
        assert fn(SEARCH_QA_SOURCE, aliases[0], s.ground_truth) == 0.0  # no tag, no score
        # answerable: the search tool's top results for the question hold the answer
        res = asyncio.run(tool.execute({}, {"query": s.messages[-1]["content"]}))
        assert normalize_answer(aliases[0]) in normalize_answer(res.text), (s.messages[-1]["content"], res.text)


@pytest.mark.parametrize("text,expected", [
    ("<answer>a</answer> then <answer>The Louvre.</answer>", "The Louvre."),
    ("<answer>\nmulti\nline</answer>", "\nmulti\nline"),
    ("no tag", None),
])
def test_answer_tag(text, expected):
    assert extract_answer_tag(text) == expected


def test_normalize_answer():
    assert normalize_answer("  The  Great Red-Spot! ") == "great redspot"
    assert normalize_answer("H2O") == "h2o"


def test_bench_tools_measure_and_forced_parser():
    from agentloop.bench.tools import (
        FORCED_CALLS,
        forced_parser,
        format_report,
        measure,
    )
    from agentloop.records import EpisodeRecord

    def rec(i, tool_s, gen_s, wall, err=None):
        return EpisodeRecord(prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 0], response_logprobs=[-0.5, 0.0],
                             num_turns=2, reward=1.0, metrics={"tool_time_s": tool_s, "gen_time_s": gen_s,
                                                               "tool_calls": 1.0}, error=err,
                             episode_id=f"{i}-0", index=i, repeat=0, data_source="x", loop="l", seed=0, wall_s=wall)

    m = measure([rec(0, 1.0, 2.0, 4.0), rec(1, 0.0, 3.0, 4.0, err="E: x")], wall_s=2.0)
    assert m["episodes_per_s"] == 1.0 and m["tokens_per_s"] == 1.0 and m["errors"] == 1
    assert m["tool_share"] == 1 / 8 and m["gen_share"] == 5 / 8 and m["other_share"] == 2 / 8
    assert "calculator" in format_report({"sets": {"calculator": {"tool_agent_loop": m}}})
    parsed = forced_parser("calculator")("anything at all")
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", FORCED_CALLS["calculator"])]


def test_code_stdio_set_scores_with_a_stdin_grader():
    """The stdin/stdout problems (`code_stdio`, and `agentloop data prepare code` rows with stdin tests): their
    reference programs score 1.0, a wrong program less."""
    samples = _samples("code_stdio")
    assert len(samples) == 8 and all(s.data_source == CODE_SOURCE and s.tools_kwargs == {"python": {}} for s in samples)
    assert all(set(t) == {"stdin", "stdout"} for s in samples for t in s.ground_truth["tests"])
    fn = get_reward(CODE_SOURCE)

    def answer(code: str) -> str:
        return f"Done.\n```python\n{code}```"

    async def all_of(answers):
        return await asyncio.gather(*(fn(CODE_SOURCE, a, s.ground_truth, s.extra_info) for a, s in zip(answers, samples)))

    for s, r in zip(samples, asyncio.run(all_of([answer(s.extra_info["reference_solution"]) for s in samples]))):
        assert r["score"] == 1.0, (s.messages[-1]["content"], r)
    for s, r in zip(samples, asyncio.run(all_of([answer("print(42)\n") for _ in samples]))):
        assert r["score"] < 1.0, (s.messages[-1]["content"], r)
