"""Policy loss, aggregation modes, KL/entropy terms and TIS against hand-computed values;
micro-batch accumulation equals the full-batch loss in every aggregation mode."""

from __future__ import annotations

import math

import pytest
import torch

from agentloop.train.batching import (
    Episode,
    RowCost,
    collate,
    collate_shared,
    pack_greedy,
    plan_micro_batches,
    shard_for_rank,
    share_items,
)
from agentloop.train.config import AlgoConfig
from agentloop.train.losses import (
    Stats,
    aggregate,
    kl_estimate,
    policy_loss,
    token_weights,
)

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_aggregation_modes_hand_computed():
    v = _t([1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0])
    m = _t([1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0])  # third row: no model token, counts nowhere
    assert float(aggregate(v, m, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate(v, m, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    assert float(aggregate(v, m, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)


def _lp(*ratios):
    return torch.log(torch.tensor([ratios], dtype=torch.float32))


def test_ppo_clip_asymmetric_hand_computed():
    cfg = AlgoConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, old_logprobs="rollout", tis_cap=None)
    logp = _lp(1.5, 0.5, 1.1, 1.0)
    old = torch.zeros(1, 4)
    adv = _t([1.0, -1.0, -1.0, 5.0])
    mask = _t([1, 1, 1, 0])
    out = policy_loss(logp, old, adv, mask, token_weights(mask, "token-mean"), cfg)
    # token 0: A=+1, r=1.5 -> max(-1.5, -1.28) = -1.28 (clipped high)
    # token 1: A=-1, r=0.5 -> max(0.5, 0.8) = 0.8 (clipped low)
    # token 2: A=-1, r=1.1 -> 1.1 (inside the clip range)
    assert float(out.loss) == pytest.approx((-1.28 + 0.8 + 1.1) / 3, abs=1e-6)
    s = out.stats.result()
    assert s["actor/clip_frac"] == pytest.approx(2 / 3)
    assert s["actor/clip_frac_high"] == pytest.approx(1 / 3)
    assert s["actor/clip_frac_low"] == pytest.approx(1 / 3)
    assert s["actor/ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1) / 3, abs=1e-6)
    assert s["actor/ratio_max"] == pytest.approx(1.5, abs=1e-6)
    k3 = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.1)) / 3
    assert s["actor/approx_kl"] == pytest.approx(k3, abs=1e-6)
    # rollout mode: the mismatch compares current (detached) logprobs with the rollout ones
    assert s["mismatch/logprob_abs_diff_max"] == pytest.approx(math.log(2), abs=1e-6)
    # gradient: only the unclipped token 2 moves: d/dlogp (-A r) / 3 = 1.1 / 3
    logp.requires_grad_(True)
    policy_loss(logp, old, adv, mask, token_weights(mask, "token-mean"), cfg).loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 0.0, 1.1 / 3, 0.0], abs=1e-6)


def test_rollout_mode_dual_clip_caps_negative_advantage_tokens():
    cfg = AlgoConfig(old_logprobs="rollout", tis_cap=2.0)
    logp = _lp(3.0, 3.0)
    adv = _t([-1.0, 1.0])
    mask = _t([1, 1])
    out = policy_loss(logp, torch.zeros(1, 2), adv, mask, token_weights(mask, "seq-mean-token-sum"), cfg)
    # A=-1, r=3: max(3, 1.2) = 3, capped at -A * 2 = 2;  A=+1, r=3: max(-3, -1.28) = -1.28
    assert float(out.loss) == pytest.approx(2.0 - 1.28, abs=1e-6)
    assert out.stats.result()["actor/dual_clip_frac"] == pytest.approx(0.5)


