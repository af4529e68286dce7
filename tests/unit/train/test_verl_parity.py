"""docs/coming_from_verl.md's algorithm keys against verl's own code: verl 0.9.1 from PyPI, installed without its
dependencies plus the few packages its imports need (the `verl-parity` extra; scripts/setup.sh installs both).

verl's side runs verl's functions, in the order its PPO trainer (trainer/ppo/v1/trainer_base.py, the default
`trainer.use_v1=True`) calls them on a step's batch:

    rollout_corr_helper.apply_bypass_mode                algorithm.rollout_correction.bypass_mode
    ray_trainer.apply_kl_penalty + core_algos' KL controllers   algorithm.use_kl_in_reward, kl_penalty, kl_ctrl
    rollout_corr_helper.compute_rollout_correction_and_add_to_batch   rollout_is, rollout_rs (decoupled mode)
    ray_trainer.compute_advantage                        adv_estimator (grpo, rloo, reinforce_plus_plus)
    workers.utils.losses.ppo_loss                        the actor's loss of each micro-batch (the FSDP engine's
                                                         loss function): vanilla PPO with the dual clip, IS
                                                         weights, entropy, the KL loss, agg_loss
Only the trainer's plumbing is written here: the mini-batch totals ppo_loss divides by, as verl 0.9.1 passes them
(FSDPEngine.forward_backward_batch: batch_num_tokens = the mini-batch's response-mask sum; _update_actor:
global_batch_size = ppo_mini_batch_size x rollout.n, every episode of the mini-batch), and the tensor layout
ppo_loss reads (left-padded prompts, right-padded responses, the logprobs of every position of each sequence).

Our side runs prepare_episodes -> plan_micro_batches (uneven micro-batches, padded or packed, shared prompts or
not) -> apply_verl_order -> MicroBatch.loss (the learner's loss call), as Learner.train_step runs them, with the
logprobs given instead of a model's. The batches: GRPO groups of ragged
responses with tool stretches (mask-0 runs) inside, ratios far from 1 (both clips and the dual clip bind),
behaviour logprobs that put importance weights on both sides of the cap, and one episode (REJECTED) that every
rejection rule rejects whole.

`ROWS` holds one case per row of the doc's algorithm table that says "same"; `ours` is the doc's mapping from
verl's settings to `algo.*`. Each case, in each loss_agg_mode, with rejection off and on, must give verl's
response masks, advantages, per-mini-batch losses and gradients (w.r.t. every token's logprob and entropy) to 1e-5
relative. The rows that differ are tests that assert the documented difference.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from agentloop.records import EpisodeRecord
from agentloop.train.batch.advantages import compute_advantages
from agentloop.train.batch.episodes import prepare_episodes
from agentloop.train.config import AlgoConfig
from agentloop.train.flops import RowCost
from agentloop.train.trainer.learner import verl_order
from agentloop.train.trainer.losses import kl_estimate
from agentloop.train.trainer.rollout_correction import RS_OPTIONS, parse_rollout_rs, rejection_keep
from agentloop.train.trainer.verl_order import KLController, apply_verl_order, kl_penalty

VERL_VERSION = "0.9.1"

try:
    with warnings.catch_warnings():
        # verl's import chain: Ray's deprecated experimental state API (verl.single_controller.ray.base) and one
        # warning per optional training engine that is not installed (verl.workers.engine)
        warnings.filterwarnings("ignore", message="Ray state API is no longer experimental", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=r"\w+ engine is not available", category=UserWarning)
        import verl
        from omegaconf import OmegaConf
        from tensordict import TensorDict
        from verl import DataProto
        from verl.trainer.config import AlgoConfig as VerlAlgoConfig
        from verl.trainer.config.algorithm import KLControlConfig, RolloutCorrectionConfig
        from verl.trainer.ppo import core_algos
        from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage
        from verl.trainer.ppo.rollout_corr_helper import (
            SUPPORTED_ROLLOUT_RS_OPTIONS,
            apply_bypass_mode,
            compute_rollout_correction_and_add_to_batch,
            compute_rollout_rejection_mask,
        )
        from verl.utils import tensordict_utils as tu
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import FSDPActorConfig, PolicyLossConfig
        from verl.workers.utils.losses import ppo_loss
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(f"tests/unit/train/test_verl_parity.py runs verl {VERL_VERSION}'s own functions: pip install "
                      f"--no-deps verl=={VERL_VERSION} and pip install -e '.[verl-parity]' (scripts/setup.sh does "
                      f"both): {e}") from e

ROOT = Path(__file__).resolve().parents[3]
N_GROUPS, GROUP = 3, 4
REJECTED = 5
"""The episode whose behaviour logprobs are 3 nats below the proximal ones on every token: rejected whole."""
MINIS = [list(range(0, 6)), list(range(6, 12))]
"""Two mini-batches (verl's are contiguous slices of the batch); REJECTED sits in the first."""
VERL_MICRO = [1, 3, 2]
"""verl's micro-batches of each mini-batch: uneven on purpose (ppo_loss gets the mini-batch's totals)."""
RTOL = 1e-5


# ---- the batch ----------------------------------------------------------------------------------------------


@dataclass
class Batch:
    records: list[EpisodeRecord]
    logp: list[torch.Tensor]
    """The current policy's logprob of every response token (the loss's variable)."""
    old: list[torch.Tensor]
    """The proximal (step-start) policy's: verl's old_log_probs."""
    ref: list[torch.Tensor]
    rollout: list[torch.Tensor]
    """The behaviour policy's (verl's rollout_log_probs); 0 on tool tokens, as in a record."""
    entropy: list[torch.Tensor]

    @property
    def lengths(self) -> list[int]:
        return [len(r.response_ids) for r in self.records]


def make_batch(seed: int = 0, *, trailing_tool: int | None = None) -> Batch:
    """N_GROUPS groups of GROUP episodes; responses of 5..13 tokens, two of every three with a tool stretch of 2-3
    tokens after the first two; the last response token is a model token whose behaviour logprob equals the
    proximal one (every token rule keeps it), except for REJECTED. `trailing_tool`: that episode's response ends
    with a tool stretch instead."""
    g = torch.Generator().manual_seed(seed)
    recs, logp, old, ref, rollout, ent = [], [], [], [], [], []
    for grp in range(N_GROUPS):
        prompt = torch.randint(1, 50, (3 + grp,), generator=g).tolist()
        for rep in range(GROUP):
            i = grp * GROUP + rep
            r = 5 + (i * 7) % 9
            mask = [1] * r
            if i % 3 != 2:
                for t in range(2, min(4 + i % 2, r - 1)):
                    mask[t] = 0
            if i == trailing_tool:
                mask[-2:] = [0, 0]
            o = -torch.rand(r, generator=g) * 2.0 - 0.05
            beh = o + 0.45 * torch.randn(r, generator=g)
            beh[-1] = o[-1]
            if i == REJECTED:
                beh = o - 3.0
            m = torch.tensor(mask, dtype=torch.float32)
            beh = beh * m
            old.append(o)
            logp.append(o + 0.6 * torch.randn(r, generator=g))
            ref.append(o + 0.5 * torch.randn(r, generator=g))
            rollout.append(beh)
            ent.append(torch.rand(r, generator=g) * 2.0)
            recs.append(EpisodeRecord(
                prompt_ids=prompt, response_ids=torch.randint(1, 50, (r,), generator=g).tolist(),
                response_mask=mask, response_logprobs=beh.tolist(),
                reward=round(float(torch.rand(1, generator=g)) * 3.0, 2), episode_id=f"{grp}-{rep}", index=grp,
                repeat=rep, data_source="t", loop="x", seed=rep, step=1))
    return Batch(recs, logp, old, ref, rollout, ent)


# ---- verl's settings and the doc's mapping ------------------------------------------------------------------


@dataclass(frozen=True)
class Verl:
    """A verl run's algorithm settings, verl's names (actor_rollout_ref.actor.* and algorithm.*), verl's defaults."""

    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None
    bypass_mode: bool = False


ESTIMATOR = {"grpo": "grpo", "rloo": "rloo", "reinforce_plus_plus": "reinforce_pp"}
KL_LOSS_TYPE = {"low_var_kl": "k3", "k3": "k3", "kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2"}


def ours(v: Verl) -> AlgoConfig:
    """docs/coming_from_verl.md's algorithm table: verl's settings -> ours."""
    return AlgoConfig(
        estimator=ESTIMATOR[v.adv_estimator],
        reinforce_pp_whiten="verl" if v.adv_estimator == "reinforce_plus_plus" else "std",
        norm_adv_by_std=v.norm_adv_by_std_in_grpo,
        clip_ratio_low=v.clip_ratio_low, clip_ratio_high=v.clip_ratio_high, dual_clip=v.clip_ratio_c,
        loss_agg_mode=v.loss_agg_mode, entropy_coef=v.entropy_coeff,
        kl_coef=v.kl_loss_coef if v.use_kl_loss else 0.0, kl_type=KL_LOSS_TYPE[v.kl_loss_type],
        use_kl_in_reward=v.use_kl_in_reward, kl_penalty=v.kl_penalty, kl_ctrl=v.kl_ctrl.type,
        kl_ctrl_coef=v.kl_ctrl.kl_coef, kl_ctrl_target=v.kl_ctrl.target_kl, kl_ctrl_horizon=v.kl_ctrl.horizon,
        old_logprobs="rollout" if v.bypass_mode else "recompute",
        tis_cap=v.rollout_is_threshold if v.rollout_is and not v.bypass_mode else None,
        tis_level=v.rollout_is or "token",
        rollout_rs=v.rollout_rs, rollout_rs_threshold=v.rollout_rs_threshold,
    )


# ---- one step, verl's way and ours --------------------------------------------------------------------------


@dataclass
class Step:
    masks: list[torch.Tensor]
    """Per episode, its response mask after rejection."""
    advantages: list[torch.Tensor]
    losses: list[float]
    """Per mini-batch."""
    grads: list[list[torch.Tensor]]
    """Per mini-batch, d loss / d (each episode's logprobs, then each episode's entropies when used)."""
    kl_coef_after: float
    metrics: dict = field(default_factory=dict)


def _pad(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def _grads(loss: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    gs = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(x) if gr is None else gr for gr, x in zip(gs, leaves)]


def verl_step(b: Batch, v: Verl, *, micro: list[int] = VERL_MICRO) -> Step:
    """One step of verl 0.9.1 on `b`: its functions, its order, its mini-batch totals."""
    n, lengths = len(b.records), b.lengths
    width = max(lengths)
    mask = _pad([torch.tensor(r.response_mask, dtype=torch.float32) for r in b.records], width)
    scores = torch.zeros(n, width)
    for i, r in enumerate(b.records):
        scores[i, lengths[i] - 1] = r.reward  # the agent loop's rm_scores: the score on the last response position
    data = DataProto.from_dict(
        tensors={"response_mask": mask, "token_level_scores": scores, "old_log_probs": _pad(b.old, width),
                 "ref_log_prob": _pad(b.ref, width), "rollout_log_probs": _pad(b.rollout, width)},
        non_tensors={"uid": np.array([str(r.index) for r in b.records], dtype=object)})
    rc = RolloutCorrectionConfig(rollout_is=v.rollout_is, rollout_is_threshold=v.rollout_is_threshold,
                                 rollout_rs=v.rollout_rs, rollout_rs_threshold=v.rollout_rs_threshold,
                                 bypass_mode=v.bypass_mode)
    policy_loss_cfg = OmegaConf.structured(PolicyLossConfig(loss_mode="vanilla"))
    if v.bypass_mode:  # fit(): old_log_probs = rollout_log_probs, the bypass loss
        apply_bypass_mode(data, rc, policy_loss_cfg)
    # _compute_advantage: KL penalty, rollout correction, advantage
    kl_ctrl = core_algos.get_kl_controller(v.kl_ctrl)
    metrics: dict = {}
    if v.use_kl_in_reward:
        data, m = apply_kl_penalty(data, kl_ctrl=kl_ctrl, kl_penalty=v.kl_penalty)
        metrics.update(m)
    else:
        data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    if not v.bypass_mode:
        data, m = compute_rollout_correction_and_add_to_batch(data, rc)
        metrics.update(m)
    algo = VerlAlgoConfig(adv_estimator=v.adv_estimator, norm_adv_by_std_in_grpo=v.norm_adv_by_std_in_grpo,
                          use_kl_in_reward=v.use_kl_in_reward, kl_penalty=v.kl_penalty, kl_ctrl=v.kl_ctrl)
    data = compute_advantage(data, adv_estimator=v.adv_estimator, gamma=algo.gamma, lam=algo.lam, num_repeat=GROUP,
                             norm_adv_by_std_in_grpo=v.norm_adv_by_std_in_grpo, config=algo)
    # _update_actor -> the engine's forward_backward_batch -> ppo_loss on each micro-batch
    actor = FSDPActorConfig(
        strategy="fsdp", rollout_n=GROUP, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=v.clip_ratio_low, clip_ratio_high=v.clip_ratio_high, clip_ratio_c=v.clip_ratio_c,
        loss_agg_mode=v.loss_agg_mode, entropy_coeff=v.entropy_coeff, use_kl_loss=v.use_kl_loss,
        kl_loss_coef=v.kl_loss_coef, kl_loss_type=v.kl_loss_type,
        policy_loss=omega_conf_to_dataclass(policy_loss_cfg, PolicyLossConfig))
    logp = [x.clone().requires_grad_(True) for x in b.logp]
    ent = [x.clone().requires_grad_(True) for x in b.entropy]
    leaves = logp + (ent if v.entropy_coeff > 0 else [])
    fields = ["response_mask", "old_log_probs", "advantages"] + (["ref_log_prob"] if v.use_kl_loss else []) + \
        (["rollout_is_weights"] if "rollout_is_weights" in data.batch.keys() else [])
    prompt_lens = [len(r.prompt_ids) for r in b.records]
    losses, grads = [], []
    for idxs in MINIS:
        batch_num_tokens = int(data.batch["response_mask"][idxs].sum())
        total = None
        cuts = np.cumsum([0] + micro)
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            rows = idxs[lo:hi]
            p = max(prompt_lens[i] for i in rows)
            attn = torch.zeros(len(rows), p + width, dtype=torch.int64)
            flat = []
            flat_ent = []
            for k, i in enumerate(rows):
                attn[k, p - prompt_lens[i]:p + lengths[i]] = 1
                # the model's output at every position of the sequence; response token j's logprob sits at
                # position prompt_len - 1 + j (no_padding_2_padding's left shift)
                flat.append(torch.cat([torch.zeros(prompt_lens[i] - 1), logp[i], torch.zeros(1)]))
                flat_ent.append(torch.cat([torch.zeros(prompt_lens[i] - 1), ent[i], torch.zeros(1)]))
            td = TensorDict({"prompts": torch.ones(len(rows), p, dtype=torch.int64),
                             "responses": torch.ones(len(rows), width, dtype=torch.int64), "attention_mask": attn,
                             **{f: data.batch[f][rows] for f in fields}}, batch_size=[len(rows)])
            tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=batch_num_tokens, global_batch_size=len(idxs))
            out = {"log_probs": torch.cat(flat)}
            if v.entropy_coeff > 0:
                out["entropy"] = torch.cat(flat_ent)
            loss, _ = ppo_loss(actor, out, td)
            total = loss if total is None else total + loss
        losses.append(float(total.detach()))
        grads.append(_grads(total, leaves))
    rmask = data.batch["response_mask"]
    adv = data.batch["advantages"]
    return Step(masks=[rmask[i, :lengths[i]].float() for i in range(n)],
                advantages=[adv[i, :lengths[i]] for i in range(n)], losses=losses, grads=grads,
                kl_coef_after=float(kl_ctrl.value), metrics=metrics)


def our_step(b: Batch, algo: AlgoConfig, *, layout: str = "padded", share: str = "off", budget: int = 45) -> Step:
    """One step of ours on `b`, as Learner.train_step runs it (without a model: the logprobs are given)."""
    from agentloop.train.trainer.collate import plan_micro_batches

    prepared = prepare_episodes(b.records, algo)
    eps = prepared.episodes
    assert len(eps) == len(b.records)
    plans = [plan_micro_batches(eps, idxs, algo.loss_agg_mode, budget=budget, layout=layout, share=share,
                                cost=RowCost(1000.0, 10.0)) for idxs in MINIS]
    for plan in plans:
        for mb in plan:
            mb.old_logprobs = torch.zeros_like(mb.rollout_logprobs)
            mb.ref_logprobs = torch.zeros_like(mb.rollout_logprobs)
            for i, (row, s, k) in zip(mb.episode_ids, mb.spans):
                mb.old_logprobs[row, s:s + k] = b.old[i]
                mb.ref_logprobs[row, s:s + k] = b.ref[i]
    ctrl = KLController(algo)
    metrics: dict = {}
    if verl_order(algo):
        metrics, current_kl = apply_verl_order(plans, MINIS, prepared, algo, ctrl.value)
        if algo.use_kl_in_reward:
            ctrl.update(current_kl, len(eps))
    logp = [x.clone().requires_grad_(True) for x in b.logp]
    ent = [x.clone().requires_grad_(True) for x in b.entropy]
    leaves = logp + (ent if algo.entropy_coef > 0 else [])

    def place(mb, per_ep):
        out = torch.zeros(mb.loss_mask.shape)
        for i, (row, s, k) in zip(mb.episode_ids, mb.spans):
            out[row, s:s + k] = per_ep[i]
        return out

    masks, advs = [None] * len(eps), [None] * len(eps)
    losses, grads = [], []
    for plan in plans:
        total = None
        for mb in plan:
            old = mb.rollout_logprobs if algo.old_logprobs == "rollout" else mb.old_logprobs
            out = mb.loss(place(mb, logp), old, mb.advantages, algo, entropy=place(mb, ent))
            total = out.loss if total is None else total + out.loss
            for i, (row, s, k) in zip(mb.episode_ids, mb.spans):
                masks[i] = mb.loss_mask[row, s:s + k].float()
                advs[i] = mb.advantages[row, s:s + k].float()
        losses.append(float(total.detach()))
        grads.append(_grads(total, leaves))
    return Step(masks=masks, advantages=advs, losses=losses, grads=grads, kl_coef_after=ctrl.value, metrics=metrics)


def assert_same(o: Step, v: Step) -> None:
    for i, (a, b) in enumerate(zip(o.masks, v.masks)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, i=i: f"episode {i}'s mask: {m}")
    for i, (a, b) in enumerate(zip(o.advantages, v.advantages)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-6, msg=lambda m, i=i: f"episode {i}'s advantages: {m}")
    for j, (ga, gb) in enumerate(zip(o.grads, v.grads)):
        # a mini-batch loss is a float32 sum of per-token terms of either sign that may cancel: 1e-5 relative to
        # the size of those terms, sum |d loss / d logp_t| (= sum |w_t * pg_t| over the unclipped tokens)
        size = sum(float(g.abs().sum()) for g in gb)
        assert o.losses[j] == pytest.approx(v.losses[j], rel=RTOL, abs=RTOL * size), f"mini-batch {j}'s loss"
        scale = max(float(g.abs().max()) for g in gb)
        for i, (a, b) in enumerate(zip(ga, gb)):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=RTOL * scale,
                                       msg=lambda m, i=i, j=j: f"mini-batch {j}, gradient {i}: {m}")
    assert o.kl_coef_after == pytest.approx(v.kl_coef_after, rel=1e-9)


