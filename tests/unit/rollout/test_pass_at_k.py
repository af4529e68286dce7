"""pass@k estimator and group summaries, against hand-computed values."""

from __future__ import annotations

from fractions import Fraction
from math import comb

import pytest

from agentloop.rollout.summary import pass_at_k, summarize_groups


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
        (5, 2, 1, 0.4),  # c / n
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 5, 11 / 12),  # 1 - C(7,5)/C(10,5) = 1 - 21/252
        (4, 3, 2, 1.0),  # n - c < k: every draw of 2 has a correct one
        (200, 0, 50, 0.0),
        (1000, 1, 1, 0.001),
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_exact_binomials_for_large_n():
    for n, c, k in [(100, 7, 10), (500, 3, 64), (1000, 999, 1)]:
        exact = 1 - Fraction(comb(n - c, k), comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(0, 0, 1), (3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(n, c, k)


def test_summarize_groups_hand_values():
    out = summarize_groups({0: [1.0, 0.0, 0.0, 0.0], 1: [1.0, 1.0, 0.0, 0.0], 2: []}, [1, 2, 4, 8])
    assert out["num_prompts"] == 3 and out["num_episodes"] == 8
    assert out["mean_reward"] == pytest.approx(3 / 8)
    assert out["accuracy"] == pytest.approx(3 / 8)
    assert out["pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert out["pass@2"] == pytest.approx((1 / 2 + 5 / 6) / 2)  # 1 - 3/6 and 1 - 1/6
    assert out["pass@4"] == pytest.approx(1.0)
    assert "pass@8" not in out  # no prompt has 8 episodes


def test_summarize_groups_threshold_and_uneven_groups():
    groups = {0: [0.5, 0.9], 1: [1.0 - 1e-12, 0.0, 0.1]}
    out = summarize_groups(groups, [1, 3])
    assert out["pass@1"] == pytest.approx((0 + 1 / 3) / 2)
    assert out["pass@3"] == pytest.approx(1.0)  # only prompt 1 has 3 episodes
    low = summarize_groups(groups, [1], threshold=0.5)
    assert low["pass@1"] == pytest.approx((1.0 + 1 / 3) / 2)
    assert low["mean_reward"] == pytest.approx((0.5 + 0.9 + 1.0 - 1e-12 + 0.1) / 5)


def test_summarize_groups_edge_cases():
    assert summarize_groups({}, [1]) == {"num_prompts": 0, "num_episodes": 0, "mean_reward": 0.0, "accuracy": 0.0}
    with pytest.raises(ValueError, match="not finite"):
        summarize_groups({3: [float("nan")]}, [1])
    with pytest.raises(ValueError, match="k values must be >= 1"):
        summarize_groups({0: [1.0]}, [0])
