"""verl's algorithm settings against our keys, differentially: each verl rule is re-implemented here from
verl's documented behaviour (core_algos.compute_policy_loss_vanilla, rollout_corr_helper, ray_trainer's
apply_kl_penalty + compute_advantage; verl b178a3cd) and our loss / step preparation must give its numbers.

    dual clip (actor.clip_ratio_c=3)           algo.dual_clip=3
    rollout_is=token, threshold 2              algo.tis_cap=2 (tis_level=token)
    rollout_is=sequence                        algo.tis_level=sequence
    rollout_rs=<options>, rollout_rs_threshold algo.rollout_rs / algo.rollout_rs_threshold
    use_kl_in_reward + kl_penalty + kl_ctrl    algo.use_kl_in_reward / kl_penalty / kl_ctrl*
"""

from __future__ import annotations

import math

import pytest
import torch

from agentloop.records import EpisodeRecord
from agentloop.train.batching import kl_reward_advantages, plan_micro_batches, prepare_episodes
from agentloop.train.config import AlgoConfig
from agentloop.train.losses import policy_loss, token_weights
from agentloop.train.rollout_correction import RS_OPTIONS, parse_rollout_rs, rejection_keep
from agentloop.train.verl_order import KLController, apply_verl_order, kl_penalty

# ---- verl's rules, re-implemented for the comparison -----------------------------------------------------


def verl_pg_losses(old, logp, adv, lo=0.2, hi=0.2, c=3.0, is_w=None):
    """compute_policy_loss_vanilla's per-token matrix (dual clip always on, IS weights multiplied after)."""
    ratio = torch.exp((logp - old).clamp(-20.0, 20.0))
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1 - lo, 1 + hi)
    clip1 = torch.maximum(pg1, pg2)
    clip2 = torch.minimum(-adv * c, clip1)
    pg = torch.where(adv < 0, clip2, clip1)
    return pg if is_w is None else pg * is_w


def verl_token_mean(mat, mask):
    return (mat * mask).sum() / mask.sum()


def verl_is_weights(old, rollout, mask, level, threshold):
    """compute_rollout_correction_weights: exp of the (summed, for sequence) log-ratio bounded to +-20, zeroed
    off the mask, truncated at the threshold."""
    lr = old - rollout
    if level == "token":
        w = torch.exp(lr.clamp(-20.0, 20.0))
    else:
        w = torch.exp((lr * mask).sum(-1, keepdim=True).clamp(-20.0, 20.0)).expand_as(lr)
    return (w * mask).clamp(max=threshold)


def verl_rs_keep(log_ratio, mask, options, threshold):
    """compute_rollout_rejection_mask, rows = sequences: the modified response mask."""
    specs = [str(threshold)] if isinstance(threshold, float) else threshold.split(",")
    opts = options.split(",")
    specs = specs * len(opts) if len(specs) == 1 else specs
    lr = log_ratio.clamp(-20.0, 20.0)
    stats = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1 - lr}
    keep = torch.ones_like(mask)
    for opt, spec in zip(opts, specs):
        kind = opt[-2:]
        if kind == "k1":
            lo, hi = (spec.split("_") if "_" in spec else (str(1 / float(spec)), spec))
            lo, hi = math.log(float(lo)), math.log(float(hi))
        else:
            lo, hi = None, float(spec)
        t = stats[kind]
        if opt.startswith("token"):
            v = t
        elif opt.startswith("seq_sum"):
            v = (t * mask).sum(-1, keepdim=True).expand_as(t)
        elif opt.startswith("seq_mean"):
            v = ((t * mask).sum(-1) / (mask.sum(-1) + 1e-8)).unsqueeze(-1).expand_as(t)
        else:
            mx = t.masked_fill(mask == 0, -float("inf")).max(-1).values
            v = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx).unsqueeze(-1).expand_as(t)
        ok = v <= hi
        if lo is not None:
            ok &= v >= lo
        keep = keep * ok.to(keep.dtype)
    return mask * keep


def verl_grpo(scores, index, eps=1e-6):
    """compute_grpo_outcome_advantage on per-sequence scores (groups of >= 2 here)."""
    out = scores.clone()
    for g in set(index):
        sel = torch.tensor([i == g for i in index])
        s = scores[sel]
        out[sel] = (s - s.mean()) / (s.std() + eps)
    return out