# ---- the rows that say "same" -------------------------------------------------------------------------------

KL_CTRL = KLControlConfig(type="fixed", kl_coef=0.2)
ROWS = [
    pytest.param(Verl(), id="verl-defaults"),
    pytest.param(Verl(clip_ratio_low=0.2, clip_ratio_high=0.28), id="actor.clip_ratio_low/high"),
    pytest.param(Verl(clip_ratio_c=1.5), id="actor.clip_ratio_c"),
    pytest.param(Verl(entropy_coeff=0.01), id="actor.entropy_coeff"),
    *[pytest.param(Verl(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type=t), id=f"actor.use_kl_loss+kl_loss_type={t}")
      for t in KL_LOSS_TYPE],
    *[pytest.param(Verl(adv_estimator=e), id=f"algorithm.adv_estimator={e}") for e in ESTIMATOR],
    pytest.param(Verl(norm_adv_by_std_in_grpo=False), id="algorithm.norm_adv_by_std_in_grpo=false"),
    *[pytest.param(Verl(adv_estimator=e, use_kl_in_reward=True, kl_penalty=p, kl_ctrl=KL_CTRL),
                   id=f"algorithm.use_kl_in_reward+kl_penalty={p}+{e}")
      for e in ESTIMATOR for p in ("kl", "abs", "mse", "low_var_kl")],
    pytest.param(Verl(use_kl_in_reward=True, kl_ctrl=KLControlConfig(type="adaptive", kl_coef=0.2, target_kl=0.05,
                                                                      horizon=100)),
                 id="algorithm.kl_ctrl.type=adaptive"),
    *[pytest.param(Verl(rollout_is=lvl, rollout_is_threshold=2.0), id=f"rollout_correction.rollout_is={lvl}")
      for lvl in ("token", "sequence")],
    *[pytest.param(Verl(rollout_rs=o, rollout_rs_threshold=t), id=f"rollout_correction.rollout_rs={o}")
      for o, t in [("token_k2", 0.1), ("token_k3", 0.08), ("seq_sum_k1", "0.4_2.5"), ("seq_mean_k2", 0.06),
                   ("seq_max_k3", 0.3), ("token_k1,seq_mean_k3", "0.5_2.0,0.05")]],
    pytest.param(Verl(bypass_mode=True), id="rollout_correction.bypass_mode"),
    pytest.param(Verl(bypass_mode=True, rollout_is="token"), id="rollout_correction.bypass_mode+rollout_is"),
    pytest.param(Verl(adv_estimator="reinforce_plus_plus", clip_ratio_high=0.28, entropy_coeff=0.01,
                      use_kl_loss=True, kl_loss_coef=0.05, use_kl_in_reward=True, kl_penalty="low_var_kl",
                      kl_ctrl=KL_CTRL, rollout_is="sequence"), id="all-at-once-reinforce_plus_plus"),
    pytest.param(Verl(adv_estimator="rloo", entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05,
                      kl_loss_type="mse", use_kl_in_reward=True, kl_penalty="kl", kl_ctrl=KL_CTRL,
                      rollout_is="token"), id="all-at-once-rloo"),
]
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
REJECTION = ("token_k1", "0.4_3.0")
"""The rejection the rows run with when they set none themselves: it rejects REJECTED whole and a few other tokens."""