def test_recompute_mode_truncated_importance_weights():
    cfg = AlgoConfig(old_logprobs="recompute", tis_cap=2.0)
    old = torch.log(_t([0.5, 0.5]))
    rollout = torch.log(_t([0.125, 0.4]))  # pi_old / mu = 4 (capped to 2) and 1.25
    logp = old.clone()  # ratio 1
    adv = _t([1.0, 1.0])
    mask = _t([1, 1])
    out = policy_loss(logp, old, adv, mask, token_weights(mask, "token-mean"), cfg, rollout_logp=rollout)
    assert float(out.loss) == pytest.approx(-(2.0 + 1.25) / 2, abs=1e-6)
    s = out.stats.result()
    assert s["mismatch/tis_weight_mean"] == pytest.approx((2.0 + 1.25) / 2, abs=1e-6)
    assert s["mismatch/tis_capped_frac"] == pytest.approx(0.5)
    assert s["mismatch/logprob_abs_diff_mean"] == pytest.approx((math.log(4) + math.log(1.25)) / 2, abs=1e-6)
    assert s["mismatch/logprob_abs_diff_max"] == pytest.approx(math.log(4), abs=1e-6)
    off = policy_loss(logp, old, adv, mask, token_weights(mask, "token-mean"),
                      AlgoConfig(tis_cap=None), rollout_logp=rollout)
    assert float(off.loss) == pytest.approx(-1.0, abs=1e-6)


def test_kl_estimators_and_penalty_and_entropy_bonus():
    logp = torch.log(_t([0.5]))
    ref = torch.log(_t([0.25]))
    assert float(kl_estimate(logp, ref, "k1")) == pytest.approx(math.log(2), abs=1e-6)
    assert float(kl_estimate(logp, ref, "k3")) == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    cfg = AlgoConfig(kl_coef=0.1, kl_type="k1", entropy_coef=0.01, old_logprobs="rollout", tis_cap=None)
    mask = _t([1])
    ent = _t([2.0])
    out = policy_loss(logp, logp.detach(), _t([0.0]), mask, token_weights(mask, "token-mean"), cfg,
                      ref_logp=ref, entropy=ent)
    assert float(out.loss) == pytest.approx(0.1 * math.log(2) - 0.01 * 2.0, abs=1e-6)
    s = out.stats.result()
    assert s["actor/kl_ref"] == pytest.approx(math.log(2), abs=1e-6)
    assert s["actor/entropy"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, logp, _t([0.0]), mask, mask, cfg, entropy=ent)


def _episodes(seed=0, n=7):
    g = torch.Generator().manual_seed(seed)
    eps = []
    for i in range(n):
        p = int(torch.randint(1, 5, (1,), generator=g))
        r = int(torch.randint(1, 9, (1,), generator=g))
        mask = torch.randint(0, 2, (r,), generator=g).tolist()
        mask[0] = 1
        ids = torch.randint(0, 50, (p + r,), generator=g).tolist()
        lps = [(-0.1 * (k + 1) if m else 0.0) for k, m in enumerate(mask)]
        eps.append(Episode(ids, p, mask, lps, advantage=float(i) - 3.0, reward=0.0))
    return eps


def _fake_logp(mb):
    # a deterministic function of the target token and position: stands in for a model
    return -0.01 * mb.targets.float() - 0.001 * mb.position_ids.float()


