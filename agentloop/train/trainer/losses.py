"""The PPO-style policy loss, its aggregation modes, KL and entropy terms, and the metrics.

Map:
    token_weights   per-token weights w such that a mini-batch's loss = sum(w * per_token_loss)
    aggregate       the same for a whole batch held at once (the reference the tests compare to)
    kl_estimate     k1 / k2 / k3 per-token KL terms from sampled-token logprobs (what each optimizes:
                    AlgoConfig.kl_type)
    interpolate_proximal   AReaL's log-linear proximal logprobs from behaviour + current + versions
    policy_loss     one micro-batch's weighted loss + Stats (clip fractions, ratio, KL, entropy,
                    behaviour/proximal mismatch, importance weights, masking)
    Stats           mean/max accumulators that merge across micro-batches and all-reduce across ranks;
                    they hold device tensors, so a step reads them back once (no host sync per micro-batch)

Aggregation is linear in per-token losses: every mode is `sum_t w_t * l_t` over model tokens of
a mini-batch, with w computed from the *mini-batch's* counts (not the micro-batch's), so summing
micro-batch losses gives the full mini-batch loss exactly:

    token-mean           w_t = 1 / (model tokens in the mini-batch)
    seq-mean-token-sum   w_t = 1 / (sequences in the mini-batch)
    seq-mean-token-mean  w_t = 1 / (sequences in the mini-batch * model tokens of t's sequence)

Sequences with no model token count in no denominator.

Three policies (decoupled PPO, Hilton et al. 2022; AReaL): the behaviour policy mu sampled the tokens
(the records' logprobs: another engine, and in asynchronous training older weights), the proximal policy
pi_prox is the trust region's centre, pi_theta is being trained. With ratio r = exp(logp - old) and A the
advantage, the per-token policy loss is

    pg = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))     (then dual_clip, if set)

and `old` depends on `AlgoConfig.old_logprobs`:

  recompute  old = pi_prox's logprobs: the learner's weights at the start of the step (a forward pass,
             or the loss pass's own detached logprobs when the weights have not moved yet, or
             `interpolate_proximal` with algo.proximal=interpolate). The behaviour/proximal mismatch is
             handled per token with the detached weight w = pi_prox / mu: the loss is multiplied by
             min(w, tis_cap) (truncated importance sampling, Yao et al. 2025; with tis_level=sequence, w is
             the product over the token's episode: verl's rollout_is=sequence), and tokens whose w lies
             outside [mask_ratio_low, mask_ratio_high] are masked out. Mismatch metrics compare pi_prox
             with mu. (verl's rollout_rs rejection is applied before this, to the mask and the weights:
             agentloop.train.trainer.verl_order.)
  rollout    old = mu. No extra forward pass; r = pi_theta / mu already contains the mismatch and the
             trust region is taken around mu. No importance weight. Mismatch metrics compare the current
             logprobs (detached) with mu, which is learner-vs-rollout on the first forward pass of a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

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


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kl_type: str, *, value_max: float = 10.0) -> torch.Tensor:
    """Per-token KL term from tokens sampled from pi, d = logp - ref_logp (see AlgoConfig.kl_type).

    k1 = d             value: unbiased for KL(pi||ref); expected gradient 0 (noise only)
    k2 = d^2 / 2       expected gradient (on-policy): that of KL(pi||ref)
    k3 = e^-d + d - 1  value: unbiased for KL(pi||ref), >= 0; expected gradient: that of KL(ref||pi);
                       capped at `value_max` (zero gradient beyond), and -d is bounded before the exp so
                       the capped region has a finite (zero) gradient, never inf * 0
    k1_reward is k1 (it enters the reward, not the loss).
    """
    d = logp - ref_logp
    if kl_type in ("k1", "k1_reward"):
        return d
    if kl_type == "k2":
        return 0.5 * d * d
    if kl_type == "k3":
        # Beyond these bounds the value already exceeds value_max (y - log y - 1 >= (y - 2) / 2 for y >= 2),
        # so bounding x changes no value below the cap.
        x = (-d).clamp(-(value_max + 1.0), math.log(2.0 * value_max + 2.0))
        return (torch.exp(x) - x - 1.0).clamp(max=value_max)
    raise ValueError(f"unknown kl_type {kl_type!r}")


def interpolate_proximal(behav_logp: torch.Tensor, logp: torch.Tensor, lag: torch.Tensor) -> torch.Tensor:
    """AReaL's log-linear proximal logprobs: behav + lag / (lag + 1) * (logp - behav), detached.

    `lag` = (s - 1) - v per token (v: the version that sampled it, s: this step), >= 0; the current policy
    counts as version s and the proximal one as s - 1, so alpha = (v_prox - v) / (v_theta - v).
    A token of the proximal version itself (lag 0) gets its behaviour logprob.
    """
    lag = lag.to(torch.float32).clamp(min=0.0)
    alpha = lag / (lag + 1.0)
    behav = behav_logp.to(torch.float32)
    return (behav + alpha * (logp.detach().to(torch.float32) - behav)).detach()


Number = float | torch.Tensor


def _add(a: Number | None, b: Number) -> Number:
    return b if a is None else a + b


class Stats:
    """Token-weighted means and maxima, mergeable across micro-batches and ranks.

    Values may be device tensors: they stay on the device (adding them launches no sync) until
    `result` or `all_reduce` reads everything back in one transfer.
    """

    def __init__(self) -> None:
        self.sums: dict[str, Number] = {}
        self.counts: dict[str, Number] = {}
        self.maxes: dict[str, Number] = {}

    def add_mean(self, name: str, total: Number, count: Number) -> None:
        self.sums[name] = _add(self.sums.get(name), _detach(total))
        self.counts[name] = _add(self.counts.get(name), _detach(count))

    def add_max(self, name: str, value: Number) -> None:
        value = _detach(value)
        old = self.maxes.get(name)
        if old is None:
            self.maxes[name] = value
        elif isinstance(old, torch.Tensor) or isinstance(value, torch.Tensor):
            dev = value.device if isinstance(value, torch.Tensor) else old.device
            self.maxes[name] = torch.maximum(torch.as_tensor(old, dtype=torch.float64, device=dev),
                                             torch.as_tensor(value, dtype=torch.float64, device=dev))
        else:
            self.maxes[name] = max(old, value)

    def merge(self, other: "Stats") -> None:
        for k in other.sums:
            self.add_mean(k, other.sums[k], other.counts[k])
        for k, v in other.maxes.items():
            self.add_max(k, v)

    def materialize(self) -> None:
        """Replace every tensor by a float, with one device-to-host copy per device."""
        slots: list[tuple[dict[str, Any], str]] = [(d, k) for d in (self.sums, self.counts, self.maxes) for k in d
                                                   if isinstance(d[k], torch.Tensor)]
        by_dev: dict[Any, list[tuple[dict[str, Any], str]]] = {}
        for d, k in slots:
            by_dev.setdefault(d[k].device, []).append((d, k))
        for group in by_dev.values():
            vals = torch.stack([d[k].to(torch.float64).reshape(()) for d, k in group]).tolist()
            for (d, k), v in zip(group, vals):
                d[k] = float(v)

    def all_reduce(self, group=None) -> None:
        """Sum means and max maxima over ranks; every rank must hold the same keys."""
        import torch.distributed as dist

        self.materialize()
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
        self.materialize()
        out = {k: (float(self.sums[k]) / float(self.counts[k]) if self.counts[k] else 0.0) for k in self.sums}
        out.update({k: (float(v) if v != -float("inf") else 0.0) for k, v in self.maxes.items()})
        return out


def _detach(x: Number) -> Number:
    return x.detach() if isinstance(x, torch.Tensor) else float(x)


@dataclass
class LossOutput:
    loss: torch.Tensor
    """This micro-batch's share of the mini-batch loss (differentiable scalar)."""
    stats: Stats = field(default_factory=Stats)
    """Metrics of this micro-batch, weighted by model-token counts (device tensors)."""