# ---- the batch the loss tests share ----------------------------------------------------------------------


def _batch(seed=0, b=4, t=9):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 3
    old = logp + 0.8 * torch.randn(b, t, generator=g)  # ratios far from 1: both clips and the dual clip bind
    rollout = old + 0.9 * torch.randn(b, t, generator=g)  # importance weights above and below the cap
    adv = torch.randn(b, 1, generator=g).expand(b, t).clone()
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    mask[:, 0] = 1.0
    return logp, old, rollout, adv, mask


def test_dual_clip_and_token_tis_equal_verls_vanilla_loss_with_rollout_is_token():
    """verl: clip_ratio_c=3 (always), rollout_is=token with threshold 2 -> ours: dual_clip=3, tis_cap=2."""
    logp, old, rollout, adv, mask = _batch()
    cfg = AlgoConfig(clip_ratio_low=0.2, clip_ratio_high=0.2, dual_clip=3.0, tis_cap=2.0)
    lp = logp.clone().requires_grad_(True)
    ours = policy_loss(lp, old, adv, mask, token_weights(mask, "token-mean"), cfg, rollout_logp=rollout)
    ours.loss.backward()
    lv = logp.clone().requires_grad_(True)
    theirs = verl_token_mean(verl_pg_losses(old, lv, adv, is_w=verl_is_weights(old, rollout, mask, "token", 2.0)),
                             mask)
    theirs.backward()
    theirs = theirs.detach()
    assert float(ours.loss.detach()) == pytest.approx(float(theirs), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(lp.grad, lv.grad, rtol=1e-5, atol=1e-7)
    # the batch exercises both: without the dual clip, or without the weights, verl's number is another one
    plain = verl_token_mean(verl_pg_losses(old, logp, adv, c=1e9,
                                           is_w=verl_is_weights(old, rollout, mask, "token", 2.0)), mask)
    unweighted = verl_token_mean(verl_pg_losses(old, logp, adv), mask)
    assert abs(float(plain) - float(theirs)) > 1e-3 and abs(float(unweighted) - float(theirs)) > 1e-3


def test_verl_default_is_dual_clip_and_no_importance_weight():
    """verl's default (rollout_correction off) -> ours: tis_cap=null, dual_clip=3."""
    logp, old, rollout, adv, mask = _batch()
    cfg = AlgoConfig(clip_ratio_high=0.2, dual_clip=3.0, tis_cap=None)
    ours = policy_loss(logp, old, adv, mask, token_weights(mask, "token-mean"), cfg, rollout_logp=rollout)
    assert float(ours.loss) == pytest.approx(float(verl_token_mean(verl_pg_losses(old, logp, adv), mask)), rel=1e-6)
    ours_default = policy_loss(logp, old, adv, mask, token_weights(mask, "token-mean"), AlgoConfig(),
                               rollout_logp=rollout)
    assert abs(float(ours_default.loss) - float(ours.loss)) > 1e-3  # our defaults are not verl's


def test_sequence_tis_equals_verls_rollout_is_sequence_also_packed():
    """rollout_is=sequence -> tis_level=sequence: one weight per episode, min(prod of ratios, threshold); the
    same numbers when two episodes share a packed row (seq_ids)."""
    logp, old, _, adv, mask = _batch(seed=2)
    rollout = old + 0.35 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3))
    cfg = AlgoConfig(clip_ratio_high=0.2, dual_clip=3.0, tis_cap=2.0, tis_level="sequence")
    w = token_weights(mask, "token-mean")
    seq_ids = torch.arange(4).unsqueeze(-1).expand(4, 9).contiguous()
    ours = policy_loss(logp, old, adv, mask, w, cfg, rollout_logp=rollout, seq_ids=seq_ids, n_seqs=4)
    is_w = verl_is_weights(old, rollout, mask, "sequence", 2.0)
    theirs = verl_token_mean(verl_pg_losses(old, logp, adv, is_w=is_w), mask)
    assert float(ours.loss) == pytest.approx(float(theirs), rel=1e-6)
    assert 0 < float((is_w.max(-1).values >= 2.0).sum()) < 4  # some episodes capped, some not
    token = policy_loss(logp, old, adv, mask, w, AlgoConfig(clip_ratio_high=0.2, dual_clip=3.0, tis_cap=2.0),
                        rollout_logp=rollout)
    assert abs(float(token.loss) - float(theirs)) > 1e-4
    # rows 0+1 and 2+3 packed into two rows of 18 positions
    cat = lambda x: torch.cat([x[0::2], x[1::2]], dim=1)  # noqa: E731
    packed_ids = torch.cat([torch.zeros(2, 9, dtype=torch.int64), torch.ones(2, 9, dtype=torch.int64)], dim=1)
    packed_ids[1] += 2
    packed = policy_loss(cat(logp), cat(old), cat(adv), cat(mask), cat(w), cfg, rollout_logp=cat(rollout),
                         seq_ids=packed_ids, n_seqs=4)
    assert float(packed.loss) == pytest.approx(float(theirs), rel=1e-6)