def _cases():
    for row in ROWS:
        v: Verl = row.values[0]
        own_rs = v.rollout_rs is not None
        for mode in MODES:
            yield pytest.param(replace(v, loss_agg_mode=mode), id=f"{row.id}-{mode}")
            if not own_rs and not v.bypass_mode:  # bypass-mode rejection has no equivalent (documented)
                yield pytest.param(replace(v, loss_agg_mode=mode, rollout_rs=REJECTION[0],
                                           rollout_rs_threshold=REJECTION[1]), id=f"{row.id}-{mode}-rejection")


@pytest.fixture(scope="module")
def batch() -> Batch:
    return make_batch()


@pytest.mark.parametrize("v", list(_cases()))
def test_doc_row_equals_verls_own_code(batch, v):
    theirs = verl_step(batch, v)
    mine = our_step(batch, ours(v))
    assert_same(mine, theirs)
    if v.rollout_rs is not None:
        # every rejection case rejects REJECTED whole and tokens of some other episode, and keeps some
        kept = [float(m.sum()) for m in theirs.masks]
        assert kept[REJECTED] == 0.0 and sum(kept) > 0
        assert any(k < sum(r.response_mask) for i, (k, r) in enumerate(zip(kept, batch.records)) if i != REJECTED)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout,share,budget", [("padded", "off", 45), ("packed", "on", 45), ("padded", "on", 200),
                                                 ("packed", "off", 16)])
