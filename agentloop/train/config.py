"""Config sections of the learner: `AlgoConfig` (what is optimised) and `LearnerConfig` (how).

The root config mounts them as `Config.algo` and `Config.learner`; this module imports nothing
from agentloop.config so the learner process can parse its config without the rest of the tree.
Cross-field rules live in validators here, so a bad combination fails before any model loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


@dataclass(frozen=True)
class RsRule:
    """One rejection rule: `option` (one of RS_OPTIONS) and its bounds on the statistic."""

    option: str
    lower: float | None
    """k1 options: the lower bound, in log space (log of the user's number); None for k2/k3."""
    upper: float
    """k1 options: the upper bound in log space; k2/k3: the upper bound itself."""

    @property
    def level(self) -> str:
        """token, sum, mean or max."""
        return "token" if self.option.startswith("token") else self.option.split("_")[1]

    @property
    def kind(self) -> str:
        """k1, k2 or k3."""
        return self.option[-2:]


def parse_rollout_rs(options: str, threshold: str | float | None) -> list[RsRule]:
    """The rules of `algo.rollout_rs` = `options` with `algo.rollout_rs_threshold` = `threshold`
    (ValueError naming the part that is wrong)."""
    names: list[str] = []
    for opt in (o.strip() for o in str(options).split(",")):
        if not opt:
            continue
        if opt not in RS_OPTIONS:
            raise ValueError(f"algo.rollout_rs option {opt!r} is not one of {list(RS_OPTIONS)}")
        if opt not in names:
            names.append(opt)
    if not names:
        raise ValueError("algo.rollout_rs holds no option")
    if threshold is None:
        raise ValueError("algo.rollout_rs needs algo.rollout_rs_threshold")
    specs = [str(threshold)] if isinstance(threshold, (int, float)) else \
        [p.strip() for p in str(threshold).split(",") if p.strip()]
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ValueError(f"algo.rollout_rs_threshold has {len(specs)} entries for {len(names)} options "
                         f"({names}); give one, or one per option")
    rules = []
    for opt, spec in zip(names, specs):
        if opt.endswith("k1"):
            lo, _, hi = spec.partition("_")
            try:
                upper = float(hi) if hi else float(lo)
                lower = float(lo) if hi else 1.0 / upper
            except (ValueError, ZeroDivisionError):
                raise ValueError(f"algo.rollout_rs_threshold {spec!r} for {opt} is not 'lower_upper' or a "
                                 "positive number") from None
            if lower <= 0 or upper <= 0:
                raise ValueError(f"algo.rollout_rs_threshold {spec!r} for {opt}: bounds must be positive")
            rules.append(RsRule(opt, math.log(lower), math.log(upper)))
        else:
            try:
                upper = float(spec)
            except ValueError:
                raise ValueError(f"algo.rollout_rs_threshold {spec!r} for {opt} must be one positive number "
                                 "(an upper bound)") from None
            if upper <= 0:
                raise ValueError(f"algo.rollout_rs_threshold {spec!r} for {opt} must be positive")
            rules.append(RsRule(opt, None, upper))
    return rules


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class AlgoConfig(_Section):
    estimator: str = "grpo"
    """Advantage estimator, a name in `agentloop.train.batch.advantages.ESTIMATORS`: grpo, rloo, reinforce_pp."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group's reward std. False = Dr. GRPO (mean baseline only)."""
    adv_eps: float = Field(default=1e-6, gt=0)
    """Added to a std before dividing by it."""
    reinforce_pp_whiten: Literal["std", "verl"] = "std"
    """How estimator=reinforce_pp whitens the returns over the step's model tokens (mean m): std: (G - m) / (s +
    adv_eps), s the biased (population) standard deviation; verl: (G - m) / sqrt(v + 1e-8), v the unbiased (n - 1)
    variance, verl's masked_whiten (its algorithm.adv_estimator=reinforce_plus_plus). Only with reinforce_pp."""
    drop_zero_variance_groups: bool = False
    """Drop groups whose rewards are all equal (their advantages are 0) from the loss and its denominators."""
    clip_ratio_low: float = Field(default=0.2, ge=0, lt=1)
    """PPO clip: the ratio is kept >= 1 - clip_ratio_low (for negative advantages)."""
    clip_ratio_high: float = Field(default=0.28, ge=0)
    """PPO clip: the ratio is kept <= 1 + clip_ratio_high (for positive advantages); may differ from low."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token losses become one number: mean over all model tokens of the mini-batch,
    mean over sequences of each sequence's token sum, or mean over sequences of each sequence's token mean."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL penalty to the frozen initial model. 0 = no reference model is loaded."""
    kl_type: Literal["k1", "k2", "k3", "k1_reward"] = "k3"
    """How the KL penalty enters, from sampled-token logprobs (d = logp - ref_logp). As a loss term
    (kl_coef * value per token):
    k1 = d: its value estimates KL(pi||ref), but its expected gradient is zero (E_pi[grad log pi] = 0):
    it only adds noise; kept for comparison.
    k2 = d^2 / 2: its on-policy expected gradient is that of KL(pi||ref) (the usual choice for a loss).
    k3 = exp(-d) + d - 1 (>= 0, capped at `kl_value_max`): its expected gradient is that of the *reverse*
    KL(ref||pi), not KL(pi||ref); it is the GRPO paper's term.
    In the reward: k1_reward = kl_coef * (old_logp - ref_logp) is subtracted from each model token's
    reward, summed from that token to the end of its episode (the KL penalty's return), and the advantage
    of every token is lowered by it after the estimator: the policy gradient of -kl_coef * KL(pi||ref) over
    whole sequences, unbiased. verl's order (the penalty before the estimator) is `use_kl_in_reward`."""
    kl_value_max: float = Field(default=10.0, gt=0)
    """k3 only: per-token KL values are capped here (with zero gradient beyond), so one token whose
    logprob fell far below the reference's cannot dominate the loss (uncapped, exp(ref - logp) explodes)."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Weight of the entropy bonus (subtracted from the loss). Entropy is reported either way
    (`learner.entropy_metric`)."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """The PPO ratio's denominator. recompute: a proximal policy, the learner's weights at the start of the
    step (decoupled PPO: the rollout's behaviour logprobs only weight the tokens, see `tis_cap`); how its
    logprobs are obtained: `proximal`. rollout: the server's (behaviour) logprobs from the records
    (standard PPO around the sampling policy; no extra pass, no importance weight)."""
    proximal: Literal["recompute", "interpolate"] = "recompute"
    """old_logprobs=recompute: how the proximal logprobs are obtained. recompute: the learner's own
    forward pass with the step's starting weights (skipped when one epoch of one mini-batch makes them
    the loss pass's own, detached). interpolate: no forward pass; per token, log-linear interpolation
    between the behaviour logprob (version v) and the current policy's (counted as version s) at the
    proximal version s-1 (AReaL's approximation): old = behav + (lag / (lag + 1)) * (logp - behav),
    lag = (s - 1) - v. Needs `token_versions` in the records (asynchronous rollouts)."""
    tis_cap: float | None = Field(default=2.0, gt=1)
    """Truncated importance sampling: each token's loss is multiplied by the detached weight
    min(pi_proximal / pi_behaviour, tis_cap), which corrects for tokens sampled by other weights
    (staleness) or another engine (rollout/learner mismatch). Used with old_logprobs=recompute (with
    rollout the ratio already is pi / pi_behaviour). None = no weight."""
    mask_ratio_low: float | None = Field(default=None, ge=0, lt=1)
    """old_logprobs=recompute: tokens whose pi_proximal / pi_behaviour is below this are masked out of the
    loss (they contribute nothing; the aggregation denominators still count them). None = off."""
    mask_ratio_high: float | None = Field(default=None, gt=1)
    """old_logprobs=recompute: tokens whose pi_proximal / pi_behaviour is above this are masked out of the
    loss, like `mask_ratio_low`. None = off."""
    tis_level: Literal["token", "sequence"] = "token"
    """What `tis_cap` weighs (verl's algorithm.rollout_correction.rollout_is): token: each token by its own
    min(pi_proximal / pi_behaviour, tis_cap); sequence: every token of an episode by min(prod over the episode's
    model tokens of pi_proximal / pi_behaviour, tis_cap), the product taken as exp of the summed log-ratio
    bounded to [-20, 20]; tokens that `rollout_rs` rejected stay in the product (verl weighs before it rejects)."""
    rollout_rs: str | None = None
    """verl's algorithm.rollout_correction.rollout_rs: rejection sampling on the step-start (proximal) policy
    against the behaviour one, r = pi_proximal / pi_behaviour per token. Comma-separated options, all must
    pass: token_k1, token_k2, token_k3 (per token), seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3 (per
    episode: the sum, mean or max of the token statistic over its model tokens; a rejected episode loses every
    token). Statistics: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r (log r bounded to [-20, 20]).
    Rejected tokens leave the loss, the token-mean denominator and REINFORCE++'s returns and whitening, as verl's
    modified response mask does; a fully rejected episode still counts as a sequence of its mini-batch in the
    seq-mean-* modes (verl's trainer divides by the mini-batch's episode count). Needs old_logprobs=recompute with
    proximal=recompute (a no-grad pass at the start of every step). None = off."""
    rollout_rs_threshold: str | float | None = None
    """Thresholds of `rollout_rs`, verl's format: one entry, or one per option, comma-separated. k1 options:
    "lower_upper" (kept when log(lower) <= k1 <= log(upper)) or one number u (lower = 1/u); k2/k3 options:
    one upper bound (kept when the statistic <= it)."""
    dual_clip: float | None = Field(default=None, gt=1)
    """Dual-clip PPO (Ye et al. 2020), in every mode: for A < 0 the per-token policy loss is capped at
    -A * dual_clip, so a token whose ratio exploded cannot dominate the step. None = off. verl always applies
    it with actor.clip_ratio_c = 3.0."""
    use_kl_in_reward: bool = False
    """verl's algorithm.use_kl_in_reward: before the advantage estimator, each model token's reward is lowered
    by beta * kl_penalty(old, ref) (old: the step-start logprobs, or the behaviour ones with
    old_logprobs=rollout; beta: `kl_ctrl_coef`, adapted by `kl_ctrl`), so grpo and rloo see
    reward - beta * (the episode's summed penalty) and reinforce_pp whitens each token's return-to-go
    over the batch's tokens. Loads the reference model and, with old_logprobs=recompute, runs a no-grad pass
    of the policy at the start of every step. Independent of kl_coef (the KL loss), as in verl."""
    kl_penalty: Literal["kl", "abs", "mse", "low_var_kl"] = "kl"
    """verl's algorithm.kl_penalty, the per-token penalty of `use_kl_in_reward`, d = old - ref: kl = d,
    abs = |d|, mse = d^2 / 2, low_var_kl = exp(-d) + d - 1 (-d bounded to [-20, 20], value to [-10, 10])."""
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    """verl's algorithm.kl_ctrl.type: fixed keeps beta = kl_ctrl_coef; adaptive (Ziegler et al. 2019) multiplies
    it after every step by 1 + clip(kl / kl_ctrl_target - 1, -0.2, 0.2) * episodes / kl_ctrl_horizon, kl the
    mean over episodes of each one's mean penalty (its value is saved in learner checkpoints)."""
    kl_ctrl_coef: float = Field(default=0.001, ge=0)
    """verl's algorithm.kl_ctrl.kl_coef: the (initial) beta of `use_kl_in_reward`."""
    kl_ctrl_target: float = Field(default=0.1, gt=0)
    """verl's algorithm.kl_ctrl.target_kl (adaptive controller)."""
    kl_ctrl_horizon: int = Field(default=10000, ge=1)
    """verl's algorithm.kl_ctrl.horizon (adaptive controller)."""
    temperature: float = Field(default=1.0, gt=0)
    """The learner divides its logits by it, so it must be the rollouts' sampling temperature. In `agentloop
    train` it is sampling.temperature (agentloop.config.validate_for_training sets it; a different value
    set here is an error); set it directly only for a Learner used without the root config."""

    @model_validator(mode="after")
    def _check(self) -> "AlgoConfig":
        if self.clip_ratio_low >= 1:
            raise ValueError("clip_ratio_low must be < 1")
        if self.estimator == "reinforce_pp" and self.drop_zero_variance_groups:
            raise ValueError("algo.estimator=reinforce_pp with algo.drop_zero_variance_groups=true: REINFORCE++ "
                             "whitens rewards over the whole batch, so a group of equal rewards still has "
                             "non-zero advantages and dropping it would drop real signal; set one of them otherwise")
        if self.reinforce_pp_whiten != "std" and self.estimator != "reinforce_pp":
            raise ValueError(f"algo.reinforce_pp_whiten={self.reinforce_pp_whiten!r} applies to "
                             f"algo.estimator=reinforce_pp only (estimator is {self.estimator!r}); leave it 'std'")
        if self.rollout_rs is not None:
            parse_rollout_rs(self.rollout_rs, self.rollout_rs_threshold)  # a bad spec fails here, named
            if self.old_logprobs != "recompute" or self.proximal != "recompute":
                raise ValueError("algo.rollout_rs needs algo.old_logprobs=recompute and algo.proximal=recompute: "
                                 "the rejection is decided once per step on the step-start policy (verl's "
                                 "decoupled mode); verl's bypass-mode rejection against the moving policy has no "
                                 "equivalent here")
        elif self.rollout_rs_threshold is not None:
            raise ValueError("algo.rollout_rs_threshold is set but algo.rollout_rs is not")
        if self.use_kl_in_reward:
            if self.kl_coef > 0 and self.kl_type == "k1_reward":
                raise ValueError("algo.use_kl_in_reward=true with algo.kl_type=k1_reward puts the KL in the reward "
                                 "twice; use one of them")
            if self.old_logprobs == "recompute" and self.proximal == "interpolate":
                raise ValueError("algo.use_kl_in_reward needs the step-start logprobs before the update: use "
                                 "algo.proximal=recompute (or algo.old_logprobs=rollout)")
        if self.old_logprobs == "rollout":
            if self.proximal != "recompute":
                raise ValueError(f"algo.proximal={self.proximal!r} needs algo.old_logprobs=recompute (with rollout "
                                 "the ratio's denominator is the behaviour policy itself)")
            if self.mask_ratio_low is not None or self.mask_ratio_high is not None:
                raise ValueError("algo.mask_ratio_low/high need algo.old_logprobs=recompute (they threshold "
                                 "pi_proximal / pi_behaviour)")
        return self


LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(_Section):
    enabled: bool = False
    """Train a LoRA adapter instead of the full weights (agentloop.train.lora): the base model is frozen, each
    target projection gets a rank-`rank` update B A (B zero at the start: the first policy is the base model), the
    optimizer holds only the adapters, and every step's adapter (a few MB) is loaded into the servers as a
    versioned adapter (/load_lora_adapter; episodes generate with it, each token's version names it)."""
    rank: int = Field(default=16, ge=1)
    """The adapters' rank r."""
    alpha: float = Field(default=32.0, gt=0)
    """LoRA alpha: the update is scaled by alpha / rank (as PEFT and SGLang do; no rsLoRA)."""
    target_modules: list[str] = Field(default_factory=lambda: sorted(LORA_DEFAULT_TARGETS))
    """Names (the last part) of the linear layers that get adapters; the LM head and embeddings never do."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapters' input in the loss pass only (the recomputed and served logprobs never drop);
    0 keeps the loss pass's logprobs equal to the servers' (exactness), so it is the default."""
    seed: int = 0
    """Seed of the adapters' initial A matrices (B starts at zero)."""

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("learner.lora.target_modules is empty: name at least one linear layer (e.g. q_proj)")
        bad = [m for m in v if m in ("lm_head", "embed_tokens")]
        if bad:
            raise ValueError(f"learner.lora.target_modules={bad}: the LM head and the embeddings take no adapter here")
        return sorted(set(v))


class LearnerConfig(_Section):
    lr: float = Field(default=1e-6, gt=0)
    """Peak learning rate of AdamW."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    adam_eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW decoupled weight decay."""
    warmup_steps: int = Field(default=0, ge=0)
    """Training steps of linear warmup from 0 to `lr`; clipped to `total_steps` when that is smaller
    (the learner says so in its log), so a short run still reaches `lr` at its last step."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning rate after warmup: constant, or cosine decay to `min_lr_ratio * lr` at `total_steps`."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Cosine schedule floor, as a fraction of `lr`."""
    total_steps: int | None = Field(default=None, ge=1)
    """Training steps of the run (needed by the cosine schedule)."""
    grad_clip: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this; None = no clipping (the norm is still reported)."""
    micro_batch_tokens: int = Field(default=8192, ge=1)
    """Token budget of one forward/backward: sequences are packed greedily until their summed
    lengths would exceed it (a longer sequence gets a micro-batch of its own)."""
    attention: Literal["auto", "varlen", "flex", "packed_sdpa", "padded"] = "auto"
    """How a micro-batch is laid out and how attention sees its sequence boundaries
    (agentloop.train.trainer.collate, agentloop.train.trainer.attention). varlen: one packed row without padding,
    position ids per sequence, FlashAttention-2's variable-length kernels (aten's) over one segment per
    sequence, prompt or response (a response reads its shared prompt's keys: no masked pair is computed);
    CUDA with bf16/fp16 compute (on CPU an exact per-segment reference, for tests: slow). flex: the same
    packed row, FlexAttention with a block mask (whole blocks of masked pairs are skipped); CUDA only
    (FlexAttention has no CPU backward). packed_sdpa: the same packed row, SDPA with a dense boolean mask
    (any device; the mask is micro_batch_tokens^2). padded: a row per episode (or per shared prompt),
    right-padded, SDPA with a 2-D or 4-D mask. auto: varlen on CUDA where its kernels exist for the
    model's head dimension and dtype, else flex (else packed_sdpa); padded on CPU."""
    share_prompt: Literal["auto", "on", "off"] = "auto"
    """Episodes with identical prompt tokens (a GRPO group) share one row: the prompt runs through the
    model once, then each response attends to it and to itself only (agentloop.train.trainer.collate). Same
    logprobs and gradients, fewer tokens computed. auto: with attention=varlen or flex always (neither
    computes the masked pairs, so sharing is never more work); with padded/packed_sdpa where the FLOP
    model says the dense row is cheaper; on: always; off: never."""
    logprob_chunk_tokens: int = Field(default=2048, ge=1)
    """Log-probabilities (and entropy) are computed from the final hidden states this many tokens at a
    time, the LM head's matmul included, and recomputed chunk by chunk in the backward pass, so no
    [tokens x vocabulary] float32 tensor ever exists (peak extra memory ~ 3 * chunk * vocab * 4 bytes)."""
    fuse_logprob_head: bool = True
    """On CUDA, each chunk's logprob/entropy math runs through torch.compile: one or two fused passes over
    the chunk's logits instead of about eight elementwise ones (falls back to eager if compiling fails)."""
    pad_packed_to_budget: bool = False
    """Packed layouts: pad every micro-batch to exactly micro_batch_tokens, so every forward has one shape
    (FlexAttention and compiled layers compile once, without dynamic shapes) at the cost of computing the
    padding of the last micro-batches. False: pad each to a multiple of 128 (flex) or not at all."""
    entropy_metric: bool = True
    """Compute the policy's entropy for the actor/entropy metric even when entropy_coef = 0 (one more
    pass over each chunk's logits in the loss pass, no gradient). False: only when entropy_coef > 0."""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile each decoder layer of the trained and the reference model (dynamic shapes; the first
    steps pay the compile time, ~25-35 s for the 0.5B shape on an H100): norms, rotary embedding,
    activation and residuals fuse into fewer kernels. The flex attention kernel is compiled either way;
    the varlen kernels are custom ops inside the compiled graph. auto: on for a CUDA learner (measured on
    one H100, 0.5B shape, 512 x (362 + 512): 4.95 -> 3.54 s per step, benchmarks/RESULTS_learner.md),
    off on CPU. YAML true/false read as on/off."""
    checkpoint_background: Literal["auto", "on", "off"] = "auto"
    """on: write resumable checkpoints in the background (torch.distributed.checkpoint.async_save): training
    waits only for the copy of the state to host memory, the files are written while the next steps run,
    and the checkpoint is renamed into place (atomic, as a synchronous one) as soon as it is complete. A
    kill before that leaves the previous checkpoint the latest, so a resume may redo one step more than
    with off. off: the step waits for the whole save (update.done of a checkpoint step follows it).
    auto: on for a CUDA learner, off on CPU (where copy, write and training share the same cores). (Named
    checkpoint_async before: "async" in the config is train.schedule's word alone, module agentloop.config.)"""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over each step's batch."""
    mini_batches: int = Field(default=1, ge=1)
    """Optimizer steps per epoch: the step's episodes are split into this many mini-batches."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype (master weights and optimizer state stay float32). auto: bfloat16 on GPU, float32 on CPU."""
    ranks: int | None = Field(default=None, ge=1)
    """The learner's ranks in all (its world size, `world_size`; one GPU each on a CUDA learner): under torchrun
    `nnodes` hosts of ranks / nnodes each (torchrun --nproc-per-node, `ranks_per_node`), with cluster.backend=ray
    the rank actors Ray places. None: one rank per host (`nnodes`, 1 by default). (Replaces learner.nproc, which
    counted one host's ranks under torchrun but all of them under Ray.)"""
    nnodes: int = Field(default=1, ge=1)
    """Hosts the learner spans without Ray (torchrun --nnodes, with its c10d rendezvous at `rdzv_endpoint`): the
    run starts the first node's ranks, and `agentloop learner-node --run-dir RUN_DIR` starts each other node's
    (the run dir on a filesystem every node sees at the same path: the mailbox, weights and checkpoints live there).
    `ranks` is a multiple of it."""
    rdzv_endpoint: str | None = None
    """nnodes > 1: host:port of torchrun's rendezvous, reachable from every learner node (the first node's
    address and a free port)."""
    gpus: list[int] | None = None
    """GPUs the learner ranks use (CUDA_VISIBLE_DEVICES of the learner; at least `ranks_per_node` of them). None:
    every visible GPU, rank r on GPU r. With servers on other GPUs, use weight_sync nccl or disk (CUDA IPC,
    `tensor`, needs the learner and the servers on the same GPUs)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend. auto: nccl on GPU, gloo on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the learner runs. auto: cuda if a GPU is visible, else cpu."""
    checkpoint_every: int | None = Field(default=None, ge=1)
    """Save a resumable checkpoint (model, optimizer, step, data position, RNG) every N steps. Left unset,
    `agentloop train` picks max(1, min(10, train.steps // 4)); an explicit null means no periodic
    checkpoint: a killed run starts over. Either way a run that ends normally checkpoints its last step."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Complete checkpoints kept; older ones are deleted after a new one is complete."""
    keep_weights: int | None = Field(default=3, ge=1)
    """HF weight directories (weights/step-N) kept by the mailbox learner; None = keep all. Those of the
    newest checkpoint (and of one still being written) are kept as well, so a resume can load them."""
    seed: int = 0
    """Seed of torch/numpy/python RNGs (each rank adds its rank)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory, ~30% more compute)."""
    poll_s: float = Field(default=0.5, gt=0)
    """Mailbox: how often rank 0 looks for the next batch."""
    batch_timeout_s: float = Field(default=3600.0, gt=0)
    """Mailbox: the learner exits with an error if no batch arrives for this long."""
    weight_sync: Literal["disk", "tensor", "nccl"] = "disk"
    """How each step's weights reach the servers (agentloop.train.weights.sync). disk: rank 0 saves HF
    safetensors to weights/step-N and the orchestrator calls /update_weights_from_disk (needs only a
    shared filesystem). tensor: rank 0 passes CUDA IPC handles to /update_weights_from_tensor (servers
    on the learner's host, able to see its GPU). nccl: rank 0 broadcasts to the servers over a NCCL group
    (/init_weights_update_group + /update_weights_from_distributed; servers on any GPU the learner can
    reach over TCP). With learner.lora: disk writes the PEFT adapter directory (/load_lora_adapter), tensor hands
    the adapter's tensors to /load_lora_adapter_from_tensors (CUDA IPC handles; a CPU learner sends them by
    value), nccl is refused. tensor and nccl need a GPU learner and push while the orchestrator holds the servers
    paused; they save no HF weights while training, only weights/step-N of the last step at the end
    of the run (like every path) and weights/step-C of the checkpoint a learner resumes from."""
    weight_sync_bucket_mb: float = Field(default=512.0, gt=0)
    """tensor/nccl: MiB of weights per server call (one flattened bucket; rank 0 holds one bucket of
    gathered weights at a time). A tensor larger than this goes alone."""
    weight_sync_master_addr: str | None = None
    """nccl: address at which the servers reach the learner's rendezvous store (learner rank 0 is
    group rank 0). None: 127.0.0.1 when every server URL is a loopback address, else this host's IP."""
    weight_sync_master_port: int = Field(default=0, ge=0, le=65535)
    """nccl: TCP port of that store; 0 picks a free port when the group is created."""
    weight_sync_timeout_s: float = Field(default=600.0, gt=0)
    """tensor/nccl: deadline of each call to a server, of the NCCL group's rendezvous and collectives,
    and of rank 0's wait for the orchestrator to pause the servers."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA training (disabled by default): see LoraConfig."""

    @field_validator("share_prompt", "checkpoint_background", "compile", mode="before")
    @classmethod
    def _yaml_on_off(cls, v: Any) -> Any:
        # YAML reads a bare on/off as a boolean.
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _check(self) -> "LearnerConfig":
        if self.schedule == "cosine" and self.total_steps is None:
            raise ValueError("schedule='cosine' needs total_steps")
        if self.attention == "flex" and self.device == "cpu":
            raise ValueError("learner.attention=flex needs a CUDA learner (FlexAttention has no CPU backward); "
                             "use packed_sdpa or padded on CPU")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"learner.nnodes={self.nnodes} needs learner.rdzv_endpoint=HOST:PORT (torchrun's "
                             "rendezvous, reachable from every learner node)")
        if self.rdzv_endpoint is not None and ":" not in self.rdzv_endpoint:
            raise ValueError(f"learner.rdzv_endpoint={self.rdzv_endpoint!r}: expected HOST:PORT")
        if self.ranks is not None and self.ranks % self.nnodes:
            raise ValueError(f"learner.ranks={self.ranks} is not a multiple of learner.nnodes={self.nnodes}: every "
                             "host runs the same number of ranks (learner.ranks counts them all)")
        if self.lora.enabled and self.weight_sync == "nccl":
            raise ValueError("learner.lora.enabled with learner.weight_sync='nccl': SGLang loads an adapter from a "
                             "directory (/load_lora_adapter) or from tensors handed over on its host "
                             "(/load_lora_adapter_from_tensors), never over a NCCL group; use weight_sync=tensor "
                             "(servers on the learner's host) or disk")
        lora_tensor = self.lora.enabled and self.weight_sync == "tensor"  # a CPU learner's adapter goes by value
        if self.weight_sync != "disk" and self.device == "cpu" and not lora_tensor:
            raise ValueError(f"weight_sync={self.weight_sync!r} needs a GPU learner (device cuda or auto)")
        return self

    @property
    def world_size(self) -> int:
        """The learner's ranks in all: `ranks`, or one per host."""
        return self.nnodes if self.ranks is None else self.ranks

    @property
    def ranks_per_node(self) -> int:
        """The ranks of one host of a torchrun learner (--nproc-per-node): world_size / nnodes; with
        cluster.backend=ray (nnodes 1) all of them."""
        return self.world_size // self.nnodes


__all__ = ["AlgoConfig", "LORA_DEFAULT_TARGETS", "LearnerConfig", "LoraConfig",
           "LossAggMode", "RS_OPTIONS", "RsRule", "parse_rollout_rs"]
