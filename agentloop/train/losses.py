"""The PPO-style policy loss, its aggregation modes, KL and entropy terms, and the metrics.

Map:
    token_weights   per-token weights w such that a mini-batch's loss = sum(w * per_token_loss)
    aggregate       the same for a whole batch held at once (the reference the tests compare to)
    kl_estimate     k1 / k3 estimators of KL(pi || ref) from sampled-token logprobs
    policy_loss     one micro-batch's weighted loss + Stats (clip fractions, ratio, KL, entropy,
                    rollout/learner mismatch)
    Stats           mean/max accumulators that merge across micro-batches and all-reduce across ranks

Aggregation is linear in per-token losses: every mode is `sum_t w_t * l_t` over model tokens of
a mini-batch, with w computed from the *mini-batch's* counts (not the micro-batch's), so summing
micro-batch losses gives the full mini-batch loss exactly:

    token-mean           w_t = 1 / (model tokens in the mini-batch)
    seq-mean-token-sum   w_t = 1 / (sequences in the mini-batch)
    seq-mean-token-mean  w_t = 1 / (sequences in the mini-batch * model tokens of t's sequence)

Sequences with no model token count in no denominator.

Old logprobs and the rollout/learner mismatch (truncated importance sampling, TIS). With
ratio r = exp(logp - old), A the advantage, the per-token policy loss is

    pg = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))

and what `old` is depends on `AlgoConfig.old_logprobs`:

  recompute  old = the learner's logprobs before the step's first update (pi_old). The
             rollout engine sampled from mu (the server's logprobs), not pi_old, so each token's
             pg is multiplied by the detached weight w = min(exp(old - rollout), tis_cap): the
             truncated importance ratio pi_old / mu (only clipped above, as in the TIS recipe
             of Yao et al. 2025). Mismatch metrics compare `old` with the rollout logprobs.
  rollout    old = the rollout logprobs (mu). No extra forward pass; r = pi_theta / mu already
             contains the mismatch and the PPO trust region is taken around mu. Here tis_cap
             is a dual-clip bound (Ye et al. 2020): for A < 0 the loss is at most -A * tis_cap,
             so a token whose ratio exploded (mismatch or drift) cannot dominate the step.
             Mismatch metrics compare the current logprobs (detached) with the rollout ones,
             which is exactly learner-vs-rollout on the first forward pass of a step.

With tis_cap = None neither correction is applied (metrics are still reported).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agentloop.train.config import AlgoConfig, LossAggMode


def token_weights(
    mask: torch.Tensor,
    mode: LossAggMode,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> torch.Tensor:
    """Aggregation weights for `mask` (Tensor[B, T], 1 = model token), float64.

    `num_tokens` / `num_seqs` are the mini-batch's totals (default: this tensor's own), so the
    weights of micro-batches cut from one mini-batch add up to that mini-batch's loss.
    """
    m = mask.to(torch.float64)
    per_seq = m.sum(-1)
    if num_tokens is None:
        num_tokens = float(per_seq.sum())
    if num_seqs is None:
        num_seqs = float((per_seq > 0).sum())
    if mode == "token-mean":
        return m / max(num_tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return m / max(num_seqs, 1.0)
    if mode == "seq-mean-token-mean":
        return m / (per_seq.clamp(min=1.0).unsqueeze(-1) * max(num_seqs, 1.0))
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: LossAggMode) -> torch.Tensor:
    """Full-batch aggregation of per-token `values` over mask-1 tokens (the reference form)."""
    return (values * token_weights(mask, mode).to(values.dtype)).sum()


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi.

    k1 = logp - ref_logp (unbiased, can be negative);
    k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased, always >= 0, lower variance).
    """
    if kl_type == "k1":
        return logp - ref_logp
    if kl_type == "k3":
        d = (ref_logp - logp).clamp(-20.0, 20.0)
        return torch.exp(d) - d - 1.0
    raise ValueError(f"unknown kl_type {kl_type!r}")


@dataclass
class Stats:
    """Token-weighted means and maxima, mergeable across micro-batches and ranks."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)

    def add_mean(self, name: str, total: float, count: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(total)
        self.counts[name] = self.counts.get(name, 0.0) + float(count)

    def add_max(self, name: str, value: float) -> None:
        self.maxes[name] = max(self.maxes.get(name, -float("inf")), float(value))

    def merge(self, other: "Stats") -> None:
        for k in other.sums:
            self.add_mean(k, other.sums[k], other.counts[k])
        for k, v in other.maxes.items():
            self.add_max(k, v)

    def all_reduce(self, group=None) -> None:
        """Sum means and max maxima over ranks; every rank must hold the same keys."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
        keys = sorted(self.sums)
        t = torch.tensor([self.sums[k] for k in keys] + [self.counts[k] for k in keys],
                         dtype=torch.float64, device=device)
        dist.all_reduce(t, group=group)
        for i, k in enumerate(keys):
            self.sums[k], self.counts[k] = float(t[i]), float(t[len(keys) + i])
        mkeys = sorted(self.maxes)
        if mkeys:
            m = torch.tensor([self.maxes[k] for k in mkeys], dtype=torch.float64, device=device)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            for i, k in enumerate(mkeys):
                self.maxes[k] = float(m[i])

    def result(self) -> dict[str, float]:
        out = {k: (self.sums[k] / self.counts[k] if self.counts[k] else 0.0) for k in self.sums}
        out.update({k: (v if v != -float("inf") else 0.0) for k, v in self.maxes.items()})
        return out


