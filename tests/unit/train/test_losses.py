"""Policy loss, aggregation modes, KL/entropy terms and TIS against hand-computed values;
micro-batch accumulation equals the full-batch loss in every aggregation mode."""

from __future__ import annotations

import math

import pytest
import torch

from agentloop.train.batch.episodes import Episode, staleness_metrics
from agentloop.train.batch.packing import pack_greedy, shard_for_rank, share_items
from agentloop.train.config import AlgoConfig
from agentloop.train.flops import RowCost
from agentloop.train.trainer.collate import (
    collate,
    collate_shared,
    episode_return,
    kl_reward_advantages,
    plan_micro_batches,
)
from agentloop.train.trainer.losses import (
    Stats,
    aggregate,
    interpolate_proximal,
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


def test_dual_clip_is_its_own_knob_in_every_mode():
    logp = _lp(3.0, 3.0)
    adv = _t([-1.0, 1.0])
    mask = _t([1, 1])
    w = token_weights(mask, "seq-mean-token-sum")
    # A=-1, r=3: max(3, 1.2) = 3, capped at -A * 2 = 2;  A=+1, r=3: max(-3, -1.28) = -1.28
    for mode in ("rollout", "recompute"):
        cfg = AlgoConfig(old_logprobs=mode, dual_clip=2.0, tis_cap=None)
        out = policy_loss(logp, torch.zeros(1, 2), adv, mask, w, cfg, rollout_logp=torch.zeros(1, 2))
        assert float(out.loss) == pytest.approx(2.0 - 1.28, abs=1e-6), mode
        assert out.stats.result()["actor/dual_clip_frac"] == pytest.approx(0.5)
    # off by default, and the TIS cap is not a dual clip (it used to be in rollout mode)
    out = policy_loss(logp, torch.zeros(1, 2), adv, mask, w, AlgoConfig(old_logprobs="rollout", tis_cap=2.0))
    assert float(out.loss) == pytest.approx(3.0 - 1.28, abs=1e-6)
    assert "actor/dual_clip_frac" not in out.stats.result()


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
    # KL(mu || pi_prox) by k3 of w = pi_prox / mu
    k3 = sum(w - 1 - math.log(w) for w in (4.0, 1.25)) / 2
    assert s["mismatch/kl_behaviour_proximal"] == pytest.approx(k3, abs=1e-6)
    off = policy_loss(logp, old, adv, mask, token_weights(mask, "token-mean"),
                      AlgoConfig(tis_cap=None), rollout_logp=rollout)
    assert float(off.loss) == pytest.approx(-1.0, abs=1e-6)


def test_ratio_masking_drops_tokens_outside_the_thresholds():
    old = torch.log(_t([0.5, 0.5, 0.5, 0.5]))
    rollout = torch.log(_t([0.125, 0.45, 0.55, 2.5]))  # w = pi_prox / mu = 4, 1.11, 0.91, 0.2
    mask = _t([1, 1, 1, 1])
    adv = _t([1.0, 1.0, 1.0, 1.0])
    w = token_weights(mask, "token-mean")
    cfg = AlgoConfig(tis_cap=None, mask_ratio_low=0.5, mask_ratio_high=2.0)
    out = policy_loss(old.clone(), old, adv, mask, w, cfg, rollout_logp=rollout)
    # tokens 0 (w = 4) and 3 (w = 0.2) contribute nothing; the denominator still counts 4 tokens
    assert float(out.loss) == pytest.approx(-2 / 4, abs=1e-6)
    assert out.stats.result()["mismatch/masked_frac"] == pytest.approx(0.5)
    only_high = policy_loss(old.clone(), old, adv, mask, w, AlgoConfig(tis_cap=None, mask_ratio_high=2.0),
                            rollout_logp=rollout)
    assert float(only_high.loss) == pytest.approx(-3 / 4, abs=1e-6)
    with pytest.raises(ValueError, match="old_logprobs=recompute"):
        AlgoConfig(old_logprobs="rollout", mask_ratio_high=2.0)


def _categorical(k=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(k, generator=g, dtype=torch.float64).requires_grad_(True)
    ref = torch.log_softmax(torch.randn(k, generator=g, dtype=torch.float64), -1)
    return theta, ref


def _expected_kl_term_grad(kl_type, theta, ref, coef=1.0):
    """The exact on-policy expectation E_{a~pi}[grad of the loss on token a], through policy_loss: every
    category is a token whose aggregation weight is pi(a) (detached), advantage 0."""
    logp = torch.log_softmax(theta, -1).unsqueeze(0)
    pi = logp.detach().exp()
    mask = torch.ones_like(pi)
    cfg = AlgoConfig(kl_coef=coef, kl_type=kl_type, old_logprobs="rollout", tis_cap=None, kl_value_max=1e9)
    out = policy_loss(logp, logp.detach(), torch.zeros_like(pi), mask, pi, cfg, ref_logp=ref.unsqueeze(0))
    (g,) = torch.autograd.grad(out.loss, theta)
    return g


def _grad_of(fn, theta):
    (g,) = torch.autograd.grad(fn(torch.log_softmax(theta, -1)), theta)
    return g


def test_kl_terms_have_the_documented_expected_gradients():
    theta, ref = _categorical()
    kl_pi_ref = _grad_of(lambda lp: (lp.exp() * (lp - ref)).sum(), theta)  # grad KL(pi || ref)
    kl_ref_pi = _grad_of(lambda lp: (ref.exp() * (ref - lp)).sum(), theta)  # grad KL(ref || pi)
    assert not torch.allclose(kl_pi_ref, kl_ref_pi, atol=1e-3)  # the distinction is real here
    # k1 as a loss term: zero expected gradient (noise only)
    torch.testing.assert_close(_expected_kl_term_grad("k1", theta, ref), torch.zeros_like(theta), atol=1e-6, rtol=0)
    # k2: that of KL(pi || ref)
    torch.testing.assert_close(_expected_kl_term_grad("k2", theta, ref), kl_pi_ref, atol=1e-6, rtol=1e-5)
    # k3: that of the reverse KL(ref || pi), not KL(pi || ref)
    torch.testing.assert_close(_expected_kl_term_grad("k3", theta, ref), kl_ref_pi, atol=1e-6, rtol=1e-5)
    # k1 in the reward: the advantage of token a is -coef * k1(a), the policy gradient is coef * grad KL(pi || ref)
    logp = torch.log_softmax(theta, -1).unsqueeze(0)
    pi = logp.detach().exp()
    mb = collate([Episode([0, 1], 1, [1], [0.0], 0.0, 0.0)] * 5, [0, 1, 2, 3, 4], "token-mean", num_tokens=5,
                 num_seqs=5)
    adv, pen = kl_reward_advantages(mb, torch.zeros(5, 1, dtype=torch.float64), logp.detach().T, ref.unsqueeze(1),
                                    coef=0.3)
    torch.testing.assert_close(pen, 0.3 * (logp.detach().T - ref.unsqueeze(1)).float())
    out = policy_loss(logp, logp.detach(), adv.T.double(), torch.ones_like(pi), pi,
                      AlgoConfig(old_logprobs="rollout", tis_cap=None))
    (g,) = torch.autograd.grad(out.loss, theta)
    torch.testing.assert_close(g, 0.3 * kl_pi_ref, atol=1e-6, rtol=1e-5)


def test_kl_values_and_the_k3_cap():
    logp = torch.log(_t([0.5]))
    ref = torch.log(_t([0.25]))
    assert float(kl_estimate(logp, ref, "k1")) == pytest.approx(math.log(2), abs=1e-6)
    assert float(kl_estimate(logp, ref, "k2")) == pytest.approx(0.5 * math.log(2) ** 2, abs=1e-6)
    assert float(kl_estimate(logp, ref, "k3")) == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    # a token far below the reference (ref - logp = 30): the value is capped, with zero (finite) gradient
    lp = torch.tensor([-31.0, -1.2], requires_grad=True)
    r = torch.tensor([-1.0, -1.0])
    v = kl_estimate(lp, r, "k3", value_max=10.0)
    assert v[0].item() == 10.0 and v[1].item() == pytest.approx(math.exp(0.2) - 0.2 - 1, abs=1e-6)
    v.sum().backward()
    assert lp.grad[0].item() == 0.0 and math.isfinite(lp.grad[1].item()) and lp.grad[1].item() != 0.0
    # the loss reports the term (kl_penalty) and always the k3 value estimate of KL(pi||ref) (kl_ref)
    cfg = AlgoConfig(kl_coef=0.1, kl_type="k2", entropy_coef=0.01, old_logprobs="rollout", tis_cap=None)
    mask = _t([1])
    out = policy_loss(logp, logp.detach(), _t([0.0]), mask, token_weights(mask, "token-mean"), cfg,
                      ref_logp=ref, entropy=_t([2.0]))
    assert float(out.loss) == pytest.approx(0.1 * 0.5 * math.log(2) ** 2 - 0.01 * 2.0, abs=1e-6)
    s = out.stats.result()
    assert s["actor/kl_penalty"] == pytest.approx(0.5 * math.log(2) ** 2, abs=1e-6)
    assert s["actor/kl_ref"] == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    assert s["actor/entropy"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, logp, _t([0.0]), mask, mask, cfg, entropy=_t([2.0]))


def test_episode_return_sums_to_the_end_of_each_episode():
    a = Episode(ids=[10, 11, 20, 21, 22], prompt_len=2, response_mask=[1, 0, 1], rollout_logprobs=[-1.0, 0.0, -1.0],
                advantage=1.0, reward=1.0)
    b = Episode(ids=[10, 11, 30, 31], prompt_len=2, response_mask=[1, 1], rollout_logprobs=[-1.0, -1.0],
                advantage=-1.0, reward=0.0)
    for mb in (collate([a, b], [0, 1], "token-mean", num_tokens=5, num_seqs=2),
               collate_shared([a, b], [[0, 1]], "token-mean", num_tokens=5, num_seqs=2)):
        vals = torch.zeros_like(mb.loss_mask)
        for i, (row, s, k) in zip(mb.episode_ids, mb.spans):
            vals[row, s:s + k] = torch.arange(1, k + 1, dtype=torch.float32) * (10 if i else 1)
        ret = episode_return(mb, vals * mb.loss_mask)
        got = {i: ret[row, s:s + k].tolist() for i, (row, s, k) in zip(mb.episode_ids, mb.spans)}
        # a: values 1, (0: mask 0), 3 -> returns 4, 3, 3; b: 10, 20 -> 30, 20 (never a's values in a shared row)
        assert got == {0: [4.0, 3.0, 3.0], 1: [30.0, 20.0]}


def test_interpolated_proximal_logprobs():
    behav = _t([-2.0, -2.0, -2.0, -2.0])
    cur = _t([-1.0, -1.0, -1.0, -1.0])
    lag = torch.tensor([[0, 1, 3, -1]])
    got = interpolate_proximal(behav, cur, lag)
    # alpha = lag / (lag + 1): 0, 1/2, 3/4 (a negative lag is treated as 0)
    assert got.tolist()[0] == pytest.approx([-2.0, -1.5, -1.25, -2.0])
    assert not got.requires_grad


def test_staleness_metrics():
    def ep(versions, mask):
        return Episode([0] * (2 + len(mask)), 2, mask, [0.0] * len(mask), 0.0, 0.0, versions=versions)

    eps = [ep([4, 4, -1, 3], [1, 1, 0, 1]), ep([1, 0], [1, 1]), ep(None, [1, 1])]
    m = staleness_metrics(eps, step=5)  # starts from version 4: lags 0, 0, 1, 3, 4
    assert m["async/staleness_mean"] == pytest.approx((0 + 0 + 1 + 3 + 4) / 5)
    assert m["async/staleness_max"] == 4.0
    assert m["async/lag_share_0"] == pytest.approx(2 / 5) and m["async/lag_share_1"] == pytest.approx(1 / 5)
    assert m["async/lag_share_2"] == 0.0 and m["async/lag_share_3"] == pytest.approx(1 / 5)
    assert m["async/lag_share_4+"] == pytest.approx(1 / 5)
    assert m["async/version_known_frac"] == pytest.approx(5 / 7)
    assert staleness_metrics([ep(None, [1])], step=5) == {}
    with pytest.raises(ValueError, match="newer than"):
        staleness_metrics([ep([5], [1])], step=5)


def test_losses_and_stats_read_nothing_back_per_micro_batch(monkeypatch):
    """policy_loss and Stats.merge keep every number on the device; only result() reads them, at once."""
    g = torch.Generator().manual_seed(0)
    cfg = AlgoConfig(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0, mask_ratio_high=3.0, dual_clip=3.0)
    total = Stats()
    reads = {"n": 0}

    def forbidden(*a, **k):
        reads["n"] += 1
        raise AssertionError("a tensor was read back to the host")

    with monkeypatch.context() as mp:
        for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
            mp.setattr(torch.Tensor, name, forbidden)
        for _ in range(3):
            logp = -torch.rand(2, 6, generator=g) - 0.1
            mask = (torch.rand(2, 6, generator=g) > 0.3).float()
            out = policy_loss(logp, logp + 0.05, torch.randn(2, 6, generator=g), mask, mask / 12, cfg,
                              rollout_logp=logp - 0.1, ref_logp=logp - 0.2, entropy=torch.rand(2, 6, generator=g))
            total.merge(out.stats)
    assert reads["n"] == 0
    res = total.result()
    assert res["actor/ratio_max"] > 0 and 0 <= res["actor/clip_frac"] <= 1


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