def test_micro_batching_and_layout_never_change_the_numbers(batch, mode, layout, share, budget):
    """Uneven micro-batches both sides (verl's [1, 3, 2], ours packed under a token budget), padded or packed rows,
    shared prompts or not: each micro-batch is weighed by its mini-batch's totals, so nothing changes (verl
    0.9.1 passes the totals too; the verl before it averaged each micro-batch)."""
    v = Verl(adv_estimator="grpo", entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05, use_kl_in_reward=True,
             kl_ctrl=KL_CTRL, rollout_is="sequence", rollout_rs=REJECTION[0], rollout_rs_threshold=REJECTION[1],
             loss_agg_mode=mode)
    mine = our_step(batch, ours(v), layout=layout, share=share, budget=budget)
    for micro in ([1, 3, 2], [6], [2, 2, 1, 1]):
        assert_same(mine, verl_step(batch, v, micro=micro))


def test_the_batch_exercises_every_branch(batch):
    """What the row cases rely on, measured with verl's functions: ratios clipped both ways and the dual clip
    binding, importance weights above and below the cap (on kept tokens too), the rows' rejection taking some
    tokens of some episodes and REJECTED whole, ragged lengths and tool stretches."""
    lengths = batch.lengths
    assert len(set(lengths)) > 5 and sum(1 for r in batch.records if 0 in r.response_mask) >= 6
    width = max(lengths)
    mask = _pad([torch.tensor(r.response_mask, dtype=torch.float32) for r in batch.records], width)
    old, logp, rollout = _pad(batch.old, width), _pad(batch.logp, width), _pad(batch.rollout, width)
    adv = torch.randn(len(lengths), 1, generator=torch.Generator().manual_seed(0)).expand_as(mask)
    actor = FSDPActorConfig(strategy="fsdp", rollout_n=GROUP, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1)
    _, m = core_algos.compute_policy_loss_vanilla(old, logp, adv, mask, config=actor)
    assert m["actor/pg_clipfrac"] > 0.1 and m["actor/pg_clipfrac_lower"] > 0.02
    w = torch.exp((old - rollout).clamp(-20, 20))
    assert 0.05 < float((w[mask > 0] > 2.0).float().mean()) < 0.5
    keep, _ = compute_rollout_rejection_mask(old - rollout, mask, *REJECTION)
    per_ep = keep.sum(-1)
    assert per_ep[REJECTED] == 0 and int(((per_ep > 0) & (per_ep < mask.sum(-1))).sum()) >= 2
    assert bool(((w > 2.0) & (keep > 0)).any())  # with the rejection on, the cap still binds on kept tokens


