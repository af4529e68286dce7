"""Rewards: registry, custom loading, normalization of returns, and each built-in on tricky text."""

from __future__ import annotations

import math

import numpy as np
import pytest

import agentloop.rewards as rewards
from agentloop.errors import RewardError
from agentloop.rewards import (
    RewardResult,
    boxed_math_score,
    countdown_score,
    exact_match_score,
    extract_boxed,
    extract_gsm8k_answer,
    get_reward,
    gsm8k_score,
    list_rewards,
    load_custom_reward,
    make_countdown_reward,
    normalize_math,
    register_reward,
    score_episode,
)
from agentloop.rewards import countdown as countdown_mod
from tests.unit.api_check import assert_public_api


def test_all_is_exactly_the_public_namespace():
    assert_public_api(rewards)


# ---------------------------------------------------------------- registry


def test_builtins_registered_for_their_data_sources():
    known = set(list_rewards())
    for ds in ["agentloop/arithmetic", "openai/gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
               "HuggingFaceH4/MATH-500", "agentloop/math", "countdown", "agentloop/countdown", "exact_match",
               "nq", "hotpotqa", "searchR1_nq", "agentloop/gsm8k"]:
        assert ds in known
    # verl routes "math" to its DAPO reward, which we do not have: not ours to claim
    assert "math" not in known
    assert get_reward("openai/gsm8k")("openai/gsm8k", "#### 3", "3") == 1.0
    assert get_reward("lighteval/MATH")("lighteval/MATH", r"\boxed{3}", "3") == 1.0


def test_get_reward_missing_and_default():
    with pytest.raises(RewardError, match=r"no reward registered for data source 'nope'; known: \[.*'countdown'"):
        get_reward("nope")
    assert get_reward("nope", default="exact_match") is get_reward("exact_match")
    with pytest.raises(RewardError, match="default reward 'missing' is not registered"):
        get_reward("nope", default="missing")


def test_register_reward_override():
    def a(ds, s, gt, extra=None):
        return 1.0

    def b(ds, s, gt, extra=None):
        return 0.0

    register_reward("test/ds", a)
    register_reward("test/ds", a)  # same function: no-op
    with pytest.raises(RewardError, match="already registered"):
        register_reward("test/ds", b)
    register_reward("test/ds", b, override=True)
    assert get_reward("test/ds") is b
    with pytest.raises(RewardError, match="not callable"):
        register_reward("test/other", 3)
    with pytest.raises(RewardError, match="non-empty string"):
        register_reward("", a)


def test_load_custom_reward_from_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str == ground_truth), 'len': len(solution_str)}\n"
        "NOT_FN = 3\n"
    )
    fn = load_custom_reward(f"{f}:compute_score")
    assert load_custom_reward(str(f)) is fn  # function name defaults to compute_score; imported once
    assert score_episode(fn, "x", "ab", "ab") == RewardResult(score=1.0, info={"len": 2})
    with pytest.raises(RewardError, match="has no attribute 'missing'; callables there: \\['compute_score'\\]"):
        load_custom_reward(f"{f}:missing")
    with pytest.raises(RewardError, match="'NOT_FN' is a int, not a function"):
        load_custom_reward(f"{f}:NOT_FN")
    with pytest.raises(RewardError, match="does not exist"):
        load_custom_reward(f"{tmp_path}/nope.py:f")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RewardError, match="importing .* failed: RuntimeError: boom"):
        load_custom_reward(f"{broken}:f")


def test_load_custom_reward_from_module():
    fn = load_custom_reward("agentloop.rewards.gsm8k:compute_score")
    assert fn("openai/gsm8k", "#### 7", "7") == 1.0
    with pytest.raises(RewardError, match="module 'agentloop.no_such_mod' cannot be imported"):
        load_custom_reward("agentloop.no_such_mod:f")
    with pytest.raises(RewardError, match="must look like"):
        load_custom_reward("agentloop.rewards.gsm8k:")


# ---------------------------------------------------------------- score_episode


@pytest.mark.parametrize(
    ("ret", "score", "info"),
    [
        (1, 1.0, {}),
        (0.25, 0.25, {}),
        (True, 1.0, {}),
        (np.float32(0.5), 0.5, {}),
        (np.bool_(False), 0.0, {}),
        ({"score": 0.5, "acc": True, "pred": "7", "n": np.int64(3), "note": None}, 0.5,
         {"acc": True, "pred": "7", "n": 3, "note": None}),
    ],
)
def test_score_episode_normalizes(ret, score, info):
    result = score_episode(lambda *a: ret, "ds", "text", "gt", {})
    assert result.score == score and result.info == info
    assert type(result.score) is float and all(type(v) in (bool, int, float, str, type(None)) for v in result.info.values())