def _masked_max(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, torch.full_like(x, -float("inf"))).max()


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
    seq_ids: torch.Tensor | None = None,
    n_seqs: int = 0,
    seq_mask: torch.Tensor | None = None,
) -> LossOutput:
    """Loss of one micro-batch; all inputs Tensor[B, T] aligned on the same tokens.

    logp: current logprobs (with grad); old_logp: the ratio's denominator (see module doc);
    advantages: per-token advantages (with kl_type=k1_reward already lowered by the KL penalty's return);
    mask: 1 = model token; weights: `token_weights` of the mini-batch (zero off the mask);
    rollout_logp: the behaviour logprobs (for the importance weight, masking and the mismatch metrics; in
    rollout mode it is `old_logp`); ref_logp: frozen reference logprobs (needed when kl_coef > 0);
    entropy: per-token entropy of the current policy (with grad when entropy_coef > 0);
    seq_ids: per position, the index (0..n_seqs-1) of the episode it belongs to, -1 elsewhere (needed by
    tis_level=sequence, whose weight is a product over each episode's tokens); seq_mask: the tokens that
    product runs over (default `mask`; the mask before rollout_rs rejected tokens from it, as in verl).
    Nothing here reads a value back to the host.
    """
    f32 = torch.float32
    m = mask.to(torch.bool)
    mf = m.to(f32)
    n_tok = mf.sum()
    w = weights.to(f32)
    adv = advantages.to(f32)
    old_logp = old_logp.to(f32)
    log_ratio = (logp - old_logp) * mf
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    pg = torch.maximum(pg1, pg2)
    stats = Stats()
    if cfg.dual_clip is not None:
        dual = -adv * cfg.dual_clip
        stats.add_mean("actor/dual_clip_frac", ((adv < 0) & (pg > dual) & m).sum(), n_tok)
        pg = torch.where(adv < 0, torch.minimum(pg, dual), pg)

    if cfg.old_logprobs == "recompute":
        if rollout_logp is not None:
            # w = pi_prox / mu per token (detached): importance weight and masking threshold.
            log_w_raw = ((old_logp - rollout_logp.to(f32)) * mf).detach()
            log_w = log_w_raw.clamp(-20.0, 20.0)
            raw_w = torch.exp(log_w)
            # k3 estimate of KL(mu || pi_prox) from tokens sampled by mu
            stats.add_mean("mismatch/kl_behaviour_proximal", ((raw_w - 1.0 - log_w) * mf).sum(), n_tok)
            if cfg.tis_cap is not None:
                if cfg.tis_level == "sequence":
                    if seq_ids is None:
                        raise ValueError("algo.tis_level=sequence needs seq_ids")
                    from agentloop.train.trainer.rollout_correction import sequence_log_ratio

                    # verl's rollout_is=sequence: the product of the episode's token ratios, from the summed
                    # (unbounded) log-ratios, bounded once
                    sm = mf if seq_mask is None else seq_mask.to(f32)
                    log_seq = sequence_log_ratio((old_logp - rollout_logp.to(f32)).detach(), sm, seq_ids, n_seqs)
                    w_is = torch.exp(log_seq.clamp(-20.0, 20.0)) * mf
                else:
                    w_is = raw_w
                tis_w = w_is.clamp(max=cfg.tis_cap)
                stats.add_mean("mismatch/tis_weight_mean", (tis_w * mf).sum(), n_tok)
                stats.add_mean("mismatch/tis_capped_frac", ((w_is > cfg.tis_cap) & m).sum(), n_tok)
                pg = pg * tis_w
            if cfg.mask_ratio_low is not None or cfg.mask_ratio_high is not None:
                out = torch.zeros_like(m)
                if cfg.mask_ratio_low is not None:
                    out |= raw_w < cfg.mask_ratio_low
                if cfg.mask_ratio_high is not None:
                    out |= raw_w > cfg.mask_ratio_high
                out &= m
                stats.add_mean("mismatch/masked_frac", out.sum(), n_tok)
                pg = torch.where(out, torch.zeros_like(pg), pg)
    else:
        rollout_logp = old_logp

    per_token = pg
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        ref = ref_logp.to(f32)
        if cfg.kl_type != "k1_reward":
            kl = kl_estimate(logp, ref, cfg.kl_type, value_max=cfg.kl_value_max)
            per_token = per_token + cfg.kl_coef * kl
            stats.add_mean("actor/kl_penalty", (kl.detach() * mf).sum(), n_tok)
        # The reported KL is always the k3 value estimate of KL(pi||ref) (unbiased, >= 0), whatever the
        # term optimized, so runs with different kl_type compare.
        stats.add_mean("actor/kl_ref", (kl_estimate(logp.detach(), ref, "k3", value_max=1e6) * mf).sum(), n_tok)
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
        stats.add_max("actor/ratio_max", _masked_max(ratio, m))
        if rollout_logp is not None:
            learner_lp = old_logp if cfg.old_logprobs == "recompute" else logp.detach()
            diff = ((learner_lp - rollout_logp.to(f32)).abs() * mf).to(f32)
            stats.add_mean("mismatch/logprob_abs_diff_mean", diff.sum(), n_tok)
            stats.add_max("mismatch/logprob_abs_diff_max", _masked_max(diff, m))
    return LossOutput(loss=loss, stats=stats)


__all__ = ["LossOutput", "Stats", "aggregate", "interpolate_proximal", "kl_estimate", "policy_loss",
           "token_weights"]