# ---- rows that are equal by a closer look ------------------------------------------------------------------


@pytest.mark.parametrize("options,threshold", [
    ("token_k1", "0.6_1.4"), ("token_k1", 1.5), ("token_k2", 0.3), ("token_k3", 0.2),
    ("seq_sum_k1", "0.5_2.0"), ("seq_sum_k2", 1.0), ("seq_sum_k3", 0.8), ("seq_mean_k1", "0.8_1.25"),
    ("seq_mean_k2", 0.1), ("seq_mean_k3", 0.1), ("seq_max_k2", 0.5), ("seq_max_k3", 0.5),
    ("token_k1,seq_mean_k3", "0.5_2.0,0.1"),
])
def test_rejection_masks_equal_verls(options, threshold):
    """Every rollout_rs option: our kept tokens are verl's modified response mask, with two episodes packed in a row
    (seq_ids) too."""
    g = torch.Generator().manual_seed(sum(map(ord, options)))
    log_ratio = 0.5 * torch.randn(6, 12, generator=g)
    mask = (torch.rand(6, 12, generator=g) > 0.25).float()
    mask[5] = 0.0  # a sequence without model tokens
    theirs, _ = compute_rollout_rejection_mask(log_ratio, mask, options, threshold)
    rules = parse_rollout_rs(options, threshold)
    seq_ids = torch.arange(6).unsqueeze(-1).expand(6, 12).contiguous()
    torch.testing.assert_close(rejection_keep(log_ratio, mask, seq_ids, 6, rules).float(), theirs)
    packed = rejection_keep(log_ratio.reshape(3, 24), mask.reshape(3, 24), seq_ids.reshape(3, 24), 6, rules)
    torch.testing.assert_close(packed.float().reshape(6, 12), theirs)
    assert 0 < float(theirs.sum()) < float(mask.sum())  # the thresholds reject some, not all