def _group_episodes(groups=3, n=4, seed=1):
    """GRPO-like groups: the episodes of a group share their prompt tokens."""
    g = torch.Generator().manual_seed(seed)
    eps = []
    for k in range(groups):
        p = int(torch.randint(2, 6, (1,), generator=g))
        prompt = torch.randint(0, 50, (p,), generator=g).tolist()
        for j in range(n):
            r = int(torch.randint(1, 7, (1,), generator=g))
            mask = torch.randint(0, 2, (r,), generator=g).tolist()
            mask[0] = 1
            resp = torch.randint(0, 50, (r,), generator=g).tolist()
            lps = [(-0.1 * (t + 1) if m else 0.0) for t, m in enumerate(mask)]
            eps.append(Episode(prompt + resp, p, mask, lps, advantage=float(j) - 1.5 + k, reward=0.0))
    return eps


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("share", ["off", "on"])
def test_micro_batch_accumulation_equals_full_batch(mode, world, share):
    eps = _episodes() + _group_episodes()
    idxs = list(range(len(eps)))
    cfg = AlgoConfig(loss_agg_mode=mode, old_logprobs="rollout", tis_cap=None)
    full = plan_micro_batches(eps, idxs, mode, budget=10_000)
    assert len(full) == 1
    f = full[0]
    ref_loss = policy_loss(_fake_logp(f), f.rollout_logprobs, f.advantages, f.loss_mask, f.weights, cfg).loss
    # the reference form: aggregate per-token losses over the whole padded batch
    ratio = torch.exp(_fake_logp(f) - f.rollout_logprobs)
    per_tok = torch.maximum(-f.advantages * ratio, -f.advantages * ratio.clamp(0.8, 1.28))
    assert float(ref_loss) == pytest.approx(float(aggregate(per_tok, f.loss_mask, mode)), rel=1e-6)
    total, n_mb, shared_any = 0.0, [], False
    for rank in range(world):
        mbs = plan_micro_batches(eps, idxs, mode, budget=9, rank=rank, world=world, share=share)
        n_mb.append(len(mbs))
        for mb in mbs:
            assert mb.tokens <= 9 or len(mb.episode_ids) == 1
            shared_any = shared_any or mb.shared
            total += float(policy_loss(_fake_logp(mb), mb.rollout_logprobs, mb.advantages, mb.loss_mask,
                                       mb.weights, cfg).loss)
    assert len(set(n_mb)) == 1  # every rank runs the same number of micro-batches
    assert total == pytest.approx(float(ref_loss), rel=1e-6)
    assert shared_any == (share == "on")


def test_share_items_groups_identical_prompts_and_respects_the_budget():
    eps = _group_episodes(groups=2, n=4)
    p0 = eps[0].prompt_len - 1
    items = share_items(eps, list(range(8)), budget=1000, share="on")
    assert items == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert share_items(eps, [3, 1, 6], budget=1000, share="off") == [[1], [3], [6]]
    # a budget that fits two responses: the group is cut into chunks, each with the prompt again
    two = p0 + sorted((e.length - p0 for e in eps[:4]), reverse=True)[0] * 2
    chunks = [it for it in share_items(eps, [0, 1, 2, 3], budget=two, share="on")]
    assert sorted(i for it in chunks for i in it) == [0, 1, 2, 3] and len(chunks) >= 2
    for it in chunks:
        assert p0 + sum(eps[i].length - p0 for i in it) <= two or len(it) == 1
    # same group id is not enough: the prompt tokens must be equal
    other = Episode([9, 9] + eps[1].ids[eps[1].prompt_len:], 2, eps[1].response_mask, eps[1].rollout_logprobs, 0.0, 0.0)
    assert share_items([eps[0], other], [0, 1], budget=1000, share="on") == [[0], [1]]
    # auto weighs the attention over the row against the tokens saved
    assert share_items(eps, [0, 1, 2, 3], budget=1000, share="auto", cost=RowCost(1.0, 0.0)) == [[0, 1, 2, 3]]
    assert share_items(eps, [0, 1, 2, 3], budget=1000, share="auto",
                       cost=RowCost(1.0, 1e6)) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="RowCost"):
        share_items(eps, [0, 1], budget=1000, share="auto")


