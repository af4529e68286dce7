"""verl's order of a step, for the two verl features that need the step-start logprobs before any
advantage exists: the KL penalty in the reward (algo.use_kl_in_reward) and rejection sampling
(algo.rollout_rs). The learner runs its no-grad passes (old, reference) first, then `apply_verl_order`
rewrites each micro-batch's loss mask, aggregation weights and advantages, as verl's trainer does between
`apply_kl_penalty` / `compute_rollout_correction_and_add_to_batch` and `compute_advantage` (verl 0.9.1:
tests/unit/train/test_verl_parity.py runs verl's own functions on the same batches).

Map:
    kl_penalty          verl's per-token penalties (kl, abs, mse, low_var_kl) of d = old - ref
    KLController        verl's fixed / adaptive beta (a plain synchronous class; the learner keeps one)
    reweight            a micro-batch's `token_weights` again, from its (rejection-)modified loss mask
    apply_verl_order    rejection -> penalised rewards -> advantages -> weights, over every micro-batch of
                        the step on this rank; per-episode sums cross ranks through one all-reduce

What the estimators see (verl's compute_advantage on token_level_rewards = scores - beta * kld):
    grpo, rloo     the episode reward minus beta * the episode's summed penalty, then the estimator as usual
                   (groups of one, std, eps: agentloop.train.batch.advantages); one advantage per episode
    reinforce_pp   per token, the return-to-go G_t = reward - beta * (penalties of the kept model tokens from t
                   to the episode's end), whitened over all kept model tokens of the step
                   (`algo.reinforce_pp_whiten`: ours, or verl's masked_whiten). verl's return skips every mask-0
                   position and carries the sum through it: tool tokens and rejected tokens add nothing, as here.
                   One difference: verl places the score on the response's last position, so an episode whose
                   response ends with tool tokens (or whose last token was rejected) loses its score in verl;
                   here the reward always counts
Rejected tokens (rollout_rs) leave the loss mask, the token-mean denominator and REINFORCE++'s returns and
whitening; a fully rejected episode still counts as one of its mini-batch's sequences under seq-mean-* (verl's
trainer divides by the mini-batch's episode count, ppo_mini_batch_size x n); grpo/rloo group statistics keep
every episode, as verl's (its scores are unmasked sums). The grpo/rloo penalty is summed over every model token,
rejected or not (verl applies the KL before the rejection), and so is the log-ratio of a sequence-level
importance weight (`MicroBatch.model_mask`: verl weighs before it rejects).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from agentloop.train.config import AlgoConfig
from agentloop.train.trainer.losses import token_weights
from agentloop.train.trainer.rollout_correction import parse_rollout_rs, rejection_keep, seq_broadcast, seq_sum

if TYPE_CHECKING:
    from agentloop.train.batch.episodes import Prepared
    from agentloop.train.trainer.collate import MicroBatch


def kl_penalty(old: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """verl's core_algos.kl_penalty forward values, d = old - ref: kl/k1 d, abs |d|, mse/k2 d^2 / 2,
    low_var_kl/k3 exp(-d) + d - 1 with -d bounded to [-20, 20] and the value to [-10, 10]."""
    d = old - ref
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("mse", "k2"):
        return 0.5 * d * d
    if kind in ("low_var_kl", "k3"):
        x = (-d).clamp(-20.0, 20.0)
        return (torch.exp(x) - x - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl_penalty {kind!r}")


class KLController:
    """beta of the KL in the reward: fixed, or adapted toward `kl_ctrl_target` (verl's AdaptiveKLController)."""

    def __init__(self, algo: AlgoConfig):
        self.adaptive = algo.kl_ctrl == "adaptive"
        self.value = float(algo.kl_ctrl_coef)
        self.target = float(algo.kl_ctrl_target)
        self.horizon = int(algo.kl_ctrl_horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """After a step whose mean per-episode penalty was `current_kl`, over `n_steps` episodes."""
        if not self.adaptive:
            return
        err = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon


def reweight(mb: "MicroBatch", mode: str, num_tokens: float, num_seqs: float) -> None:
    """mb.weights from mb.loss_mask, per episode span, with the mini-batch's totals (losses.token_weights)."""
    w = torch.zeros_like(mb.weights)
    for row, start, k in mb.spans:
        m = mb.loss_mask[row, start:start + k].to(torch.float64)[None]
        w[row, start:start + k] = token_weights(m, mode, num_tokens=num_tokens, num_seqs=num_seqs)[0].to(w.dtype)
    mb.weights = w


def apply_verl_order(
    plans: Sequence[Sequence["MicroBatch"]],
    minis: Sequence[Sequence[int]],
    prepared: "Prepared",
    algo: AlgoConfig,
    beta: float,
    *,
    all_reduce: Callable[[torch.Tensor], None] = lambda t: None,
) -> tuple[dict[str, float], float]:
    """Rewrite loss masks, weights and advantages of `plans` (this rank's micro-batches of each mini-batch
    `minis[j]`, no-grad logprobs filled) in verl's order; returns (metrics, the step's mean per-episode
    penalty for the KL controller). `all_reduce` sums a tensor over ranks in place."""
    from agentloop.train.batch.advantages import compute_advantages
    from agentloop.train.trainer.collate import episode_return

    eps = prepared.episodes
    n = len(eps)
    mbs = [mb for plan in plans for mb in plan if mb.episode_ids]
    if not mbs and n == 0:
        return {}, 0.0
    device = mbs[0].loss_mask.device if mbs else torch.device("cpu")
    rules = parse_rollout_rs(algo.rollout_rs, algo.rollout_rs_threshold) if algo.rollout_rs is not None else None
    kl_on = algo.use_kl_in_reward
    f64 = torch.float64
    # per episode: [summed penalty, kept model tokens]
    sums = torch.zeros(2, n, dtype=f64, device=device)
    kld: dict[int, torch.Tensor] = {}
    for mb in mbs:
        ns = len(mb.spans)
        ids = torch.tensor(mb.episode_ids, dtype=torch.int64, device=device)
        old = mb.old_logprobs if (algo.old_logprobs == "recompute" and mb.old_logprobs is not None) \
            else mb.rollout_logprobs
        mask = mb.loss_mask.to(torch.float32)
        if kl_on:
            if mb.ref_logprobs is None:
                raise ValueError("algo.use_kl_in_reward needs the reference logprobs")
            kld[id(mb)] = kl_penalty(old.to(torch.float32), mb.ref_logprobs.to(torch.float32), algo.kl_penalty) * mask
            sums[0].index_add_(0, ids, seq_sum(kld[id(mb)].to(f64), mb.seq_ids, ns))
        if rules is not None:
            mb.model_mask = mb.loss_mask.clone()
            keep = rejection_keep((old - mb.rollout_logprobs).to(torch.float32), mask, mb.seq_ids, ns, rules)
            mb.loss_mask = keep.to(mb.loss_mask.dtype)
        sums[1].index_add_(0, ids, seq_sum(mb.loss_mask.to(f64), mb.seq_ids, ns))
    all_reduce(sums)
    kl_sum, kept = sums[0].cpu(), sums[1].cpu()
    model_tokens = torch.from_numpy(eps.model_tokens.astype(np.float64))
    metrics: dict[str, float] = {}
    current_kl = 0.0
    if kl_on:
        current_kl = float((kl_sum / model_tokens.clamp(min=1.0)).mean()) if n else 0.0
        metrics["actor/reward_kl_penalty"] = current_kl
        metrics["actor/reward_kl_penalty_coeff"] = beta
    if rules is not None:
        metrics["mismatch/rs_masked_frac"] = float(1.0 - kept.sum() / model_tokens.sum().clamp(min=1.0))
        metrics["mismatch/rs_seq_masked_frac"] = float((kept < model_tokens).to(f64).mean()) if n else 0.0
        for idxs, plan in zip(minis, plans):
            num_tokens = float(kept[list(idxs)].sum())
            # every episode of the mini-batch, a fully rejected one too: verl's trainer passes the mini-batch
            # size (ppo_mini_batch_size x n) to agg_loss as the seq-mean denominator
            num_seqs = float(len(idxs))
            for mb in plan:
                if mb.episode_ids:
                    reweight(mb, algo.loss_agg_mode, num_tokens, num_seqs)

    if algo.estimator == "reinforce_pp":
        from agentloop.train.batch.advantages import whiten_scale

        # token-level: the return-to-go of (reward at the end - beta * penalty per kept token), whitened over
        # the kept tokens of the whole step
        g: dict[int, torch.Tensor] = {}
        mom = torch.zeros(3, dtype=f64, device=device)
        for mb in mbs:
            reward = torch.from_numpy(eps.reward[mb.episode_ids]).to(device=device, dtype=torch.float32)
            ret = seq_broadcast(reward, mb.seq_ids)
            if kl_on:
                ret = ret - beta * episode_return(mb, kld[id(mb)] * mb.loss_mask.to(torch.float32))
            m = mb.loss_mask.to(f64)
            g[id(mb)] = ret
            mom += torch.stack([(ret.to(f64) * m).sum(), (ret.to(f64) ** 2 * m).sum(), m.sum()])
        all_reduce(mom)
        count = float(mom[2])
        mean = float(mom[0]) / max(count, 1.0)
        scale = whiten_scale(float(mom[1]) / max(count, 1.0) - mean * mean, count, algo)
        for mb in mbs:
            mb.advantages = ((g[id(mb)] - mean) * scale * mb.loss_mask).to(mb.advantages.dtype)
        return metrics, current_kl

    # grpo, rloo and registered per-episode estimators (numpy, agentloop.train.batch.advantages): the penalised
    # episode reward, the same groups
    rewards = np.array(prepared.ok_rewards, dtype=np.float64)
    pos = np.asarray(prepared.ok_episode, dtype=np.int64)
    has = pos >= 0
    if kl_on:
        rewards[has] = rewards[has] - beta * kl_sum.numpy()[pos[has]]
    lengths = np.array(prepared.ok_lengths, dtype=np.int64)
    lengths[has] = np.round(kept.numpy()[pos[has]]).astype(np.int64)
    adv = compute_advantages(rewards, prepared.ok_groups, lengths, algo)
    per_ep = torch.zeros(n, dtype=f64)
    per_ep[torch.from_numpy(pos[has])] = torch.from_numpy(adv.values[has])
    dev_adv = per_ep.to(device=device, dtype=torch.float32)
    for mb in mbs:
        ids = torch.tensor(mb.episode_ids, dtype=torch.int64, device=device)
        mb.advantages = (seq_broadcast(dev_adv[ids], mb.seq_ids) * mb.loss_mask).to(mb.advantages.dtype)
    v = per_ep
    if n:
        metrics.update({"adv/mean": float(v.mean()), "adv/std": float(v.std(unbiased=False)),
                        "adv/abs_max": float(v.abs().max())})
    return metrics, current_kl


__all__ = ["KLController", "apply_verl_order", "kl_penalty", "reweight"]