def test_rs_options_are_verls_and_bad_specs_are_named():
    assert set(RS_OPTIONS) == SUPPORTED_ROLLOUT_RS_OPTIONS
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


def _extremes():
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(400, generator=g) * 5
    ref = old + torch.cat([3.0 * torch.randn(360, generator=g), torch.tensor([25.0, -25.0, 12.0, -12.0] * 10)])
    return old, ref


@pytest.mark.parametrize("name", ["kl", "abs", "mse", "low_var_kl"])
def test_reward_kl_penalty_is_verls_bit_for_bit(name):
    """algorithm.kl_penalty -> algo.kl_penalty: the same per-token values, bit for bit, the bounds of low_var_kl
    included (log-ratios up to 25 nats)."""
    old, ref = _extremes()
    assert torch.equal(kl_penalty(old, ref, name), core_algos.kl_penalty(old, ref, name))


@pytest.mark.parametrize("verl_type", list(KL_LOSS_TYPE))
def test_kl_loss_values_and_gradients_are_verls(verl_type):
    """actor.kl_loss_type -> algo.kl_type (kl_value_max at its default, 10): values and gradients equal verl's
    kl_penalty, in the capped region too (both zero gradient there)."""
    old, ref = _extremes()
    a = old.clone().requires_grad_(True)
    b = old.clone().requires_grad_(True)
    mine = kl_estimate(a, ref, KL_LOSS_TYPE[verl_type])
    theirs = core_algos.kl_penalty(b, ref, verl_type)
    torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
    mine.sum().backward()
    theirs.sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


def test_adaptive_kl_controller_is_verls():
    """algorithm.kl_ctrl: our controller's beta follows verl's AdaptiveKLController / FixedKLController."""
    for cfg in (KLControlConfig(type="adaptive", kl_coef=0.01, target_kl=0.1, horizon=1000),
                KLControlConfig(type="fixed", kl_coef=0.01)):
        theirs = core_algos.get_kl_controller(cfg)
        mine = KLController(AlgoConfig(use_kl_in_reward=True, kl_ctrl=cfg.type, kl_ctrl_coef=cfg.kl_coef,
                                       kl_ctrl_target=cfg.target_kl, kl_ctrl_horizon=cfg.horizon))
        for kl, n in [(0.3, 64), (0.05, 64), (0.11, 32), (5.0, 100)]:
            theirs.update(kl, n)
            mine.update(kl, n)
            assert mine.value == pytest.approx(theirs.value, rel=1e-12)
        assert (mine.value != 0.01) == (cfg.type == "adaptive")