@pytest.mark.parametrize(
    ("ret", "needle"),
    [
        (None, "returned score None"),
        (float("nan"), "returned score nan; it must be finite"),
        (math.inf, "must be finite"),
        ("1.0", "returned score '1.0'"),
        ([1.0], "returned score [1.0]"),
        ({"acc": 1.0}, "without 'score'"),
        ({"score": None}, "returned score None"),
        ({"score": 1.0, "obj": object()}, "info 'obj'"),
    ],
)
def test_score_episode_rejects_bad_returns(ret, needle):
    with pytest.raises(RewardError, match="data source 'my/ds'") as ei:
        score_episode(lambda *a: ret, "my/ds", "text", "gt", {})
    assert needle in str(ei.value)


def test_score_episode_wraps_exceptions():
    def bad(ds, s, gt, extra=None):
        raise KeyError("target")

    with pytest.raises(RewardError, match=r"bad for data source 'cd' raised KeyError: 'target'"):
        score_episode(bad, "cd", "", None)
    with pytest.raises(RewardError, match="countdown ground truth must be"):
        score_episode(get_reward("countdown"), "countdown", "<answer>1</answer>", "12")


# ---------------------------------------------------------------- exact match


@pytest.mark.parametrize(
    ("pred", "gt", "expected"),
    [
        ("Paris", "paris", 1.0),
        ("  Paris.\n", "Paris", 1.0),
        ('"New   York"', "new york", 1.0),
        ("Ｐａｒｉｓ", "paris", 1.0),  # full-width letters, NFKC
        ("Paris, France", "Paris", 0.0),
        ("b", ["a", "B"], 1.0),
        ("42", 42, 1.0),
        ("", "x", 0.0),
    ],
)
def test_exact_match(pred, gt, expected):
    assert exact_match_score(pred, gt) == expected


# ---------------------------------------------------------------- gsm8k


@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [
        ("so the answer is\n#### 72", "72", "72"),
        ("#### 5\nwait, no\n#### 7", "7", "7"),  # the last ####
        ("####1,234", "1234", "1234"),
        ("#### $18.50 dollars", "18.50", "18.50"),
        ("#### **42**", "42", "42"),
        ("#### -3", "-3", "-3"),
        ("#### done", None, None),  # #### without a number; the only number-free text
        ("I think 3 then 4.", None, "4"),
        ("between 1,000 and 2,500", None, "2500"),
        ("no numbers here", None, None),
        ("", None, None),
    ],
)
def test_extract_gsm8k(text, strict, flexible):
    assert extract_gsm8k_answer(text, "strict") == strict
    assert extract_gsm8k_answer(text, "flexible") == flexible


def test_gsm8k_score():
    assert gsm8k_score("#### 72.00", "72") == 1.0
    assert gsm8k_score("#### 72", 72) == 1.0
    assert gsm8k_score("#### 72", "She sold 48/2 = 24 in May.\n#### 72") == 1.0  # full gsm8k answer as truth
    assert gsm8k_score("#### 71", "72") == 0.0
    assert gsm8k_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_score("the answer is 72", "72") == 0.0
    assert gsm8k_score("the answer is 72", "72", method="flexible") == 1.0
    assert gsm8k_score("#### 7" * 10_000, "7") == 1.0  # long text is fine
    with pytest.raises(ValueError, match="not a number"):
        gsm8k_score("#### 1", "seven")


# ---------------------------------------------------------------- boxed math


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (r"so \boxed{5}.", "5"),
        (r"\boxed{1} then \boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),  # last, nested braces
        (r"\boxed 5$", "5"),
        (r"\fbox{x+1}", "x+1"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not count
        (r"\boxed{2} and \boxed{3", "2"),  # the unbalanced last one is skipped
        (r"\boxedfoo", None),
        ("no box", None),
    ],
)
def test_extract_boxed(text, content):
    assert extract_boxed(text) == content


@pytest.mark.parametrize(
    ("text", "gt", "expected"),
    [
        (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0),
        (r"\boxed{\frac34}", r"\frac{3}{4}", 1.0),
        (r"\boxed{3/4}", r"\tfrac{3}{4}", 1.0),
        (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        (r"\boxed{90^{\circ}}", r"90^\circ", 1.0),
        (r"\boxed{10\text{ cm}}", "10", 1.0),
        (r"\boxed{\text{(B)}}", r"\text{(B)}", 1.0),
        (r"\boxed{5.0}", "5", 1.0),
        (r"$\boxed{1,000}$", "1000", 1.0),
        (r"\boxed{\$18}", "18", 1.0),
        (r"\boxed{50\%}", "50", 1.0),
        (r"\boxed{x = 5}", "5", 1.0),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1.0),
        (r"\boxed 7", "7", 1.0),
        (r"\boxed{2}", r"The answer is $\boxed{2}$.", 1.0),  # truth given as a full solution
        (r"\boxed{1/3}", "0.333", 0.0),
        (r"\boxed{x+1}", "1+x", 0.0),  # no symbolic algebra
        (r"\boxed{6}", ["5", "6"], 1.0),
        ("the answer is 5", "5", 0.0),  # no box, no credit
        (r"\boxed{}", "5", 0.0),
    ],
)
def test_boxed_math(text, gt, expected):
    assert boxed_math_score(text, gt) == expected


