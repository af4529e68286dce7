"""verl's rollout correction (algorithm.rollout_correction) on our tensors: sequence-level importance
weights and rejection sampling, both from r = pi_proximal / pi_behaviour per model token.

Map:
    RsRule, parse_rollout_rs    `algo.rollout_rs` + `algo.rollout_rs_threshold` in verl's format -> rules
                                (defined in agentloop.train.config: a bad spec fails when the config is built)
    seq_sum, seq_broadcast      per-sequence sums over positions labelled by `seq_ids` (-1 = no sequence),
                                and a per-sequence value back at its positions
    sequence_log_ratio          each position's sequence total of log r (algo.tis_level=sequence)
    rejection_keep              which model tokens `rollout_rs` keeps (every rule must pass)

Token-level truncated IS (verl's rollout_is=token) is `algo.tis_cap` itself, in losses.policy_loss.
Statistics follow verl's rollout_corr_helper: log r is bounded to [-20, 20]; k1 = -log r, k2 = (log r)^2 / 2,
k3 = r - 1 - log r; k1 rules keep log(lower) <= statistic <= log(upper), k2/k3 rules statistic <= upper.
"""

from __future__ import annotations

import torch

from agentloop.train.config import RS_OPTIONS, RsRule, parse_rollout_rs

SAFETY_BOUND = 20.0
"""log r is bounded to [-20, 20] before any exponential (verl's SAFETY_BOUND)."""


def seq_sum(values: torch.Tensor, seq_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Tensor[n]: the sum of `values` ([b, L]) over the positions of each sequence (seq_ids >= 0)."""
    on = seq_ids >= 0
    v = torch.where(on, values, torch.zeros_like(values)).reshape(-1)
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, seq_ids.clamp(min=0).reshape(-1), v)


def seq_broadcast(per_seq: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """[b, L]: each position's sequence value (0 where seq_ids is -1)."""
    out = per_seq[seq_ids.clamp(min=0)]
    return torch.where(seq_ids >= 0, out, torch.zeros_like(out))


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, n: int) -> torch.Tensor:
    """[b, L]: the sum of `log_ratio` over the model tokens (mask) of each position's sequence."""
    return seq_broadcast(seq_sum(log_ratio * mask, seq_ids, n), seq_ids)


def _statistic(kind: str, log_r: torch.Tensor) -> torch.Tensor:
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r * log_r
    return torch.exp(log_r) - 1.0 - log_r


def rejection_keep(log_ratio: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, n: int,
                   rules: list[RsRule]) -> torch.Tensor:
    """Bool [b, L]: the model tokens (mask > 0) that every rule keeps; `log_ratio` = log pi_prox - log mu."""
    m = mask > 0
    mf = m.to(log_ratio.dtype)
    log_r = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    keep = m.clone()
    for rule in rules:
        stat = _statistic(rule.kind, log_r) * mf
        if rule.level == "token":
            value = stat
        elif rule.level == "max":
            neg = torch.full_like(stat, -float("inf"))
            flat = torch.where(m & (seq_ids >= 0), stat, neg).reshape(-1)
            per = torch.full((n,), -float("inf"), dtype=stat.dtype, device=stat.device).scatter_reduce(
                0, seq_ids.clamp(min=0).reshape(-1), flat, "amax")
            value = seq_broadcast(torch.where(torch.isinf(per), torch.zeros_like(per), per), seq_ids)
        else:
            total = seq_sum(stat, seq_ids, n)
            if rule.level == "mean":
                total = total / seq_sum(mf, seq_ids, n).clamp(min=1.0)
            value = seq_broadcast(total, seq_ids)
        ok = value <= rule.upper
        if rule.lower is not None:
            ok &= value >= rule.lower
        keep &= ok
    return keep


__all__ = ["RS_OPTIONS", "RsRule", "SAFETY_BOUND", "parse_rollout_rs", "rejection_keep", "seq_broadcast", "seq_sum",
           "sequence_log_ratio"]
