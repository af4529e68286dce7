"""Advantage estimators for outcome rewards, in a registry keyed by `AlgoConfig.estimator`.

An estimator maps per-episode rewards to per-episode advantages; every model token of an
episode gets its episode's advantage (rewards are outcome-only, gamma = 1, so the return of
every token is the episode reward). Signature:

    fn(rewards: Tensor[B] float64, groups: Tensor[B] int64, lengths: Tensor[B] int64,
       cfg: AlgoConfig) -> Tensor[B] float64

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
from typing import Callable

import torch

from agentloop.errors import ConfigError
from agentloop.train.config import AlgoConfig

Estimator = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AlgoConfig], torch.Tensor]

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


def _group_stats(values: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group (count, sum, sum of squares), each Tensor[G]."""
    g = int(groups.max().item()) + 1 if groups.numel() else 0
    count = torch.zeros(g, dtype=values.dtype).index_add_(0, groups, torch.ones_like(values))
    total = torch.zeros(g, dtype=values.dtype).index_add_(0, groups, values)
    sq = torch.zeros(g, dtype=values.dtype).index_add_(0, groups, values * values)
    return count, total, sq


@register_estimator("grpo")
def grpo(rewards: torch.Tensor, groups: torch.Tensor, lengths: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    """A_i = r_i - mean(group); divided by (std(group) + eps) when `norm_adv_by_std`.

    The std is the unbiased sample std (n - 1), as in the GRPO paper's reference code; a group
    of one has std 0 and advantage 0.
    """
    count, total, sq = _group_stats(rewards, groups)
    mean = total / count
    adv = rewards - mean[groups]
    if cfg.norm_adv_by_std:
        var = (sq - count * mean * mean) / (count - 1).clamp(min=1)
        std = var.clamp(min=0).sqrt()
        adv = adv / (std[groups] + cfg.adv_eps)
    return adv


@register_estimator("rloo")
def rloo(rewards: torch.Tensor, groups: torch.Tensor, lengths: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    """A_i = r_i - mean of the other rewards of the group (leave-one-out); 0 for a group of one.

    Equal to n/(n-1) * (r_i - mean(group)).
    """
    count, total, _ = _group_stats(rewards, groups)
    n = count[groups]
    others = (total[groups] - rewards) / (n - 1).clamp(min=1)
    return torch.where(n > 1, rewards - others, torch.zeros_like(rewards))


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
def reinforce_pp(rewards: torch.Tensor, groups: torch.Tensor, lengths: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    """REINFORCE++: the outcome reward is every token's return; returns are whitened over all
    model tokens of the batch: A = (r - mean_tok) / (std_tok + eps) (`algo.reinforce_pp_whiten`: `whiten_scale`).

    Token-level statistics are the episode statistics weighted by each episode's model-token
    count. Groups are ignored. The paper's per-token KL in the reward is `algo.kl_type=k1_reward`
    (applied by the learner, which has the reference logprobs). With `drop_zero_variance_groups` it is a
    config error: a group of equal rewards still has non-zero advantages here.
    """
    w = lengths.to(rewards.dtype)
    n = float(w.sum())
    if n <= 0:
        return torch.zeros_like(rewards)
    mean = (w * rewards).sum() / n
    var = (w * (rewards - mean) ** 2).sum() / n
    return (rewards - mean) * whiten_scale(float(var), n, cfg)


@dataclass
class Advantages:
    """Result of `compute_advantages`, all Tensor[B] in the input order."""

    values: torch.Tensor
    """Per-episode advantage (float64)."""
    keep: torch.Tensor
    """False for episodes of dropped zero-variance groups."""
    zero_variance: torch.Tensor
    """True for episodes whose group's rewards are all equal (groups of one included)."""

    def metrics(self) -> dict[str, float]:
        v = self.values[self.keep]
        return {
            "adv/mean": float(v.mean()) if v.numel() else 0.0,
            "adv/std": float(v.std(unbiased=False)) if v.numel() else 0.0,
            "adv/abs_max": float(v.abs().max()) if v.numel() else 0.0,
            "adv/zero_variance_frac": float(self.zero_variance.double().mean()) if self.zero_variance.numel() else 0.0,
            "adv/dropped": float((~self.keep).sum()),
        }


def group_ids(keys: list[object]) -> torch.Tensor:
    """Dense int64 group numbers for hashable keys (e.g. (step, index)), in first-seen order."""
    seen: dict[object, int] = {}
    return torch.tensor([seen.setdefault(k, len(seen)) for k in keys], dtype=torch.int64)


def compute_advantages(
    rewards: torch.Tensor | list[float],
    groups: torch.Tensor | list[int],
    lengths: torch.Tensor | list[int],
    cfg: AlgoConfig,
) -> Advantages:
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    groups = torch.as_tensor(groups, dtype=torch.int64)
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    if not (rewards.shape == groups.shape == lengths.shape) or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)}, groups {tuple(groups.shape)}, lengths "
                         f"{tuple(lengths.shape)} must be equal 1-d shapes")
    if rewards.numel() == 0:
        empty = torch.zeros(0, dtype=torch.bool)
        return Advantages(torch.zeros(0, dtype=torch.float64), empty, empty)
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    est = get_estimator(cfg.estimator)
    values = est(rewards, groups, lengths, cfg).to(torch.float64)
    g = int(groups.max()) + 1
    gmax = torch.full((g,), -torch.inf, dtype=torch.float64).scatter_reduce(0, groups, rewards, "amax")
    gmin = torch.full((g,), torch.inf, dtype=torch.float64).scatter_reduce(0, groups, rewards, "amin")
    zero_var = (gmax == gmin)[groups]
    keep = ~zero_var if cfg.drop_zero_variance_groups else torch.ones_like(zero_var)
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