@pytest.mark.parametrize("options,threshold", [
    ("token_k1", "0.6_1.4"), ("token_k1", 1.5), ("token_k2", 0.3), ("token_k3", 0.2),
    ("seq_sum_k1", "0.5_2.0"), ("seq_sum_k2", 1.0), ("seq_sum_k3", 0.8), ("seq_mean_k1", "0.8_1.25"),
    ("seq_mean_k2", 0.1), ("seq_mean_k3", 0.1), ("seq_max_k2", 0.5), ("seq_max_k3", 0.5),
    ("token_k1,seq_mean_k3", "0.5_2.0,0.1"),
])
def test_rejection_masks_equal_verls(options, threshold):
    g = torch.Generator().manual_seed(sum(map(ord, options)))
    log_ratio = 0.5 * torch.randn(6, 12, generator=g)
    mask = (torch.rand(6, 12, generator=g) > 0.25).float()
    mask[5] = 0.0  # a sequence without model tokens
    seq_ids = torch.arange(6).unsqueeze(-1).expand(6, 12).contiguous()
    ours = rejection_keep(log_ratio, mask, seq_ids, 6, parse_rollout_rs(options, threshold)).float()
    theirs = verl_rs_keep(log_ratio, mask, options, threshold)
    torch.testing.assert_close(ours, theirs)
    assert 0 < float(theirs.sum()) < float(mask.sum())  # the thresholds reject some, not all


def test_every_verl_rs_option_parses_and_bad_specs_are_named():
    for opt in RS_OPTIONS:
        parse_rollout_rs(opt, "0.5_2.0" if opt.endswith("k1") else 1.0)
    with pytest.raises(ValueError, match="'seq_max_k1' is not one of"):
        parse_rollout_rs("seq_max_k1", 2.0)
    with pytest.raises(ValueError, match="needs algo.rollout_rs_threshold"):
        parse_rollout_rs("token_k1", None)
    with pytest.raises(ValueError, match="one positive number"):
        parse_rollout_rs("token_k2", "0.5_2.0")
    with pytest.raises(ValueError, match="2 entries for 3 options"):
        parse_rollout_rs("token_k1,token_k2,token_k3", "2.0,1.0")
    with pytest.raises(ValueError, match="rollout_rs needs algo.old_logprobs=recompute"):
        AlgoConfig(rollout_rs="token_k1", rollout_rs_threshold=2.0, old_logprobs="rollout", tis_cap=None)
    with pytest.raises(ValueError, match="is not one of"):
        AlgoConfig(rollout_rs="bogus", rollout_rs_threshold=2.0)


# ---- verl's order: KL in the reward and rejection before the estimator -----------------------------------


def _records(seed=0, groups=2, n=4):
    g = torch.Generator().manual_seed(seed)
    recs = []
    for idx in range(groups):
        prompt = torch.randint(0, 50, (4,), generator=g).tolist()
        for rep in range(n):
            r = int(torch.randint(4, 9, (1,), generator=g))
            mask = [1] * r
            if r > 5:
                mask[2] = mask[3] = 0  # a tool segment
            recs.append(EpisodeRecord(
                prompt_ids=prompt, response_ids=torch.randint(0, 50, (r,), generator=g).tolist(),
                response_mask=mask, response_logprobs=[-2.0 * m for m in mask], reward=float((rep * 7 + idx) % 3),
                episode_id=f"{idx}-{rep}", index=idx, repeat=rep, data_source="t", loop="x", seed=rep, step=1))
    return recs


