"""Advantage estimators against hand-computed values; zero-variance handling; registry; record prep."""

from __future__ import annotations

import math

import numpy as np
import pytest

from agentloop.errors import ConfigError
from agentloop.records import EpisodeRecord
from agentloop.train.batch.advantages import (
    ESTIMATORS,
    compute_advantages,
    get_estimator,
    group_ids,
    register_estimator,
)
from agentloop.train.batch.episodes import prepare_episodes
from agentloop.train.config import AlgoConfig, LearnerConfig


def _close(t, expected, tol=1e-6):
    assert t.tolist() == pytest.approx(expected, abs=tol)


def test_grpo_std_normalized_and_dr_grpo():
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0]
    groups = [0, 0, 0, 0, 1, 1]
    lengths = [3, 3, 3, 3, 3, 3]
    a = compute_advantages(rewards, groups, lengths, AlgoConfig(estimator="grpo", adv_eps=1e-12))
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 1 has zero variance
    s = 0.5 / math.sqrt(1 / 3)
    _close(a.values, [s, -s, -s, s, 0.0, 0.0])
    assert a.zero_variance.tolist() == [False] * 4 + [True] * 2
    assert a.keep.all()
    dr = compute_advantages(rewards, groups, lengths, AlgoConfig(norm_adv_by_std=False))
    _close(dr.values, [0.5, -0.5, -0.5, 0.5, 0.0, 0.0])


def test_rloo_leave_one_out():
    a = compute_advantages([1.0, 0.0, 0.0, 5.0], [0, 0, 0, 1], [1, 1, 1, 1], AlgoConfig(estimator="rloo"))
    # r0 - mean(0, 0) = 1; r1 - mean(1, 0) = -0.5; a group of one gets 0
    _close(a.values, [1.0, -0.5, -0.5, 0.0])
    assert a.zero_variance.tolist() == [False, False, False, True]


def test_reinforce_pp_token_level_whitening():
    a = compute_advantages([1.0, 0.0], [0, 1], [3, 1], AlgoConfig(estimator="reinforce_pp", adv_eps=1e-12))
    # tokens: three of reward 1, one of reward 0 -> mean 0.75, std sqrt(0.1875)
    std = math.sqrt(0.1875)
    _close(a.values, [0.25 / std, -0.75 / std])


def test_drop_zero_variance_groups():
    cfg = AlgoConfig(drop_zero_variance_groups=True)
    a = compute_advantages([1.0, 1.0, 0.0, 1.0, 7.0], [0, 0, 1, 1, 2], [2] * 5, cfg)
    assert a.keep.tolist() == [False, False, True, True, False]
    m = a.metrics()
    assert m["adv/dropped"] == 3.0
    assert m["adv/zero_variance_frac"] == pytest.approx(0.6)


def test_empty_and_bad_inputs():
    a = compute_advantages([], [], [], AlgoConfig())
    assert a.values.size == 0
    with pytest.raises(ValueError, match="NaN"):
        compute_advantages([float("nan")], [0], [1], AlgoConfig())
    with pytest.raises(ValueError, match="shapes"):
        compute_advantages([1.0, 2.0], [0], [1, 1], AlgoConfig())


def test_registry():
    assert {"grpo", "rloo", "reinforce_pp"} <= set(ESTIMATORS)
    with pytest.raises(ConfigError, match="unknown advantage estimator 'nope'"):
        get_estimator("nope")

    @register_estimator("test_constant")
    def const(rewards, groups, lengths, cfg):
        return np.ones_like(rewards)

    try:
        a = compute_advantages([0.0, 1.0], [0, 0], [1, 1], AlgoConfig(estimator="test_constant"))
        _close(a.values, [1.0, 1.0])
        with pytest.raises(ConfigError, match="already registered"):
            register_estimator("test_constant")(lambda *a: None)
    finally:
        ESTIMATORS.pop("test_constant")


def test_group_ids_dense_first_seen():
    assert group_ids([(1, 5), (1, 2), (1, 5), (2, 5)]).tolist() == [0, 1, 0, 2]


