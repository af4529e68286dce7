"""Advantage estimators for outcome rewards, in a registry keyed by `AlgoConfig.estimator`; numpy only (the
orchestrator computes them, and never imports torch).

An estimator maps per-episode rewards to per-episode advantages; every model token of an
episode gets its episode's advantage (rewards are outcome-only, gamma = 1, so the return of
every token is the episode reward). Signature:

    fn(rewards: ndarray[B] float64, groups: ndarray[B] int64, lengths: ndarray[B] int64,
       cfg: AlgoConfig) -> ndarray[B] float64

`groups` numbers the GRPO groups 0..G-1 (episodes of the same prompt in the same step);
`lengths` is each episode's count of model (mask-1) tokens, used by token-level estimators.

Add one with

    @register_estimator("my_est")
    def my_est(rewards, groups, lengths, cfg): ...

and select it with `algo.estimator=my_est`.

`compute_advantages` wraps an estimator with the zero-variance-group bookkeeping: groups
whose rewards are all equal (including groups of one) get advantage 0 from every built-in
estimator except reinforce_pp; with `drop_zero_variance_groups` they are also marked
`keep = False` so the batcher leaves them out of the loss and its denominators.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from agentloop.errors import ConfigError
from agentloop.train.config import AlgoConfig

Estimator = Callable[[np.ndarray, np.ndarray, np.ndarray, AlgoConfig], Any]

ESTIMATORS: dict[str, Estimator] = {}
"""Registered advantage estimators by name."""


def register_estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator registering `fn` under `name`; re-registering a name is an error."""

    def deco(fn: Estimator) -> Estimator:
        if name in ESTIMATORS and ESTIMATORS[name] is not fn:
            raise ConfigError(f"advantage estimator {name!r} is already registered")
        ESTIMATORS[name] = fn
        return fn

    return deco


def get_estimator(name: str) -> Estimator:
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ConfigError(
            f"unknown advantage estimator {name!r}; registered: {sorted(ESTIMATORS)}"
        ) from None