def _planned(recs, algo, seed=0, mini=2, layout="padded", share="off"):
    """Prepared episodes, mini-batches of one rank, and per-episode (old, ref, rollout) token logprobs placed
    into every micro-batch."""
    prepared = prepare_episodes(recs, algo)
    eps = prepared.episodes
    g = torch.Generator().manual_seed(seed + 100)
    per_ep = [(-torch.rand(len(e.response_mask), generator=g) * 3) for e in eps]
    ref = [lp + 0.4 * torch.randn(lp.shape, generator=g) for lp in per_ep]
    rollout = [lp + 0.3 * torch.randn(lp.shape, generator=g) for lp in per_ep]
    minis = [list(range(len(eps)))[i::mini] for i in range(mini)]
    from agentloop.train.flops import RowCost

    plans = [plan_micro_batches(eps, idxs, algo.loss_agg_mode, budget=40, layout=layout, share=share,
                                cost=RowCost(1000.0, 10.0)) for idxs in minis]
    for plan in plans:
        for mb in plan:
            mb.old_logprobs = torch.zeros_like(mb.rollout_logprobs)
            mb.ref_logprobs = torch.zeros_like(mb.rollout_logprobs)
            for i, (row, s, k) in zip(mb.episode_ids, mb.spans):
                mb.old_logprobs[row, s:s + k] = per_ep[i]
                mb.ref_logprobs[row, s:s + k] = ref[i]
                mb.rollout_logprobs[row, s:s + k] = rollout[i]
    return prepared, minis, plans, per_ep, ref, rollout


def _per_episode_adv(plans):
    out = {}
    for plan in plans:
        for mb in plan:
            for i, (row, s, k) in zip(mb.episode_ids, mb.spans):
                m = mb.loss_mask[row, s:s + k] > 0
                vals = mb.advantages[row, s:s + k][m]
                out[i] = vals
    return out


@pytest.mark.parametrize("penalty", ["kl", "abs", "mse", "low_var_kl"])
@pytest.mark.parametrize("layout,share", [("padded", "off"), ("packed", "on")])
def test_kl_in_reward_grpo_equals_verls_order(penalty, layout, share):
    """verl: token_level_rewards = score at the last token - beta * kld, GRPO on their sum. Ours:
    use_kl_in_reward with kl_penalty, whatever the layout. Our older k1_reward order gives other numbers."""
    algo = AlgoConfig(use_kl_in_reward=True, kl_penalty=penalty, kl_ctrl_coef=0.5)
    recs = _records()
    prepared, minis, plans, old, ref, _ = _planned(recs, algo, layout=layout, share=share)
    eps = prepared.episodes
    before = _per_episode_adv(plans)
    metrics, current_kl = apply_verl_order(plans, minis, prepared, algo, 0.5)
    ours = _per_episode_adv(plans)
    masks = [torch.tensor(e.response_mask, dtype=torch.float32) for e in eps]
    kld = [kl_penalty(o, r, penalty) * m for o, r, m in zip(old, ref, masks)]
    scores = torch.tensor([e.reward for e in eps]) - 0.5 * torch.stack([k.sum() for k in kld])
    index = [(r.index) for r in recs]  # every record entered (all have model tokens)
    theirs = verl_grpo(scores, index)
    for i in range(len(eps)):
        torch.testing.assert_close(ours[i], torch.full_like(ours[i], float(theirs[i])), rtol=1e-5, atol=1e-5)
    assert current_kl == pytest.approx(float(torch.stack([(k.sum() / m.sum()) for k, m in zip(kld, masks)]).mean()),
                                       rel=1e-5)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    # the k1_reward order (penalty's return subtracted from the normalised advantage) is another estimator
    if penalty == "kl":
        mb = plans[0][0]
        old_order, _ = kl_reward_advantages(mb, before_mb_adv(mb, before), mb.old_logprobs, mb.ref_logprobs, 0.5)
        assert not torch.allclose(old_order, mb.advantages, atol=1e-3)


def before_mb_adv(mb, before):
    adv = torch.zeros_like(mb.advantages)
    for i, (row, s, k) in zip(mb.episode_ids, mb.spans):
        adv[row, s:s + k] = before[i][0] * mb.loss_mask[row, s:s + k]
    return adv


