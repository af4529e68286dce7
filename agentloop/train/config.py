"""Config sections of the learner: `AlgoConfig` (what is optimised) and `LearnerConfig` (how).

The root config mounts them as `Config.algo` and `Config.learner`; this module imports nothing
from agentloop.config so the learner process can parse its config without the rest of the tree.
Cross-field rules live in validators here, so a bad combination fails before any model loads.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class AlgoConfig(_Section):
    estimator: str = "grpo"
    """Advantage estimator, a name in `agentloop.train.advantages.ESTIMATORS`: grpo, rloo, reinforce_pp."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group's reward std. False = Dr. GRPO (mean baseline only)."""
    adv_eps: float = Field(default=1e-6, gt=0)
    """Added to a std before dividing by it."""
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
    kl_type: Literal["k1", "k3"] = "k3"
    """KL estimator per sampled token: k1 = logp - ref_logp; k3 = exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Weight of the entropy bonus (subtracted from the loss). Entropy is reported either way."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """The PPO ratio's denominator. recompute: the learner's own logprobs before the step (one extra
    forward pass); rollout: the server's logprobs from the records (no extra pass)."""
    tis_cap: float | None = Field(default=2.0, gt=1)
    """Truncated importance sampling cap for the rollout/learner mismatch (see losses.py for exactly
    how it is used in each old_logprobs mode). None disables the correction."""
    temperature: float = Field(default=1.0, gt=0)
    """The learner divides its logits by it, so it must be the rollouts' sampling temperature. In `agentloop
    train` it is sampling.temperature (agentloop.config.validate_for_training sets it; a different value
    set here is an error); set it directly only for a Learner used without the root config."""

    @model_validator(mode="after")
    def _check(self) -> "AlgoConfig":
        if self.clip_ratio_low >= 1:
            raise ValueError("clip_ratio_low must be < 1")
        return self


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
    """Training steps of linear warmup from 0 to `lr`."""
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
    share_prompt: Literal["auto", "on", "off"] = "auto"
    """Episodes with identical prompt tokens (a GRPO group) share one row: the prompt runs through the
    model once, then each response attends to it through a 4-D mask (agentloop.train.batching). Same
    logprobs and gradients, less compute when prompts are long and responses short, but the row's
    attention is dense. auto: share where the FLOP model says it is cheaper; on: always; off: never."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over each step's batch."""
    mini_batches: int = Field(default=1, ge=1)
    """Optimizer steps per epoch: the step's episodes are split into this many mini-batches."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype (master weights and optimizer state stay float32). auto: bfloat16 on GPU, float32 on CPU."""
    nproc: int = Field(default=1, ge=1)
    """Learner ranks (torchrun --nproc-per-node)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend. auto: nccl on GPU, gloo on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the learner runs. auto: cuda if a GPU is visible, else cpu."""
    checkpoint_every: int | None = Field(default=None, ge=1)
    """Save a resumable checkpoint (model, optimizer, step, data position, RNG) every N steps; None = never."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Complete checkpoints kept; older ones are deleted after a new one is complete."""
    keep_weights: int | None = Field(default=3, ge=1)
    """HF weight directories (weights/step-N) kept by the mailbox learner; None = keep all."""
    seed: int = 0
    """Seed of torch/numpy/python RNGs (each rank adds its rank)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    poll_s: float = Field(default=0.5, gt=0)
    """Mailbox: how often rank 0 looks for the next batch."""
    batch_timeout_s: float = Field(default=3600.0, gt=0)
    """Mailbox: the learner exits with an error if no batch arrives for this long."""
    weight_sync: Literal["disk", "tensor", "nccl"] = "disk"
    """How each step's weights reach the servers (agentloop.train.weight_sync). disk: rank 0 saves HF
    safetensors to weights/step-N and the orchestrator calls /update_weights_from_disk (needs only a
    shared filesystem). tensor: rank 0 passes CUDA IPC handles to /update_weights_from_tensor (servers
    on the learner's host, able to see its GPU). nccl: rank 0 broadcasts to the servers over a NCCL group
    (/init_weights_update_group + /update_weights_from_distributed; servers on any GPU the learner can
    reach over TCP). tensor and nccl need a GPU learner, push while the orchestrator holds the servers
    paused, and still save HF weights at checkpoint steps so a resumed run can reload its servers."""
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

    @field_validator("share_prompt", mode="before")
    @classmethod
    def _yaml_on_off(cls, v: Any) -> Any:
        # YAML reads a bare on/off as a boolean.
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _check(self) -> "LearnerConfig":
        if self.schedule == "cosine" and self.total_steps is None:
            raise ValueError("schedule='cosine' needs total_steps")
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) > total_steps ({self.total_steps})")
        if self.weight_sync != "disk" and self.device == "cpu":
            raise ValueError(f"weight_sync={self.weight_sync!r} needs a GPU learner (device cuda or auto)")
        return self


__all__ = ["AlgoConfig", "LearnerConfig", "LossAggMode"]