# ---- the rows that differ: what the doc says ----------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_group_of_one_is_the_score_in_verl_and_zero_here(estimator):
    """rollout.n=1 (or a group left with one episode): verl's grpo gives (score - 0) / (1 + 1e-6), its rloo the
    score itself, i.e. REINFORCE without a baseline; ours gives 0 (no baseline, no signal)."""
    scores = torch.tensor([1.0, 0.0, 2.5, 0.5])
    mask = torch.ones(4, 3)
    token = torch.zeros(4, 3)
    token[:, -1] = scores
    data = DataProto.from_dict(tensors={"response_mask": mask, "token_level_rewards": token},
                               non_tensors={"uid": np.array(["a", "b", "c", "d"], dtype=object)})
    data = compute_advantage(data, adv_estimator=estimator, num_repeat=1, config=VerlAlgoConfig())
    want = scores / (1 + 1e-6) if estimator == "grpo" else scores
    torch.testing.assert_close(data.batch["advantages"], want[:, None].expand(4, 3))
    mine = compute_advantages(scores.double(), torch.arange(4), torch.full((4,), 3), AlgoConfig(estimator=estimator))
    assert mine.values.tolist() == [0.0] * 4 and mine.zero_variance.all()
    # so training refuses rollout.n_samples=1 with them, naming what verl would do
    from agentloop.config import load_config, validate_for_training
    from agentloop.errors import ConfigError

    with pytest.raises(ConfigError, match=f"rollout.n_samples=1 with algo.estimator={estimator}.*raw score"):
        validate_for_training(load_config(None, ["rollout.n_samples=1", f"algo.estimator={estimator}"]))
    validate_for_training(load_config(None, ["rollout.n_samples=1", "algo.estimator=reinforce_pp"]))


def test_reinforce_pp_keeps_the_score_of_a_response_ending_in_tool_tokens_verl_loses_it():
    """verl places the score on the response's last position and its REINFORCE++ return skips mask-0 positions:
    an episode whose response ends with tool tokens gets no score in verl; here it does. Every other episode of
    the batch agrees (their returns, and so the whitening statistics, differ only through that one)."""
    b = make_batch(seed=3, trailing_tool=4)
    b.records[4] = b.records[4].model_copy(update={"reward": 2.5})
    v = Verl(adv_estimator="reinforce_plus_plus", use_kl_in_reward=True, kl_ctrl=KL_CTRL)
    theirs, mine = verl_step(b, v), our_step(b, ours(v))
    m = theirs.masks[4] > 0
    # verl's return of the last model token of episode 4 is - beta * its own penalty: no score in it
    g_last_theirs = theirs.advantages[4][m][-1]
    g_last_mine = mine.advantages[4][m][-1]
    assert float(g_last_mine - g_last_theirs) > 0.3  # ours whitened with the score, theirs without it
    with pytest.raises(AssertionError):
        assert_same(mine, theirs)
    # the same batch without the trailing tool stretch agrees
    b2 = make_batch(seed=3)
    b2.records[4] = b2.records[4].model_copy(update={"reward": 2.5})
    assert_same(our_step(b2, ours(v)), verl_step(b2, v))


def test_reinforce_pp_default_whitening_is_ours_and_verls_is_one_setting():
    """algo.reinforce_pp_whiten: std (default: biased std + adv_eps) is not verl's masked_whiten (unbiased variance
    + 1e-8 under the root); verl gives verl's numbers (the rows above)."""
    b = make_batch(seed=1)
    v = Verl(adv_estimator="reinforce_plus_plus")
    theirs = verl_step(b, v)
    default = our_step(b, ours(v).model_copy(update={"reinforce_pp_whiten": "std"}))
    n = sum(float(m.sum()) for m in theirs.masks)
    ratio = torch.cat([d[m > 0] / t[m > 0] for d, t, m in zip(default.advantages, theirs.advantages, theirs.masks)])
    # sqrt(n / (n - 1)) apart: the Bessel factor
    torch.testing.assert_close(ratio, torch.full_like(ratio, math.sqrt(n / (n - 1))), rtol=1e-5, atol=0)
    assert_same(our_step(b, ours(v)), theirs)


@pytest.mark.parametrize("override", [
    "algo.loss_agg_mode=seq-mean-token-sum-norm", "algo.loss_agg_mode=token-sum", "algo.kl_type=abs",
    "algo.kl_type=k3+", "algo.kl_penalty=full", "algo.tis_cap=0.5_2.0", "algo.gamma=0.99", "algo.filter_groups=true",
])
def test_unmapped_verl_values_are_refused_not_misread(override):
    """The doc's "no equivalent" list: a config that names one is an error, never read as something else."""
    from agentloop.config import load_config
    from agentloop.errors import ConfigError

    with pytest.raises((ConfigError, ValueError)):
        load_config(None, [override])