def test_kl_in_reward_reinforce_pp_whitens_each_tokens_return_to_go():
    """reinforce_pp (verl's reinforce_plus_plus with gamma 1): G_t = reward - beta * sum of penalties from t to
    the end, whitened over all model tokens of the step (our whitening: biased std + adv_eps)."""
    algo = AlgoConfig(estimator="reinforce_pp", use_kl_in_reward=True, kl_ctrl_coef=0.3)
    prepared, minis, plans, old, ref, _ = _planned(_records(seed=4), algo)
    eps = prepared.episodes
    apply_verl_order(plans, minis, prepared, algo, 0.3)
    ours = _per_episode_adv(plans)
    returns = []
    for e, o, r in zip(eps, old, ref):
        m = torch.tensor(e.response_mask, dtype=torch.float32)
        pen = (o - r) * m
        suffix = pen.flip(0).cumsum(0).flip(0)
        returns.append((e.reward - 0.3 * suffix)[m > 0])
    allg = torch.cat(returns)
    mean, std = allg.mean(), allg.std(unbiased=False)
    for i, g_t in enumerate(returns):
        torch.testing.assert_close(ours[i], (g_t - mean) / (std + algo.adv_eps), rtol=1e-5, atol=1e-5)


def test_rejection_leaves_loss_mask_denominators_and_keeps_group_statistics():
    """verl's modified response mask: rejected tokens get no advantage, leave the token-mean denominator
    (a fully rejected episode leaves seq-mean's), while GRPO's group statistics keep every episode."""
    for mode in ("token-mean", "seq-mean-token-mean"):
        algo = AlgoConfig(rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.6_1.6,0.08",
                          loss_agg_mode=mode)
        prepared, minis, plans, old, _, rollout = _planned(_records(seed=5), algo)
        eps = prepared.episodes
        adv_before = {i: float(e.advantage) for i, e in enumerate(eps)}
        metrics, _ = apply_verl_order(plans, minis, prepared, algo, 0.0)
        for idxs, plan in zip(minis, plans):
            keep = {}
            for i in idxs:
                m = torch.tensor(eps[i].response_mask, dtype=torch.float32)
                keep[i] = verl_rs_keep((old[i] - rollout[i])[None], m[None], "token_k1,seq_max_k3", "0.6_1.6,0.08")[0]
            kept_tokens = sum(float(k.sum()) for k in keep.values())
            kept_seqs = sum(1 for k in keep.values() if k.sum() > 0)
            total_w = 0.0
            for mb in plan:
                for i, (row, s, k) in zip(mb.episode_ids, mb.spans):
                    torch.testing.assert_close(mb.loss_mask[row, s:s + k], keep[i])
                    torch.testing.assert_close(mb.advantages[row, s:s + k], adv_before[i] * keep[i])
                    want = keep[i] / (max(kept_tokens, 1.0) if mode == "token-mean" else
                                      max(float(keep[i].sum()), 1.0) * max(kept_seqs, 1))
                    torch.testing.assert_close(mb.weights[row, s:s + k].float(), want)
                    total_w += float(mb.weights[row, s:s + k].sum())
            assert total_w == pytest.approx(1.0 if kept_tokens else 0.0)
        assert 0 < metrics["mismatch/rs_masked_frac"] < 1 and 0 < metrics["mismatch/rs_seq_masked_frac"] < 1


def test_adaptive_kl_controller_is_verls():
    """AdaptiveKLController: value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon; fixed never moves."""
    c = KLController(AlgoConfig(use_kl_in_reward=True, kl_ctrl="adaptive", kl_ctrl_coef=0.01, kl_ctrl_target=0.1,
                                kl_ctrl_horizon=1000))
    value = 0.01
    for kl, n in [(0.3, 64), (0.05, 64), (0.11, 32)]:
        c.update(kl, n)
        value *= 1 + max(min(kl / 0.1 - 1, 0.2), -0.2) * n / 1000
        assert c.value == pytest.approx(value, rel=1e-12)
    f = KLController(AlgoConfig(use_kl_in_reward=True, kl_ctrl_coef=0.01))
    f.update(5.0, 100)
    assert f.value == 0.01


def test_kl_in_reward_config_rules():
    with pytest.raises(ValueError, match="KL in the reward twice"):
        AlgoConfig(use_kl_in_reward=True, kl_coef=0.1, kl_type="k1_reward")
    with pytest.raises(ValueError, match="use algo.proximal=recompute"):
        AlgoConfig(use_kl_in_reward=True, proximal="interpolate")
    AlgoConfig(use_kl_in_reward=True, kl_coef=0.001, kl_type="k3")  # verl: both on is allowed