@dataclass
class LossOutput:
    loss: torch.Tensor
    """This micro-batch's share of the mini-batch loss (differentiable scalar)."""
    stats: Stats
    """Metrics of this micro-batch, weighted by model-token counts."""


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    cfg: AlgoConfig,
    *,
    rollout_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> LossOutput:
    """Loss of one micro-batch; all inputs Tensor[B, T] aligned on the same tokens.

    logp: current logprobs (with grad); old_logp: the ratio's denominator (see module doc);
    advantages: per-token advantages; mask: 1 = model token; weights: `token_weights` of the
    mini-batch (zero off the mask); rollout_logp: the server's logprobs (for TIS and the
    mismatch metrics; in rollout mode it is `old_logp`); ref_logp: frozen reference logprobs
    (needed when kl_coef > 0); entropy: per-token entropy of the current policy (with grad when
    entropy_coef > 0).
    """
    f32 = torch.float32
    m = mask.to(torch.bool)
    mf = m.to(f32)
    n_tok = float(mf.sum())
    w = weights.to(f32)
    adv = advantages.to(f32)
    log_ratio = (logp - old_logp.to(f32)) * mf
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    pg = torch.maximum(pg1, pg2)
    stats = Stats()

    tis_w = None
    if cfg.old_logprobs == "recompute":
        if rollout_logp is not None:
            raw_w = torch.exp(((old_logp - rollout_logp) * mf).to(f32).clamp(max=20.0)).detach()
            if cfg.tis_cap is not None:
                tis_w = raw_w.clamp(max=cfg.tis_cap)
                stats.add_mean("mismatch/tis_weight_mean", (tis_w * mf).sum(), n_tok)
                stats.add_mean("mismatch/tis_capped_frac", ((raw_w > cfg.tis_cap) & m).sum(), n_tok)
                pg = pg * tis_w
    else:
        rollout_logp = old_logp
        if cfg.tis_cap is not None:
            dual = -adv * cfg.tis_cap
            use_dual = (adv < 0) & (pg > dual)
            stats.add_mean("actor/dual_clip_frac", (use_dual & m).sum(), n_tok)
            pg = torch.where(adv < 0, torch.minimum(pg, dual), pg)

    per_token = pg
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        kl = kl_estimate(logp, ref_logp.to(f32), cfg.kl_type)
        per_token = per_token + cfg.kl_coef * kl
        stats.add_mean("actor/kl_ref", (kl.detach() * mf).sum(), n_tok)
    if entropy is not None:
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * entropy
        stats.add_mean("actor/entropy", (entropy.detach() * mf).sum(), n_tok)
    elif cfg.entropy_coef > 0:
        raise ValueError("entropy_coef > 0 needs entropy")

    loss = (per_token * w).sum()

    with torch.no_grad():
        stats.add_mean("actor/pg_loss", (pg * mf).sum(), n_tok)
        clipped_high = (ratio > 1.0 + cfg.clip_ratio_high) & (adv > 0) & m
        clipped_low = (ratio < 1.0 - cfg.clip_ratio_low) & (adv < 0) & m
        stats.add_mean("actor/clip_frac", (clipped_high | clipped_low).sum(), n_tok)
        stats.add_mean("actor/clip_frac_high", clipped_high.sum(), n_tok)
        stats.add_mean("actor/clip_frac_low", clipped_low.sum(), n_tok)
        # k3 estimate of KL(pi_old || pi_theta), samples from pi_old.
        stats.add_mean("actor/approx_kl", ((ratio - 1.0 - log_ratio) * mf).sum(), n_tok)
        stats.add_mean("actor/ratio_mean", (ratio * mf).sum(), n_tok)
        stats.add_max("actor/ratio_max", ratio[m].max() if n_tok else -float("inf"))
        if rollout_logp is not None:
            learner_lp = old_logp if cfg.old_logprobs == "recompute" else logp.detach()
            diff = ((learner_lp - rollout_logp).abs() * mf).to(f32)
            stats.add_mean("mismatch/logprob_abs_diff_mean", diff.sum(), n_tok)
            stats.add_max("mismatch/logprob_abs_diff_max", diff[m].max() if n_tok else -float("inf"))
    return LossOutput(loss=loss, stats=stats)


__all__ = ["LossOutput", "Stats", "aggregate", "kl_estimate", "policy_loss", "token_weights"]