def test_an_unimplemented_estimator_is_named():
    from agentloop.errors import ConfigError
    from agentloop.train.batch.advantages import get_estimator

    with pytest.raises(ConfigError, match="unknown advantage estimator 'gae'"):
        get_estimator(AlgoConfig(estimator="gae").estimator)


def test_reinforce_pp_whiten_is_validated_and_overridable():
    with pytest.raises(ValueError, match="applies to algo.estimator=reinforce_pp only"):
        AlgoConfig(reinforce_pp_whiten="verl")
    with pytest.raises(ValueError, match="reinforce_pp_whiten"):
        AlgoConfig(estimator="reinforce_pp", reinforce_pp_whiten="unbiased")
    from agentloop.config import load_config

    cfg = load_config(None, ["algo.estimator=reinforce_pp", "algo.reinforce_pp_whiten=verl"])
    assert cfg.algo.reinforce_pp_whiten == "verl"


def test_kl_in_reward_config_rules():
    with pytest.raises(ValueError, match="KL in the reward twice"):
        AlgoConfig(use_kl_in_reward=True, kl_coef=0.1, kl_type="k1_reward")
    with pytest.raises(ValueError, match="use algo.proximal=recompute"):
        AlgoConfig(use_kl_in_reward=True, proximal="interpolate")
    AlgoConfig(use_kl_in_reward=True, kl_coef=0.001, kl_type="k3")  # verl: both on is allowed


ROW = "test_doc_row_equals_verls_own_code"
CHECKED = {
    "algorithm.adv_estimator=grpo": ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward+kl_penalty=kl+grpo"],
    "algorithm.adv_estimator=rloo": ["algorithm.adv_estimator=rloo", "all-at-once-rloo"],
    "algorithm.adv_estimator=reinforce_plus_plus": [
        "algorithm.adv_estimator=reinforce_plus_plus", "all-at-once-reinforce_plus_plus",
        "test_reinforce_pp_default_whitening_is_ours_and_verls_is_one_setting",
        "test_reinforce_pp_keeps_the_score_of_a_response_ending_in_tool_tokens_verl_loses_it"],
    "algorithm.norm_adv_by_std_in_grpo": ["algorithm.norm_adv_by_std_in_grpo=false"],
    "actor.clip_ratio_low": ["actor.clip_ratio_low/high", "verl-defaults"],
    "actor.clip_ratio_c": ["actor.clip_ratio_c", "verl-defaults"],
    "actor.loss_agg_mode": [ROW, "test_micro_batching_and_layout_never_change_the_numbers"],
    "actor.entropy_coeff": ["actor.entropy_coeff"],
    "actor.use_kl_loss": [f"actor.use_kl_loss+kl_loss_type={t}" for t in KL_LOSS_TYPE],
    "actor.kl_loss_type": [f"actor.use_kl_loss+kl_loss_type={t}" for t in KL_LOSS_TYPE]
    + ["test_kl_loss_values_and_gradients_are_verls"],
    "algorithm.use_kl_in_reward": [f"algorithm.use_kl_in_reward+kl_penalty={p}+{e}" for p in ("kl", "low_var_kl")
                                   for e in ESTIMATOR],
    "algorithm.kl_penalty": [f"algorithm.use_kl_in_reward+kl_penalty={p}+grpo" for p in ("kl", "abs", "mse", "low_var_kl")]
    + ["test_reward_kl_penalty_is_verls_bit_for_bit"],
    "algorithm.kl_ctrl.type": ["algorithm.kl_ctrl.type=adaptive", "test_adaptive_kl_controller_is_verls"],
    "algorithm.rollout_correction.rollout_is": ["rollout_correction.rollout_is=token",
                                                "rollout_correction.rollout_is=sequence"],
    "algorithm.rollout_correction.rollout_rs": ["rollout_correction.rollout_rs=token_k2",
                                                "rollout_correction.rollout_rs=seq_max_k3",
                                                "test_rejection_masks_equal_verls"],
    "algorithm.rollout_correction.bypass_mode=true": ["rollout_correction.bypass_mode",
                                                      "rollout_correction.bypass_mode+rollout_is"],
}
"""The doc's "same" rows (by their first verl key) and the ROWS cases and tests that check them."""


def test_the_checked_version_and_rows_are_the_docs():
    """verl is the version the docs name, and the doc's "same" rows are exactly the checked ones."""
    assert verl.__version__ == VERL_VERSION
    doc = (ROOT / "docs" / "coming_from_verl.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert f"verl {VERL_VERSION}" in doc
    section = doc[doc.index("## Coming from verl"):]
    assert f"verl {VERL_VERSION}" in section[:section.index("\n## ")]
    line = next(x for x in readme.splitlines() if x.startswith("- [docs/coming_from_verl.md]"))  # the README's map
    assert f"verl {VERL_VERSION}" in line
    table = doc[doc.index("## Algorithm keys, checked against verl"):]
    same = re.findall(r"^\| `([^`]+)`[^|]*\|[^|]*\| same\b", table, flags=re.M)
    assert sorted(same) == sorted(CHECKED)
    ids = {p.id for p in ROWS}
    for key, where in CHECKED.items():
        for name in where:
            assert name in ids or callable(globals().get(name)), (key, name)