def test_collate_shared_layout():
    a = Episode(ids=[10, 11, 12, 20, 21], prompt_len=3, response_mask=[1, 1],
                rollout_logprobs=[-0.5, -0.6], advantage=2.0, reward=1.0)
    b = Episode(ids=[10, 11, 12, 30, 31, 32], prompt_len=3, response_mask=[1, 0, 1],
                rollout_logprobs=[-0.1, 0.0, -0.3], advantage=-1.0, reward=0.0)
    mb = collate_shared([a, b], [[0, 1]], "seq-mean-token-mean", num_tokens=4, num_seqs=2)
    # prompt positions 0..1 once, then segment a = [12, 20] and segment b = [12, 30, 31], then nothing
    assert mb.input_ids.tolist() == [[10, 11, 12, 20, 12, 30, 31]]
    assert mb.targets.tolist() == [[11, 12, 20, 21, 30, 31, 32]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 4]]
    assert mb.loss_mask.tolist() == [[0, 0, 1, 1, 1, 0, 1]]
    assert mb.advantages.tolist() == [[0, 0, 2.0, 2.0, -1.0, 0, -1.0]]
    assert mb.weights.tolist()[0] == pytest.approx([0, 0, 0.25, 0.25, 0.25, 0, 0.25])
    assert mb.spans == [(0, 2, 2), (0, 4, 3)] and mb.episode_ids == [0, 1] and mb.row_lengths == [7]
    m = mb.attention_mask[0, 0].int().tolist()
    assert m == [[1, 0, 0, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0, 0, 0],
                 [1, 1, 1, 0, 0, 0, 0],  # segment a sees the prompt and itself
                 [1, 1, 1, 1, 0, 0, 0],
                 [1, 1, 0, 0, 1, 0, 0],  # segment b never sees segment a
                 [1, 1, 0, 0, 1, 1, 0],
                 [1, 1, 0, 0, 1, 1, 1]]
    # with a shorter row beside it, padding positions attend to themselves only (no NaN in SDPA)
    mb2 = collate_shared([a, b], [[0, 1], [0]], "token-mean", num_tokens=4, num_seqs=2)
    pad = mb2.attention_mask[1, 0]
    assert mb2.row_lengths == [7, 4] and pad[4:].int().tolist() == [[0, 0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 1, 0],
                                                                      [0, 0, 0, 0, 0, 0, 1]]


def test_collate_alignment_and_padding():
    e = Episode(ids=[10, 11, 12, 20, 21, 22], prompt_len=3, response_mask=[1, 0, 1],
                rollout_logprobs=[-0.5, 0.0, -0.7], advantage=2.0, reward=1.0)
    mb = collate([e], [0], "token-mean", num_tokens=2, num_seqs=1)
    assert mb.input_ids.tolist() == [[10, 11, 12, 20, 21]]
    assert mb.targets.tolist() == [[11, 12, 20, 21, 22]]
    # position j predicts targets[j]: response tokens 20, 21, 22 sit at j = 2, 3, 4
    assert mb.loss_mask.tolist() == [[0, 0, 1, 0, 1]]
    assert mb.rollout_logprobs.tolist()[0] == pytest.approx([0, 0, -0.5, 0, -0.7])
    assert mb.advantages.tolist() == [[0, 0, 2.0, 0, 2.0]]
    assert mb.weights.tolist() == [[0, 0, 0.5, 0, 0.5]]
    pad = collate([e], [], "token-mean", num_tokens=2, num_seqs=1)
    assert pad.weights.sum() == 0 and pad.attention_mask.sum() == 1


def test_packing_and_sharding():
    lengths = [5, 3, 8, 2, 2, 12]
    bins = pack_greedy(list(range(6)), lengths, budget=10)
    assert sorted(i for b in bins for i in b) == list(range(6))
    for b in bins:
        assert sum(lengths[i] for i in b) <= 10 or len(b) == 1
    parts = [shard_for_rank(list(range(6)), lengths, r, 2) for r in range(2)]
    assert sorted(parts[0] + parts[1]) == list(range(6))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= max(lengths)


def test_stats_merge():
    a, b = Stats(), Stats()
    a.add_mean("x", 3.0, 1)
    b.add_mean("x", 1.0, 3)
    a.add_max("m", 1.0)
    b.add_max("m", 5.0)
    b.add_max("never", -float("inf"))
    a.merge(b)
    assert a.result() == {"x": 1.0, "m": 5.0, "never": 0.0}