def _rec(index, repeat, reward, *, step=1, error=None, mask=(1, 1, 0, 1)):
    return EpisodeRecord(
        prompt_ids=[1, 2, 3], response_ids=[4, 5, 6, 7][:len(mask)], response_mask=list(mask),
        response_logprobs=[-0.5 if m else 0.0 for m in mask], reward=reward, error=error,
        episode_id=f"{index}-{repeat}", index=index, repeat=repeat, data_source="t", loop="single_turn",
        seed=0, step=step,
    )


def test_prepare_episodes_excludes_failed_and_groups_by_step_and_index():
    recs = [
        _rec(0, 0, 1.0), _rec(0, 1, 0.0), _rec(0, 2, 0.0, error="RuntimeError: boom"),
        _rec(0, 0, 1.0, step=2), _rec(0, 1, 1.0, step=2),  # same index, other step: its own group
        _rec(1, 0, None),  # unscored
        _rec(2, 0, 1.0, mask=(0, 0)), _rec(2, 1, 0.0),  # no model tokens: baseline only
    ]
    p = prepare_episodes(recs, AlgoConfig(norm_adv_by_std=False))
    assert [e.advantage for e in p.episodes] == [0.5, -0.5, 0.0, 0.0, -0.5]
    assert p.metrics["batch/failed"] == 1.0
    assert p.metrics["batch/unscored"] == 1.0
    assert p.metrics["batch/episodes"] == 5.0
    assert p.episodes[0].ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert p.episodes[0].prompt_len == 3


def test_segments_of_an_episode_share_its_advantage_and_count_once_in_the_baseline():
    """Episode 0-0 has two segments (reward 1), 0-1 one (reward 0): the group's mean is 0.5, not 2/3, and
    both segments of 0-0 get the episode's advantage."""
    second = _rec(0, 0, 1.0, mask=(1, 1)).model_copy(update={"segment": 1, "prompt_ids": [9, 9]})
    recs = [_rec(0, 0, 1.0), second, _rec(0, 1, 0.0)]
    p = prepare_episodes(recs, AlgoConfig(norm_adv_by_std=False))
    assert [e.advantage for e in p.episodes] == [0.5, 0.5, -0.5]
    assert p.episodes[1].ids.tolist() == [9, 9, 4, 5] and p.metrics["batch/episodes"] == 3.0
    # token-level estimators see the episode's model tokens summed over its segments (3 + 2 vs 3)
    rpp = prepare_episodes(recs, AlgoConfig(estimator="reinforce_pp", adv_eps=1e-12))
    mean = (1.0 * 5 + 0.0 * 3) / 8
    std = math.sqrt((5 * (1 - mean) ** 2 + 3 * mean ** 2) / 8)
    assert [e.advantage for e in rpp.episodes] == pytest.approx([(1 - mean) / std] * 2 + [-mean / std])


def test_config_validation():
    with pytest.raises(ValueError):
        AlgoConfig(loss_agg_mode="mean")
    with pytest.raises(ValueError):
        AlgoConfig(unknown=1)
    with pytest.raises(ValueError, match="total_steps"):
        LearnerConfig(schedule="cosine")
    cfg = AlgoConfig()
    with pytest.raises(ValueError):
        cfg.clip_ratio_low = 1.5
    assert AlgoConfig.model_fields["kl_coef"].description
    # REINFORCE++ whitens over the batch: a zero-variance group still has non-zero advantages, so dropping
    # those groups would drop real signal
    assert np.abs(compute_advantages([1.0, 1.0, 0.0], [0, 0, 1], [3, 3, 3], AlgoConfig(estimator="reinforce_pp")
                                     ).values[:2]).min() > 0.1
    with pytest.raises(ValueError, match="reinforce_pp.*drop_zero_variance_groups"):
        AlgoConfig(estimator="reinforce_pp", drop_zero_variance_groups=True)
    with pytest.raises(ValueError, match="old_logprobs=recompute"):
        AlgoConfig(old_logprobs="rollout", proximal="interpolate")
    # a warmup longer than the run is clipped (lr_at), not refused: `agentloop train train.steps=1` works
    lc = LearnerConfig(warmup_steps=10)
    lc.total_steps = 1
    assert lc.total_steps == 1
    with pytest.raises(ValueError, match="flex needs a CUDA"):
        LearnerConfig(attention="flex", device="cpu")