def _group_stats(values: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-group (count, sum, sum of squares), each ndarray[G] (sums in episode order)."""
    g = int(groups.max()) + 1 if groups.size else 0
    count = np.bincount(groups, minlength=g).astype(values.dtype)
    total = np.bincount(groups, weights=values, minlength=g)
    sq = np.bincount(groups, weights=values * values, minlength=g)
    return count, total, sq


@register_estimator("grpo")
def grpo(rewards: np.ndarray, groups: np.ndarray, lengths: np.ndarray, cfg: AlgoConfig) -> np.ndarray:
    """A_i = r_i - mean(group); divided by (std(group) + eps) when `norm_adv_by_std`.

    The std is the unbiased sample std (n - 1), as in the GRPO paper's reference code; a group
    of one has std 0 and advantage 0.
    """
    count, total, sq = _group_stats(rewards, groups)
    mean = total / count
    adv = rewards - mean[groups]
    if cfg.norm_adv_by_std:
        var = (sq - count * mean * mean) / np.maximum(count - 1, 1)
        std = np.sqrt(np.maximum(var, 0))
        adv = adv / (std[groups] + cfg.adv_eps)
    return adv


@register_estimator("rloo")
def rloo(rewards: np.ndarray, groups: np.ndarray, lengths: np.ndarray, cfg: AlgoConfig) -> np.ndarray:
    """A_i = r_i - mean of the other rewards of the group (leave-one-out); 0 for a group of one.

    Equal to n/(n-1) * (r_i - mean(group)).
    """
    count, total, _ = _group_stats(rewards, groups)
    n = count[groups]
    others = (total[groups] - rewards) / np.maximum(n - 1, 1)
    return np.where(n > 1, rewards - others, np.zeros_like(rewards))


def whiten_scale(var: float, count: float, cfg: AlgoConfig) -> float:
    """The factor REINFORCE++'s whitening multiplies (G - mean) by, from the biased variance `var` of `count`
    values: 1 / (sqrt(var) + adv_eps), or with `reinforce_pp_whiten=verl` verl's masked_whiten,
    1 / sqrt(var * count / (count - 1) + 1e-8) (one value: its variance, 0)."""
    var = max(float(var), 0.0)
    if cfg.reinforce_pp_whiten == "verl":
        unbiased = var * count / (count - 1) if count > 1 else var
        return 1.0 / math.sqrt(unbiased + 1e-8)
    return 1.0 / (math.sqrt(var) + cfg.adv_eps)


@register_estimator("reinforce_pp")
def reinforce_pp(rewards: np.ndarray, groups: np.ndarray, lengths: np.ndarray, cfg: AlgoConfig) -> np.ndarray:
    """REINFORCE++: the outcome reward is every token's return; returns are whitened over all
    model tokens of the batch: A = (r - mean_tok) / (std_tok + eps) (`algo.reinforce_pp_whiten`: `whiten_scale`).

    Token-level statistics are the episode statistics weighted by each episode's model-token
    count. Groups are ignored. The paper's per-token KL in the reward is `algo.kl_type=k1_reward`
    (applied by the learner, which has the reference logprobs). With `drop_zero_variance_groups` it is a
    config error: a group of equal rewards still has non-zero advantages here.
    """
    w = lengths.astype(rewards.dtype)
    n = float(w.sum())
    if n <= 0:
        return np.zeros_like(rewards)
    mean = (w * rewards).sum() / n
    var = (w * (rewards - mean) ** 2).sum() / n
    return (rewards - mean) * whiten_scale(float(var), n, cfg)


@dataclass
class Advantages:
    """Result of `compute_advantages`, all ndarray[B] in the input order."""

    values: np.ndarray
    """Per-episode advantage (float64)."""
    keep: np.ndarray
    """False for episodes of dropped zero-variance groups."""
    zero_variance: np.ndarray
    """True for episodes whose group's rewards are all equal (groups of one included)."""

    def metrics(self) -> dict[str, float]:
        v = self.values[self.keep]
        return {
            "adv/mean": float(v.mean()) if v.size else 0.0,
            "adv/std": float(v.std()) if v.size else 0.0,
            "adv/abs_max": float(np.abs(v).max()) if v.size else 0.0,
            "adv/zero_variance_frac": float(self.zero_variance.mean()) if self.zero_variance.size else 0.0,
            "adv/dropped": float((~self.keep).sum()),
        }


def group_ids(keys: list[object]) -> np.ndarray:
    """Dense int64 group numbers for hashable keys (e.g. (step, index)), in first-seen order."""
    seen: dict[object, int] = {}
    return np.array([seen.setdefault(k, len(seen)) for k in keys], dtype=np.int64)


def compute_advantages(
    rewards: Any,
    groups: Any,
    lengths: Any,
    cfg: AlgoConfig,
) -> Advantages:
    """The configured estimator on per-episode `rewards`, `groups` and `lengths` (array-likes of one length), with
    the zero-variance bookkeeping (module doc)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    groups = np.asarray(groups, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if not (rewards.shape == groups.shape == lengths.shape) or rewards.ndim != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)}, groups {tuple(groups.shape)}, lengths "
                         f"{tuple(lengths.shape)} must be equal 1-d shapes")
    if rewards.size == 0:
        empty = np.zeros(0, dtype=bool)
        return Advantages(np.zeros(0, dtype=np.float64), empty, empty)
    if not np.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    est = get_estimator(cfg.estimator)
    values = np.asarray(est(rewards, groups, lengths, cfg), dtype=np.float64)
    g = int(groups.max()) + 1
    gmax = np.full(g, -np.inf)
    np.maximum.at(gmax, groups, rewards)
    gmin = np.full(g, np.inf)
    np.minimum.at(gmin, groups, rewards)
    zero_var = (gmax == gmin)[groups]
    keep = ~zero_var if cfg.drop_zero_variance_groups else np.ones_like(zero_var)
    return Advantages(values=values, keep=keep, zero_variance=zero_var)


__all__ = [
    "ESTIMATORS",
    "Advantages",
    "Estimator",
    "compute_advantages",
    "get_estimator",
    "group_ids",
    "register_estimator",
    "grpo",
    "reinforce_pp",
    "rloo",
    "whiten_scale",
]