def test_normalize_math_idempotent():
    for s in [r"\dfrac{3}{4}", r"10\text{ cm}", r"\left(1,2\right)", "1,000.00", r"90^\circ"]:
        once = normalize_math(s)
        assert normalize_math(once) == once


# ---------------------------------------------------------------- countdown

GT = {"target": 24, "numbers": [2, 3, 4]}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>2*3=6, 6*4=24</think>\n<answer>2 * 3 * 4</answer>", 1.0),
        ("<answer>(4 * 3) * 2 = 24</answer>", 1.0),  # a trailing "= n" is ignored
        ("<answer> 4*(3*2) </answer>", 1.0),
        ("<answer>1</answer> no wait <answer>2 * 3 * 4</answer>", 1.0),  # the last answer counts
        ("<answer>2 * 3 * 4</answer> so <answer>24</answer>", 0.1),  # ... even when worse
        ("<answer>4 * 3 * 2 * 2 / 2</answer>", 0.1),  # 2 reused, although the value is 24
        ("<answer>4 * 3 * 2 * 1</answer>", 0.1),  # 1 is not given
        ("<answer>4 * 6</answer>", 0.1),  # 6 not given, 2 and 3 unused
        ("<answer>2 + 3 + 4</answer>", 0.1),  # 9
        ("<answer>(4 * 3) * 2 = 25</answer>", 1.0),  # the claimed result is ignored; the value is 24
        ("<answer>-(2 - 3) * 4 * 6</answer>", 0.1),
    ],
)
def test_countdown(text, expected):
    assert countdown_score(text, GT) == expected


@pytest.mark.parametrize(
    "text",
    [
        "<answer>__import__('os').system('echo hacked')</answer>",
        "<answer>(lambda: 24)()</answer>",
        "<answer>2 ** 3 * 3</answer>",  # power
        "<answer>4 // 2 * 3 * 4</answer>",  # floor division
        "<answer>2 * 3 * 4.0</answer>",  # float literal
        "<answer>24; import os</answer>",
        "<answer>2 x 3 x 4</answer>",
        "<answer>2 * 3 *</answer>",
        "<answer>" + "(" * 300 + "2" + ")" * 300 + "</answer>",
        "<answer></answer>",
        "<answer>2 * 3 * 4",  # never closed
        "2 * 3 * 4",
        "",
    ],
)
def test_countdown_rejects_injection_and_malformed(text):
    assert countdown_score(text, GT) == 0.0


def test_countdown_exact_fractions_and_duplicates():
    assert countdown_score("<answer>6 / (1 - 3 / 4)</answer>", {"target": 24, "numbers": [1, 3, 4, 6]}) == 1.0
    assert countdown_score("<answer>5 / (2 - 2)</answer>", {"target": 1, "numbers": [2, 2, 5]}) == 0.1  # 1/0
    assert countdown_score("<answer>2 * 2</answer>", {"target": 4, "numbers": [2, 2]}) == 1.0
    assert countdown_score("<answer>2 * 2 * 2 / 2</answer>", {"target": 4, "numbers": [2, 2]}) == 0.1
    gt = {"target": np.int64(24), "numbers": np.array([2, 3, 4])}
    assert countdown_score("<answer>2*3*4</answer>", gt) == 1.0


def test_countdown_format_score_is_configurable(monkeypatch):
    wrong = "<answer>2 + 3 + 4</answer>"
    assert countdown_score(wrong, GT, format_score=0.0) == 0.0
    assert make_countdown_reward(0.0)("countdown", wrong, GT) == 0.0
    assert make_countdown_reward(0.0, score=2.0)("countdown", "<answer>2*3*4</answer>", GT) == 2.0
    monkeypatch.setattr(countdown_mod, "COUNTDOWN_FORMAT_SCORE", 0.25)
    assert get_reward("agentloop/countdown")("agentloop/countdown", wrong, GT) == 0.25


def test_score_episode_calling_conventions():
    def verl_kw_order(solution_str, ground_truth, data_source=None, extra_info=None):
        return float(solution_str == ground_truth and data_source == "ds")

    def no_extra(data_source, solution_str, ground_truth):
        return 0.5

    def other_names(a, b, c, d=None):
        return float(b == c)

    def too_few(a):
        return 1.0

    assert score_episode(verl_kw_order, "ds", "x", "x").score == 1.0  # called by keyword
    assert score_episode(no_extra, "ds", "x", "x").score == 0.5
    assert score_episode(other_names, "ds", "x", "x").score == 1.0  # positional fallback
    with pytest.raises(RewardError, match=r"too_few\(a\) cannot take"):
        score_episode(too_few, "ds", "x", "x")


def test_score_episode_refuses_async_rewards_cleanly():
    async def areward(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0

    with pytest.raises(RewardError, match="is async"):
        score_episode(areward, "ds", "x", "x")
