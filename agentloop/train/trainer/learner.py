"""The FSDP2 learner: the `Learner` class, usable in-process (the learner process runs it through
agentloop.train.trainer.serve).

Map:
    lr_at                  warmup (clipped to total_steps) + constant/cosine schedule, a pure function of the step
    Learner                model + optimizer (+ reference); layout, compute_logprobs, train_batch (a prepared
                           batch), train_step (records: prepares the batch itself), save_hf, save_checkpoint (sync
                           or background), poll/wait_checkpoint, load_checkpoint, close

Who calls whom: Learner -> collate / attention / logprobs / losses / checkpoint / verl_order; the Learner never
touches the learner handle or the weight transport (agentloop.train.trainer.serve does), so it is the API for an
in-process trainer too. The step's batch arrives prepared (agentloop.train.batch: advantages and every rank's
micro-batches, computed by the orchestrator); `train_step(records)` prepares one itself.

How a step runs (train_step):
  * Model check (first, from the config alone): agentloop.train.model_support refuses a model the learner
    cannot run exactly (attention soft cap, sinks, recurrent layers, a sliding window shorter than the run's
    sequences, ...) and names the head transform (soft cap, logit scale) its logprob head applies.
  * Model loading: rank 0 reads the HF weights once (float32, host); every rank builds the model on the
    meta device, shards it (FSDP2 `fully_shard` per decoder layer, then the root; bf16 compute with
    float32 master weights and reductions on GPU) and receives its shards from rank 0.
  * Layout (learner.attention): on CUDA, micro-batches are packed rows without padding, each sequence
    with its own position ids, attention through a FlexAttention block mask that also expresses shared
    prompts block-sparsely (agentloop.train.trainer.attention); on CPU, padded rows (or packed ones with a dense
    mask). The model is checked to run an attention implementation that applies that mask.
  * Logprobs and entropy come from the final hidden states through agentloop.train.trainer.logprobs, in chunks:
    no [tokens x vocab] float32 tensor exists, in the forward or the backward pass. The model's own
    post-processing of its head output is switched off and applied by that head; a forward that still
    changes the head's output fails the step.
  * Losses and metrics accumulate on the device; the host reads them once per optimizer step (the
    gradient norm) and once at the end.
  * Old (proximal) logprobs: the loss pass's own when the weights have not moved yet, else a no-grad
    forward pass (algo.proximal=recompute) or AReaL's interpolation from the token versions
    (algo.proximal=interpolate).
  * Checkpoints (serve, learner.checkpoint_background): written in the background; the next optimizer step
    waits only for the copy of the state.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from agentloop.models.loading import copy_aux_files
from agentloop.train.config import AlgoConfig, LearnerConfig
from agentloop.train.probe import PROBE_TOKENS, probe_ids
from agentloop.train.trainer.distributed import broadcast, init_distributed, resolve_device
from agentloop.util.fsio import replace_dir

# Heavy imports (torch, transformers) happen inside functions, after the config has parsed.
__all__ = ["Learner", "lr_at", "needs_reference", "old_logprob_pass", "verl_order"]


def _whole_local(p: Any) -> Any:
    """The local tensor of a DTensor parameter on a one-rank mesh (the whole tensor), without `to_local()`'s autograd
    wrapper; `to_local()` where torch names its field otherwise."""
    local = getattr(p, "_local_tensor", None)
    return local.detach() if local is not None else p.detach().to_local()


def lr_at(step: int, cfg: LearnerConfig) -> float:
    """Learning rate of training step `step` (1-based): linear warmup (clipped to total_steps), then
    constant or cosine."""
    warmup = min(cfg.warmup_steps, cfg.total_steps) if cfg.total_steps is not None else cfg.warmup_steps
    if warmup and step <= warmup:
        return cfg.lr * step / warmup
    if cfg.schedule == "constant":
        return cfg.lr
    total = cfg.total_steps or step
    progress = min(max((step - warmup) / max(total - warmup, 1), 0.0), 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def old_logprob_pass(algo, cfg) -> bool:
    """Whether a step runs a separate no-grad forward for the old logprobs.

    Only when they are recomputed and the weights move before the last loss pass: with one epoch of
    one mini-batch the weights are untouched until the single optimizer step, so the recomputed
    logprobs would equal the loss pass's own (detached), and that forward is skipped.
    """
    return algo.old_logprobs == "recompute" and (cfg.ppo_epochs > 1 or cfg.mini_batches > 1 or verl_order(algo))


def verl_order(algo) -> bool:
    """Whether a step decides masks and advantages from the step-start logprobs before the update (verl's
    KL in the reward, rejection sampling: agentloop.train.trainer.verl_order), which then need their own pass."""
    return algo.use_kl_in_reward or algo.rollout_rs is not None


def needs_reference(algo) -> bool:
    """Whether the frozen reference model is loaded (the KL loss, or the KL in the reward)."""
    return algo.kl_coef > 0 or algo.use_kl_in_reward


class Learner:
    """An FSDP2-sharded policy (and optional frozen reference) with its AdamW optimizer.

    Every rank of the process group constructs one and calls every method (they are collective),
    with the same arguments; `train_step` on every rank gets the full record list and takes its
    own share.
    """

    def __init__(self, model_path: str | Path, algo: AlgoConfig | None = None, cfg: LearnerConfig | None = None, *,
                 max_len: int | None = None):
        """`max_len`: the longest sequence the run can produce (model.context_length), for the model check
        (agentloop.train.model_support; None: the model's max_position_embeddings)."""
        import random

        import numpy as np
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoConfig

        from agentloop.train.batch.advantages import get_estimator
        from agentloop.train.model_support import require_model_support
        from agentloop.train.trainer.attention import register_flex, register_varlen, resolve_attention

        self.algo = algo or AlgoConfig()
        self.cfg = cfg or LearnerConfig()
        get_estimator(self.algo.estimator)  # an unknown name fails before the model loads
        self.model_path = Path(model_path)
        self.device_type = resolve_device(self.cfg)
        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        # before anything is built: a model the learner cannot run exactly is refused with its reasons
        self.support = require_model_support(self.hf_config, max_len=max_len, where=str(self.model_path))
        hc = self.hf_config
        head_dim = getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads
        self._owns_group = init_distributed(self.cfg, self.device_type)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        if self.device_type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        dt = self.cfg.dtype if self.cfg.dtype != "auto" else ("bfloat16" if self.device_type == "cuda" else "float32")
        self.compute_dtype = getattr(torch, dt)
        self.attention = resolve_attention(self.cfg.attention, self.device_type, head_dim, self.compute_dtype)
        self.compiled = self.cfg.compile == "on" or (self.cfg.compile == "auto" and self.device_type == "cuda")
        """learner.compile after auto: the decoder layers run through torch.compile."""
        if self.attention == "flex":
            register_flex()
        elif self.attention == "varlen":
            register_varlen()
        seed = self.cfg.seed + self.rank
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

        self.lora = self.cfg.lora if self.cfg.lora.enabled else None
        """learner.lora when enabled: the model trains LoRA adapters on a frozen base (agentloop.train.lora)."""
        self._adapter_views: dict[Any, Any] = {}
        """adapter_bucket's views of the adapter (one rank) by the dtype it hands over, made on first use."""
        self.pad_id = self.hf_config.pad_token_id if isinstance(self.hf_config.pad_token_id, int) else 0
        self.mesh = init_device_mesh(self.device_type, (self.world,))
        self.notes: list[str] = [f"model: {line}" for line in self.support.applied]
        """Things the learner decided that a user should know (printed by `serve`)."""
        if self.cfg.total_steps is not None and self.cfg.warmup_steps > self.cfg.total_steps:
            self.notes.append(f"learner.warmup_steps {self.cfg.warmup_steps} > learner.total_steps "
                              f"{self.cfg.total_steps}: warmup clipped to {self.cfg.total_steps} steps")
        # Rank 0 reads the weights once (float32, on the host); every rank builds its model on the meta
        # device, shards it, and receives its shards from rank 0 (no full copy on the other ranks).
        src = self._load_source() if self.rank == 0 else None
        self.model = self._build(src, dtype=torch.float32, trainable=True)
        from agentloop.train.flops import flop_params, peak_tflops, row_cost

        self.row_cost = row_cost(self.model)
        self.n_params = flop_params(self.model)
        self.peak_tflops = peak_tflops(torch.cuda.get_device_name(self.device)) if self.device_type == "cuda" else None
        self.ref_model = None
        if needs_reference(self.algo):
            self.ref_model = self._build(src, dtype=self.compute_dtype, trainable=False)
        del src
        from agentloop.train.trainer.logprobs import LogprobHead

        transform = self.support.transform()
        self._heads = {id(self.model): LogprobHead(self.model, transform)}
        if self.ref_model is not None:
            self._heads[id(self.ref_model)] = LogprobHead(self.ref_model, transform)
        # LoRA: only the adapters are trainable (agentloop.train.lora), so the optimizer holds only them
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=self.cfg.lr, betas=self.cfg.betas,
            eps=self.cfg.adam_eps,
            weight_decay=self.cfg.weight_decay,
        )
        self._ckpt = None  # CheckpointWriter, created at the first background save
        from agentloop.train.trainer.verl_order import KLController

        self.kl_ctrl = KLController(self.algo)
        """beta of algo.use_kl_in_reward (adaptive: saved in checkpoints' extra as kl_ctrl_value)."""
        self.step = 0
        """Last training step applied to the weights (0 = none)."""

    # model construction ------------------------------------------------------------------------
    def _load_source(self) -> dict[str, Any]:
        """Rank 0: the HF model's float32 state dict and the tensors a meta-built model lacks (buffers
        that are not in the state dict, such as rotary frequencies, and tensor attributes)."""
        import torch
        from transformers import AutoModelForCausalLM

        src = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32, attn_implementation="sdpa")
        extras = {f"{mn}.{an}" if mn else an: t.detach().clone()
                  for mn, mod in src.named_modules() for an, t in vars(mod).items() if isinstance(t, torch.Tensor)}
        extras.update({f"buffer:{n}": b.detach().clone() for n, b in src.named_buffers()})
        return {"state": src.state_dict(), "extras": extras}

    def _build(self, src: dict[str, Any] | None, *, dtype: Any, trainable: bool):
        """Collective: the model on the meta device, sharded, materialized on this rank's device, filled from
        rank 0's `src` (None on the other ranks)."""
        import copy

        import torch
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )
        from transformers import AutoModelForCausalLM

        from agentloop.train.model_support import neutralize_head
        from agentloop.train.trainer.attention import check_attn_impl, model_attn_impl

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(self.hf_config), dtype=dtype,
                                                     attn_implementation=model_attn_impl(self.attention))
        check_attn_impl(model, self.attention)
        neutralize_head(model, self.support)  # its LogprobHead applies the head transform instead
        model.config.use_cache = False
        lora_init: dict[str, Any] = {}
        if trainable and self.lora is not None:
            from agentloop.train.lora import initial_adapter, inject_lora

            names = inject_lora(model, self.lora)  # the base frozen, the adapters trainable
            if src is not None:  # rank 0: the adapters' initial tensors travel with the base weights
                lora_init = initial_adapter(src["state"], names, self.lora.rank, self.lora.seed)
        if trainable and self.cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not trainable:
            model.requires_grad_(False)
        layers = self._layers(model)  # before sharding renames their classes (FSDPQwen2DecoderLayer)
        model = self._shard(model, mixed=trainable and self.compute_dtype != torch.float32, trainable=trainable)
        model.to_empty(device=self.device)
        state = {} if src is None else {k: v.to(dtype) for k, v in {**src["state"], **lora_init}.items()}
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True,
                                                                    broadcast_from_rank0=self.world > 1))
        extras = broadcast(None if src is None else src["extras"], self.device if self.device_type == "cuda" else None)
        self._fill_extras(model, extras)
        if self.compiled:  # the reference model's no-grad forward gains from fused layers too
            for layer in layers:
                layer.compile()
        model.train(trainable)
        return model

    def _fill_extras(self, model, extras: dict[str, Any]) -> None:
        """Buffers and tensor attributes that `to_empty` left uninitialized, from rank 0's loaded model."""
        import torch

        mods = dict(model.named_modules())
        for name, t in extras.items():
            if name.startswith("buffer:"):
                mn, _, bn = name[len("buffer:"):].rpartition(".")
                buf = mods[mn]._buffers.get(bn)
                if buf is not None and not isinstance(buf, torch.distributed.tensor.DTensor):
                    with torch.no_grad():
                        buf.copy_(t.to(buf.dtype))
            else:
                mn, _, an = name.rpartition(".")
                mod = mods.get(mn)
                if mod is not None and isinstance(vars(mod).get(an), torch.Tensor):
                    setattr(mod, an, t.to(self.device))

    @staticmethod
    def _layers(model) -> list:
        blocks = set(getattr(model, "_no_split_modules", None) or ())
        layers = [m for m in model.modules() if type(m).__name__ in blocks]
        if not layers:
            raise ValueError(f"{type(model).__name__}: no decoder layers found to shard (_no_split_modules={blocks})")
        return layers

    def _shard(self, model, *, mixed: bool, trainable: bool = True):
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if mixed:
            mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        else:
            mp = MixedPrecisionPolicy()
        # One rank: keep the layers' gathered parameters from the forward for the backward (no second
        # gather); several: free them after the forward (memory scales with the model, not the world).
        reshard = self.world > 1 or not trainable
        for layer in self._layers(model):
            fully_shard(layer, mesh=self.mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=self.mesh, mp_policy=mp)
        return model

    # forward ---------------------------------------------------------------------------------
    def layout(self):
        """How this learner lays out micro-batches (agentloop.train.batch.format.BatchLayout): what the
        orchestrator plans a step's batch for. Shared prompts per config (auto: always with varlen/flex, which
        never compute a shared row's masked pairs), packed rows for varlen/flex/packed_sdpa."""
        from agentloop.train.batch.format import BatchLayout
        from agentloop.train.trainer.attention import BLOCK

        share = self.cfg.share_prompt
        if share == "auto" and self.attention in ("flex", "varlen"):
            share = "on"  # neither computes a shared row's masked pairs (block-sparse / per segment): never more work
        packed = self.attention in ("flex", "varlen", "packed_sdpa")
        pad = 1
        if packed and self.cfg.pad_packed_to_budget:
            pad = self.cfg.micro_batch_tokens
        elif self.attention == "flex":
            pad = BLOCK
        return BatchLayout(world=self.world, layout="packed" if packed else "padded", share=share,
                           row_cost=(self.row_cost.per_token, self.row_cost.per_pair),
                           budget=self.cfg.micro_batch_tokens, pad_multiple=pad, pad_id=self.pad_id,
                           mini_batches=self.cfg.mini_batches, seed=self.cfg.seed)

    def _collate(self, eps, micro_batches, idxs, layout):
        """This rank's micro-batches (rows of episode indices) of the mini-batch `idxs`, as tensors."""
        from agentloop.train.batch.packing import mini_batch_totals
        from agentloop.train.trainer.collate import collate_micro_batches

        num_tokens, num_seqs = mini_batch_totals(eps, idxs)
        return collate_micro_batches(eps, micro_batches, self.algo.loss_agg_mode, num_tokens=num_tokens,
                                     num_seqs=num_seqs, pad_id=layout.pad_id, layout=layout.layout,
                                     pad_multiple=layout.pad_multiple)

    def _plan(self, eps, idxs):
        """This rank's micro-batches of episodes[idxs] (token budget, shared prompts per config)."""
        from agentloop.train.batch.packing import plan_ranks
        from agentloop.train.flops import RowCost

        lay = self.layout()
        mine = plan_ranks(eps, idxs, budget=lay.budget, world=lay.world, share=lay.share,
                          cost=RowCost(*lay.row_cost))[self.rank]
        return self._collate(eps, mine, idxs, lay)

    def _to_device(self, mb) -> None:
        """Move micro-batch `mb` to the learner's device, its attention inputs built first: the varlen
        segments are read from the host's copy of the row's ids, so no forward waits on a device-to-host copy
        (a sync per micro-batch would stall the queued kernels)."""
        from agentloop.train.trainer.attention import attention_inputs

        attention_inputs(mb, self.attention, self.device)
        mb.to(self.device)

    def _reshard(self) -> None:
        """Free every FSDP2 unsharded parameter, so the next forward gathers them afresh."""
        for m in self.model.modules():
            if hasattr(m, "reshard") and hasattr(m, "unshard"):
                m.reshard()

    def _forward(self, model, mb, *, entropy: bool, entropy_grad: bool):
        """(logp, entropy or None) of mb's targets, Tensor[b, L] float32, without [L x vocab] tensors."""
        from agentloop.train.trainer.attention import attention_inputs

        head = self._heads[id(model)]
        attn = attention_inputs(mb, self.attention, self.device)
        with head.use(mb.targets, entropy=entropy, entropy_grad=entropy_grad, temperature=self.algo.temperature,
                      chunk=self.cfg.logprob_chunk_tokens,
                      fused=self.cfg.fuse_logprob_head and self.device_type == "cuda"):
            out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, **attn)
        res = out.logits
        if not head.returned_as_is(res):
            raise RuntimeError(
                f"{type(model).__name__} ({self.hf_config.model_type}) changed its LM head's output in its forward "
                "(a post-processing of the logits agentloop.train.model_support does not know), so the learner's "
                "logprobs would be wrong; add the model type to model_support.HEAD_TRANSFORMS")
        return res[..., 0], (res[..., 1] if entropy else None)

    def _episodes(self, records) -> list:
        from agentloop.train.batch.episodes import Episode

        return [Episode(list(r.prompt_ids) + list(r.response_ids), len(r.prompt_ids), list(r.response_mask),
                        list(r.response_logprobs), 0.0, 0.0) for r in records]

    def probe(self, n: int = PROBE_TOKENS) -> dict[str, Any]:
        """The learner's forward of a fixed token sequence: {"ids", "logprobs" of ids[1:]} at temperature 1 (what
        SGLang's input log-probs are, whatever the sampling temperature). Collective."""
        ids = probe_ids(int(getattr(self.hf_config, "vocab_size", 0) or 0), n)
        rec = SimpleNamespace(prompt_ids=ids[:1], response_ids=ids[1:], response_mask=[1] * (len(ids) - 1),
                              response_logprobs=[0.0] * (len(ids) - 1))
        algo = self.algo
        self.algo = algo.model_copy(update={"temperature": 1.0})
        try:
            return {"ids": ids, "logprobs": [float(x) for x in self.compute_logprobs([rec])[0]]}
        finally:
            self.algo = algo

    def compute_logprobs(self, records) -> list[list[float]]:
        """Current-policy logprobs of each record's response tokens (0.0 on mask-0 tokens).

        Collective; every rank gets the full list. Failed records are not skipped here.
        """
        import torch
        import torch.distributed as dist

        eps = self._episodes(records)
        result: dict[int, list[float]] = {}
        with torch.no_grad():
            outs = []
            for mb in self._plan(eps, list(range(len(eps)))):
                self._to_device(mb)
                logp, _ = self._forward(self.model, mb, entropy=False, entropy_grad=False)
                outs.append((mb, logp * mb.loss_mask))
            for mb, logp in outs:  # one read-back per micro-batch, after every forward is queued
                logp = logp.cpu()
                for i, (row, s, k) in zip(mb.episode_ids, mb.spans):
                    result[i] = logp[row, s:s + k].tolist()
        self._reshard()  # see train_step: no-grad gathered params must not serve a later loss pass
        if self.world > 1:
            parts: list[Any] = [None] * self.world
            dist.all_gather_object(parts, result)
            for p in parts:
                result.update(p)
        return [result[i] for i in range(len(eps))]

    # training --------------------------------------------------------------------------------
    def _sync(self) -> None:
        import torch

        if self.device_type == "cuda":
            torch.cuda.synchronize(self.device)

    def train_step(self, records, step: int) -> dict[str, float]:
        """One training step on `records` (every rank passes the same full list): the batch the orchestrator
        would send (agentloop.train.batch.prepare.prepare_batch with this learner's layout), then `train_batch`."""
        from agentloop.train.batch.prepare import prepare_batch

        return self.train_batch(prepare_batch(list(records), self.algo, self.layout(), step))

    def train_batch(self, batch) -> dict[str, float]:
        """One training step on a prepared batch: this rank's share of it (agentloop.train.batch.format.RankBatch,
        read from the batch file), or a whole TrainBatch (every rank passes the same one and takes its share);
        returns metrics.

        The batch holds the episodes that enter the loss with their advantages and every rank's micro-batches;
        then `ppo_epochs` x `mini_batches` optimizer steps. Metric names: batch/*, reward/*, adv/*, actor/*,
        mismatch/*, async/*, time/*, perf/*. Losses and metrics stay on the device until the step's end: the
        host waits for the device once per optimizer step (the gradient norm decides whether to step) and once
        at the end.
        """
        import torch
        import torch.distributed as dist

        from agentloop.train.batch.format import TrainBatch
        from agentloop.train.trainer.collate import kl_reward_advantages
        from agentloop.train.trainer.losses import Stats, interpolate_proximal

        t0 = time.perf_counter()
        if isinstance(batch, TrainBatch):
            batch = batch.for_rank(self.rank)
        if batch.rank != self.rank:
            raise ValueError(f"rank {self.rank} was handed rank {batch.rank}'s share of step {batch.step}")
        algo, cfg = self.algo, self.cfg
        step = batch.step
        mine = self.layout()
        if (batch.layout.world, batch.layout.layout) != (mine.world, mine.layout):
            raise ValueError(f"step {step}: the batch was planned for {batch.layout.world} rank(s) of "
                             f"{batch.layout.layout} rows; this learner runs {mine.world} of {mine.layout} rows")
        eps = batch.episodes
        n = batch.num_episodes
        lr = lr_at(step, cfg)
        metrics: dict[str, float] = dict(batch.metrics)
        metrics["actor/lr"] = lr
        if not n:
            self.step = step
            metrics["actor/skipped"] = 1.0
            return metrics
        interpolate = algo.old_logprobs == "recompute" and algo.proximal == "interpolate"
        if interpolate and batch.unversioned >= 0:
            raise ValueError(f"algo.proximal=interpolate needs the weight version of every model token "
                             f"(token_versions, from asynchronous rollouts); episode {batch.unversioned} of step "
                             f"{step} has none or some unknown")
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        minis = batch.minis
        plans = [self._collate(eps, per_rank[self.rank], idxs, batch.layout)
                 for idxs, per_rank in zip(minis, batch.plan)]
        for mbs in plans:
            for mb in mbs:
                self._to_device(mb)

        t1 = time.perf_counter()
        recompute = algo.old_logprobs == "recompute"
        moves = old_logprob_pass(algo, cfg)  # the weights move before the last loss pass
        old_pass = moves and not interpolate
        kl_reward = algo.kl_coef > 0 and algo.kl_type == "k1_reward"
        if old_pass or self.ref_model is not None:
            with torch.no_grad():
                for mbs in plans:
                    for mb in mbs:
                        if old_pass:
                            mb.old_logprobs, _ = self._forward(self.model, mb, entropy=False, entropy_grad=False)
                        if self.ref_model is not None:
                            mb.ref_logprobs, _ = self._forward(self.ref_model, mb, entropy=False, entropy_grad=False)
        if verl_order(algo):
            from agentloop.train.trainer.verl_order import apply_verl_order

            def reduce_sum(t):
                if self.world > 1:
                    dist.all_reduce(t)

            beta = self.kl_ctrl.value
            vm, current_kl = apply_verl_order(plans, minis, batch.prepared(), algo, beta, all_reduce=reduce_sum)
            metrics.update(vm)
            if algo.use_kl_in_reward:
                self.kl_ctrl.update(current_kl, n)
        if old_pass:
            # FSDP2 keeps the root's parameters (embeddings, tied lm_head, final norm) unsharded after a
            # forward; ones gathered under no_grad then serve the loss pass, and the tied weight's
            # gradient came out wrong (test_on_policy_step_skips_...: 14-57% off an unsharded reference).
            # The reference model is never trained, so its no-grad pass needs no reshard.
            self._reshard()
        self._sync()

        t2 = time.perf_counter()
        stats = Stats()
        params = [p for p in self.model.parameters() if p.requires_grad]
        losses: list[Any] = []
        grad_norms: list[float] = []
        skipped = 0
        want_entropy = algo.entropy_coef > 0 or cfg.entropy_metric
        want_entropy_grad = algo.entropy_coef > 0
        first_pass = True  # the weights are still the step's starting (proximal) ones
        for _epoch in range(cfg.ppo_epochs):
            for mbs in plans:
                self.optimizer.zero_grad(set_to_none=True)
                part = None
                for j, mb in enumerate(mbs):
                    self.model.set_requires_gradient_sync(j == len(mbs) - 1)
                    logp, ent = self._forward(self.model, mb, entropy=want_entropy, entropy_grad=want_entropy_grad)
                    if not recompute:
                        old = mb.rollout_logprobs
                    elif first_pass:
                        old = logp.detach()  # exact: no update has happened yet in this step
                    elif interpolate:
                        old = interpolate_proximal(mb.rollout_logprobs, logp, (step - 1) - mb.versions)
                    else:
                        old = mb.old_logprobs
                    if recompute and mb.versions is not None and mb.old_logprobs is not None:
                        # how far AReaL's interpolation is from the recomputed proximal logprobs
                        approx = interpolate_proximal(mb.rollout_logprobs, logp, (step - 1) - mb.versions)
                        known = (mb.loss_mask > 0) & (mb.versions >= 0)
                        stats.add_mean("mismatch/interpolate_abs_err", ((approx - old).abs() * known).sum(),
                                       known.sum())
                    adv = mb.advantages
                    if kl_reward:
                        adv, pen = kl_reward_advantages(mb, adv, old, mb.ref_logprobs, algo.kl_coef)
                        stats.add_mean("actor/kl_penalty", pen.sum() / algo.kl_coef, mb.loss_mask.sum())
                    out = mb.loss(logp, old, adv, algo, entropy=ent)
                    (out.loss * self.world).backward()
                    part = out.loss.detach() if part is None else part + out.loss.detach()
                    stats.merge(out.stats)
                losses.append(part)
                max_norm = cfg.grad_clip if cfg.grad_clip is not None else float("inf")
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
                norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                norm = float(norm)
                grad_norms.append(norm)
                if self._ckpt is not None:
                    self._ckpt.wait_staged()  # a background checkpoint must have copied the weights first
                if math.isfinite(norm):
                    self.optimizer.step()
                else:
                    skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
                first_pass = False
        self.model.set_requires_gradient_sync(True)
        self._sync()
        t3 = time.perf_counter()

        stats.all_reduce()
        loss_t = torch.stack([x.to(torch.float64) for x in losses])
        if self.world > 1:
            dist.all_reduce(loss_t)
        losses = loss_t.tolist()
        # What the forward passes computed (each prompt once per shared row), summed over ranks.
        all_mbs = [mb for mbs in plans for mb in mbs]
        work = torch.tensor([float(sum(sum(mb.row_lengths) for mb in all_mbs)),
                             float(sum(sum(mb.row_attn_sq) for mb in all_mbs)),
                             float(sum(mb.shared_rows for mb in all_mbs)),
                             float(sum(mb.input_ids.numel() for mb in all_mbs))], dtype=torch.float64,
                            device=loss_t.device)
        if self.world > 1:
            dist.all_reduce(work)
        computed, computed_sq, shared_rows, padded = work.tolist()
        metrics.update(stats.result())
        metrics["actor/loss"] = sum(losses) / len(losses)
        n_mb = len(minis)
        if cfg.ppo_epochs > 1:
            for e in range(cfg.ppo_epochs):
                metrics[f"actor/loss_epoch{e}"] = sum(losses[e * n_mb:(e + 1) * n_mb]) / n_mb
        metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["actor/grad_norm_max"] = max(grad_norms)
        metrics["actor/optimizer_steps"] = float(len(grad_norms) - skipped)
        metrics["actor/skipped_nonfinite"] = float(skipped)
        metrics["actor/micro_batches"] = float(len(all_mbs))
        metrics["time/prepare_s"] = t1 - t0
        metrics["time/logprobs_s"] = t2 - t1
        metrics["time/update_s"] = t3 - t2
        episode_tokens = batch.episode_tokens
        metrics["perf/tokens_per_s"] = episode_tokens * cfg.ppo_epochs / max(t3 - t0, 1e-9)
        if self.device_type == "cuda":
            metrics["perf/peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            metrics["perf/peak_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        from agentloop.train.flops import step_flops_from_sums

        hf = self.hf_config
        fl = step_flops_from_sums(self.n_params, hf.num_hidden_layers, hf.hidden_size, computed, computed_sq,
                                  train_passes=cfg.ppo_epochs,
                                  forward_passes=int(old_pass) + int(self.ref_model is not None))
        tflops = fl["total"] / max(t3 - t0, 1e-9) / self.world / 1e12
        metrics["perf/model_tflop"] = fl["total"] / 1e12  # the FLOP model of agentloop.train.flops, all ranks
        metrics["perf/tflops_per_device"] = tflops
        if self.peak_tflops:
            metrics["perf/mfu"] = tflops / self.peak_tflops
        metrics["batch/computed_tokens"] = computed
        # the attention term of the FLOP model (agentloop.train.flops): sum of S^2 per sequence, a shared
        # prompt's pairs counted once
        metrics["batch/computed_tokens_sq"] = computed_sq
        metrics["batch/padded_tokens"] = padded  # positions the model ran, padding included
        metrics["batch/shared_rows"] = shared_rows  # rows holding a prompt and several responses
        metrics["batch/prompt_share_saving"] = 1.0 - computed / max(episode_tokens, 1)
        self.step = step
        return metrics

    # saving ----------------------------------------------------------------------------------
    def save_served(self, path: str | Path) -> Path:
        """Collective: what the servers load for this step at `path`: the PEFT adapter directory with LoRA
        (`save_adapter`), else the HF directory (`save_hf`)."""
        return self.save_adapter(path) if self.lora is not None else self.save_hf(path)

    def save_adapter(self, path: str | Path) -> Path:
        """Collective (LoRA only): gather the adapters (only them, a few MB) to rank 0 and write a PEFT adapter
        directory at `path` (adapter_config.json + adapter_model.safetensors in the compute dtype), atomically."""
        import torch.distributed as dist

        from agentloop.train.lora import save_adapter

        if self.lora is None:
            raise ValueError("save_adapter: this learner trains full weights (learner.lora.enabled is false)")
        state = self.adapter_tensors(on_device=False)
        path = Path(path)
        if self.rank == 0:
            save_adapter(path, state, self.lora, dtype=self.compute_dtype, base_model=str(self.model_path))
        dist.barrier()
        return path

    def adapter_tensors(self, *, on_device: bool) -> dict[str, Any]:
        """Collective (LoRA only): the full adapter tensors under our names (`...q_proj.lora_A.weight`) on rank 0,
        {} on the others; `on_device`: left on the learner's device in the compute dtype (what weight_sync=tensor
        hands over), else on the CPU as trained."""
        from agentloop.train.lora import is_lora_key

        if self.lora is None:
            raise ValueError("adapter_tensors: this learner trains full weights (learner.lora.enabled is false)")
        import torch

        state = {}
        # one gather per tensor, in the same order on every rank. Packing them into one all-gather was measured
        # slower (0.5B shape, rank 32, 336 tensors, one CPU rank: 178 ms against 81 ms). On a mesh of one rank the
        # local shard is the whole tensor: no collective at all (each full_tensor() is a DTensor redistribution and
        # an all-gather, ~0.25 ms of host time apiece), and neither a DTensor's detach() nor its to_local(), a
        # dispatch of ~50-70 us each (21 of an H200's 88 ms push at 336 tensors, GPU acceptance s5 calls 1-2)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if is_lora_key(name):
                    if hasattr(p, "full_tensor"):
                        t = _whole_local(p) if p.device_mesh.size() == 1 else p.detach().full_tensor()
                    else:
                        t = p.detach()
                    if self.rank == 0:
                        state[name] = t if on_device else t.cpu()
            if on_device and state:
                # one concatenation and one cast for the lot, views of it handed back (a cast per tensor was 336
                # kernels and allocations at rank 32 on the 0.5B shape); serialize_adapter sends that one tensor
                flat = torch.cat([t.reshape(-1) for t in state.values()]).to(self.compute_dtype)
                parts = flat.split([t.numel() for t in state.values()])
                state = {k: v.view(t.shape) for (k, t), v in zip(state.items(), parts)}
        return state

    def adapter_bucket(self, *, on_device: bool) -> tuple[Any, list[SimpleNamespace]] | None:
        """Collective (LoRA only): the adapter as one flattened bucket under PEFT's names (uint8, and SGLang's
        flattened_bucket byte ranges) on rank 0, None on the others; `on_device` as in adapter_tensors. One rank
        reads it through views made once (agentloop.train.trainer.adapter_view), no per-tensor work per push."""
        from agentloop.train.lora import adapter_state
        from agentloop.train.trainer.adapter_view import AdapterView
        from agentloop.train.weights.tensor import adapter_bucket

        if self.lora is None:
            raise ValueError("adapter_bucket: this learner trains full weights (learner.lora.enabled is false)")
        if self.world > 1 or (not on_device and self.device_type != "cpu"):
            state = self.adapter_tensors(on_device=on_device)
            return adapter_bucket(adapter_state(state)) if self.rank == 0 else None
        dtype = self.compute_dtype if on_device else None
        view = self._adapter_views.get(dtype)
        if view is None or not view.current():
            view = self._adapter_views[dtype] = AdapterView(self.model, dtype)
        return view.bucket(), view.meta

    def save_hf(self, path: str | Path, *, max_shard_bytes: int = 5 * 1024**3) -> Path:
        """Collective: gather full weights to rank 0 and write an HF directory at `path`.

        With LoRA, the adapters are merged into their base weights (W + alpha/r * B A, in float32) first.
        Weights are written in the compute dtype as safetensors (sharded with an index above
        `max_shard_bytes`), plus config.json and the model directory's tokenizer / generation
        files, into a temp dir renamed into place, so SGLang's /update_weights_from_disk never
        sees a partial directory. Returns `path`.
        """
        import torch
        import torch.distributed as dist
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        path = Path(path)
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
            try:
                if self.lora is not None:
                    from agentloop.train.lora import merge_state

                    sd = merge_state(sd, self.lora.alpha / self.lora.rank)
                if getattr(self.hf_config, "tie_word_embeddings", False):
                    sd.pop("lm_head.weight", None)
                tensors = {k: v.detach().to(self.compute_dtype).contiguous().clone() for k, v in sd.items()}
                shards: list[dict[str, torch.Tensor]] = [{}]
                size = 0
                for k, v in tensors.items():
                    nbytes = v.numel() * v.element_size()
                    if shards[-1] and size + nbytes > max_shard_bytes:
                        shards.append({})
                        size = 0
                    shards[-1][k] = v
                    size += nbytes
                if len(shards) == 1:
                    save_file(shards[0], tmp / "model.safetensors", metadata={"format": "pt"})
                else:
                    weight_map = {}
                    for i, sh in enumerate(shards, 1):
                        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                        save_file(sh, tmp / name, metadata={"format": "pt"})
                        weight_map.update({k: name for k in sh})
                    total = sum(v.numel() * v.element_size() for v in tensors.values())
                    (tmp / "model.safetensors.index.json").write_text(
                        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
                copy_aux_files(self.model_path, tmp)
                conf = self.hf_config.__class__.from_dict(self.hf_config.to_dict())
                conf.dtype = self.compute_dtype
                conf.save_pretrained(tmp)
                replace_dir(tmp, path)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        del sd
        dist.barrier()
        return path

    def save_checkpoint(
        self, root: str | Path, *, data_position: Any = None, extra: dict[str, Any] | None = None,
        background: bool = False,
    ) -> Path:
        """Collective: resumable checkpoint of `self.step` under root (see agentloop.train.trainer.checkpoint).

        background=True: returns once the state is being copied; the files are written while training goes
        on and the checkpoint appears (atomically) when `poll_checkpoint` / `wait_checkpoint` finalizes it.
        """
        from agentloop.train.trainer.checkpoint import CheckpointWriter, save_checkpoint

        if self.kl_ctrl.adaptive:
            extra = {**(extra or {}), "kl_ctrl_value": self.kl_ctrl.value}
        if not background:
            self.wait_checkpoint()
            return save_checkpoint(root, self.step, self.model, self.optimizer, data_position=data_position,
                                   extra=extra, keep=self.cfg.keep_checkpoints)
        if self._ckpt is None or self._ckpt.root != Path(root):
            if self._ckpt is not None:
                self._ckpt.close()
            self._ckpt = CheckpointWriter(root, keep=self.cfg.keep_checkpoints, device_type=self.device_type)
        return self._ckpt.save(self.step, self.model, self.optimizer, data_position=data_position, extra=extra)

    def checkpoint_written_s(self) -> float | None:
        """Finalize a background checkpoint whose files are written (local, never blocks); the seconds its
        writing took when that happened now, else None."""
        if self._ckpt is not None and self._ckpt.poll() is not None:
            return self._ckpt.last_written_s
        return None

    def poll_checkpoint(self) -> Path | None:
        """Finalize a background checkpoint whose files are written (local, never blocks); its path or None."""
        return self._ckpt.poll() if self._ckpt is not None else None

    def wait_checkpoint(self) -> Path | None:
        """Block until a background checkpoint is complete and in place; its path or None."""
        return self._ckpt.wait() if self._ckpt is not None else None

    def load_checkpoint(self, path: str | Path):
        """Collective: restore weights, optimizer, RNG and `self.step`; returns the CheckpointMeta."""
        from agentloop.train.trainer.checkpoint import load_checkpoint

        self.wait_checkpoint()
        meta = load_checkpoint(path, self.model, self.optimizer)
        self.step = meta.step
        if self.kl_ctrl.adaptive and "kl_ctrl_value" in meta.extra:
            self.kl_ctrl.value = float(meta.extra["kl_ctrl_value"])
        return meta

    def close(self) -> None:
        """Finish a background checkpoint, free the models; destroy the process group if this Learner created it."""
        import torch.distributed as dist

        if self._ckpt is not None:
            try:
                self._ckpt.close()
            finally:
                self._ckpt = None
        self.model = None
        self.ref_model = None
        self.optimizer = None
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False


