"""The FSDP2 learner: a `Learner` class (usable in-process) and the mailbox-driven learner process.

Launch (one machine, N ranks; gloo on CPU, nccl on GPU):

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m agentloop.train.learner --run-dir RUN_DIR --model MODEL_DIR \\
        [--config CONFIG.yaml] [--set algo.kl_coef=0.01 --set learner.lr=1e-6 ...] \\
        [--no-resume] [--heartbeat-s 5]

With one rank, `python -m agentloop.train.learner ...` works too (it starts its own
single-rank process group). `learner_command(...)` builds either command line.

    --run-dir    shared directory with mailbox/, weights/, checkpoints/ (see agentloop.train.mailbox)
    --model      HF model directory to start from (also the frozen reference when kl_coef > 0)
    --config     YAML or JSON file; its `algo:` and `learner:` sections are used, other
                 top-level keys are ignored (so the run's resolved config file works as is)
    --set        `algo.key=value` / `learner.key=value` overrides, values parsed as YAML
    --no-resume  start from --model even if RUN_DIR/checkpoints holds a checkpoint

The process trains mailbox steps in order until RUN_DIR/mailbox/STOP appears (exit 0; a final STOP,
the run's normal end, first saves the last step's HF weights and checkpoint where missing), a
step fails (update.failed written, exit 1) or no batch arrives within
`learner.batch_timeout_s` (exit 2). The resolved config is written to
RUN_DIR/learner_config.json.

Its log (LearnerProcess points stdout and stderr at RUN_DIR/learner.log): rank 0 writes one line
when the model is loaded, when it is ready (fresh or resumed), per step (loss, grad norm, KL,
entropy, tokens/s, time, where the weights went) before the step's update.done appears, per
checkpoint, and when it stops, times out or fails (with the traceback); other ranks write warnings
only. Lines go through the `agentloop.train.learner` logger, whose handler `main` installs on stdout
and which flushes every line, so they reach the file as they happen whatever the stdout buffering.

Map:
    lr_at                  warmup (clipped to total_steps) + constant/cosine schedule, a pure function of the step
    init_distributed       join torchrun's process group, or make a single-rank one
    Learner                model + optimizer (+ reference); compute_logprobs, train_step, save_hf,
                           save_checkpoint (sync or background), poll/wait_checkpoint, load_checkpoint, close
    serve                  the learner loop (rank 0 polls the inbox and broadcasts; every rank trains and logs);
                           the inbox is the file mailbox, or the Ray learner's (agentloop.cluster)
    plan_final_save        what the end of a run still writes (pure); save_final writes it, for every sync path
    log_to_stdout          the learner process's log handler (flushed line by line)
    _ask_push              weight_sync tensor|nccl: ask for paused servers, learn where to push (every rank)
    main                   the command line (learner_process.learner_command builds it)

Who calls whom: serve -> Learner -> batching / attention / logprobs / losses / checkpoint; serve ->
weight_sync (the transport's learner half: save or push); Learner never touches the mailbox, so it is the API
for an in-process trainer too. The step's batch arrives prepared (batch_plan.TrainBatch: advantages and every
rank's micro-batches, computed by the orchestrator); `train_step(records)` prepares one itself.

How a step runs (train_step):
  * Model check (first, from the config alone): agentloop.train.model_support refuses a model the learner
    cannot run exactly (attention soft cap, sinks, recurrent layers, a sliding window shorter than the run's
    sequences, ...) and names the head transform (soft cap, logit scale) its logprob head applies.
  * Model loading: rank 0 reads the HF weights once (float32, host); every rank builds the model on the
    meta device, shards it (FSDP2 `fully_shard` per decoder layer, then the root; bf16 compute with
    float32 master weights and reductions on GPU) and receives its shards from rank 0.
  * Layout (learner.attention): on CUDA, micro-batches are packed rows without padding, each sequence
    with its own position ids, attention through a FlexAttention block mask that also expresses shared
    prompts block-sparsely (agentloop.train.attention); on CPU, padded rows (or packed ones with a dense
    mask). The model is checked to run an attention implementation that applies that mask.
  * Logprobs and entropy come from the final hidden states through agentloop.train.logprobs, in chunks:
    no [tokens x vocab] float32 tensor exists, in the forward or the backward pass. The model's own
    post-processing of its head output is switched off and applied by that head; a forward that still
    changes the head's output fails the step.
  * Losses and metrics accumulate on the device; the host reads them once per optimizer step (the
    gradient norm) and once at the end.
  * Old (proximal) logprobs: the loss pass's own when the weights have not moved yet, else a no-grad
    forward pass (algo.proximal=recompute) or AReaL's interpolation from the token versions
    (algo.proximal=interpolate).
  * Checkpoints (serve, learner.checkpoint_async): written in the background; the next optimizer step
    waits only for the copy of the state.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from agentloop.train.config import AlgoConfig, LearnerConfig
from agentloop.train.probe import PROBE_TOKENS, probe_ids

# Heavy imports (torch, transformers) happen inside functions, after the config has parsed.
logger = logging.getLogger("agentloop.train.learner")
__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_TIMEOUT",
    "FinalPlan",
    "Learner",
    "init_distributed",
    "load_sections",
    "log_to_stdout",
    "lr_at",
    "main",
    "plan_final_save",
    "resolve_device",
    "save_final",
    "serve",
]


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


def resolve_device(cfg: LearnerConfig) -> str:
    import torch

    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def init_distributed(cfg: LearnerConfig, device: str) -> bool:
    """Join torchrun's group (env RANK/WORLD_SIZE) or create a one-rank group on an in-memory store.

    Returns True when this call created the group (so `Learner.close` destroys it); an already
    initialised group is reused as is.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
    kw: dict[str, Any] = {}
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        kw["device_id"] = torch.device("cuda", local)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, **kw)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
    return True


def _copy_aux_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config, chat template...: every top-level file except weights and config.json."""
    skip_suffix = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
    for f in src.iterdir():
        if not f.is_file() or f.name == "config.json" or f.name.endswith(skip_suffix) or f.name.endswith(".index.json"):
            continue
        shutil.copy2(f, dst / f.name)


def old_logprob_pass(algo, cfg) -> bool:
    """Whether a step runs a separate no-grad forward for the old logprobs.

    Only when they are recomputed and the weights move before the last loss pass: with one epoch of
    one mini-batch the weights are untouched until the single optimizer step, so the recomputed
    logprobs would equal the loss pass's own (detached), and that forward is skipped.
    """
    return algo.old_logprobs == "recompute" and (cfg.ppo_epochs > 1 or cfg.mini_batches > 1 or verl_order(algo))


def verl_order(algo) -> bool:
    """Whether a step decides masks and advantages from the step-start logprobs before the update (verl's
    KL in the reward, rejection sampling: agentloop.train.verl_order), which then need their own pass."""
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

        from agentloop.train.advantages import get_estimator
        from agentloop.train.attention import register_flex, register_varlen, resolve_attention
        from agentloop.train.model_support import require_model_support

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
        from agentloop.train.logprobs import LogprobHead

        transform = self.support.transform()
        self._heads = {id(self.model): LogprobHead(self.model, transform)}
        if self.ref_model is not None:
            self._heads[id(self.ref_model)] = LogprobHead(self.ref_model, transform)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.cfg.lr, betas=self.cfg.betas, eps=self.cfg.adam_eps,
            weight_decay=self.cfg.weight_decay,
        )
        self._ckpt = None  # CheckpointWriter, created at the first background save
        from agentloop.train.verl_order import KLController

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

        from agentloop.train.attention import check_attn_impl, model_attn_impl
        from agentloop.train.model_support import neutralize_head

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(self.hf_config), dtype=dtype,
                                                     attn_implementation=model_attn_impl(self.attention))
        check_attn_impl(model, self.attention)
        neutralize_head(model, self.support)  # its LogprobHead applies the head transform instead
        model.config.use_cache = False
        if trainable and self.cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not trainable:
            model.requires_grad_(False)
        layers = self._layers(model)  # before sharding renames their classes (FSDPQwen2DecoderLayer)
        model = self._shard(model, mixed=trainable and self.compute_dtype != torch.float32, trainable=trainable)
        model.to_empty(device=self.device)
        state = {} if src is None else {k: v.to(dtype) for k, v in src["state"].items()}
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True,
                                                                    broadcast_from_rank0=self.world > 1))
        extras = _bcast(None if src is None else src["extras"], self.device if self.device_type == "cuda" else None)
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
        """How this learner lays out micro-batches (batch_plan.BatchLayout): what the orchestrator plans a step's
        batch for. Shared prompts per config (auto: always with varlen/flex, which never compute a shared row's
        masked pairs), packed rows for varlen/flex/packed_sdpa."""
        from agentloop.train.attention import BLOCK
        from agentloop.train.batch_plan import BatchLayout

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
        from agentloop.train.batching import collate_micro_batches, mini_batch_totals

        num_tokens, num_seqs = mini_batch_totals(eps, idxs)
        return collate_micro_batches(eps, micro_batches, self.algo.loss_agg_mode, num_tokens=num_tokens,
                                     num_seqs=num_seqs, pad_id=layout.pad_id, layout=layout.layout,
                                     pad_multiple=layout.pad_multiple)

    def _plan(self, eps, idxs):
        """This rank's micro-batches of episodes[idxs] (token budget, shared prompts per config)."""
        from agentloop.train.batching import RowCost, plan_ranks

        lay = self.layout()
        mine = plan_ranks(eps, idxs, budget=lay.budget, world=lay.world, share=lay.share,
                          cost=RowCost(*lay.row_cost))[self.rank]
        return self._collate(eps, mine, idxs, lay)

    def _to_device(self, mb) -> None:
        """Move micro-batch `mb` to the learner's device, its attention inputs built first: the varlen
        segments are read from the host's copy of the row's ids, so no forward waits on a device-to-host copy
        (a sync per micro-batch would stall the queued kernels)."""
        from agentloop.train.attention import attention_inputs

        attention_inputs(mb, self.attention, self.device)
        mb.to(self.device)

    def _reshard(self) -> None:
        """Free every FSDP2 unsharded parameter, so the next forward gathers them afresh."""
        for m in self.model.modules():
            if hasattr(m, "reshard") and hasattr(m, "unshard"):
                m.reshard()

    def _forward(self, model, mb, *, entropy: bool, entropy_grad: bool):
        """(logp, entropy or None) of mb's targets, Tensor[b, L] float32, without [L x vocab] tensors."""
        from agentloop.train.attention import attention_inputs

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
        from agentloop.train.batching import Episode

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
        would send (batch_plan.prepare_batch with this learner's layout), then `train_batch`."""
        from agentloop.train.batch_plan import prepare_batch

        return self.train_batch(prepare_batch(list(records), self.algo, self.layout(), step))

    def train_batch(self, batch) -> dict[str, float]:
        """One training step on a prepared batch (batch_plan.TrainBatch; every rank passes the same one, each
        collates its own micro-batches); returns metrics.

        The batch holds the episodes that enter the loss with their advantages and every rank's micro-batches;
        then `ppo_epochs` x `mini_batches` optimizer steps. Metric names: batch/*, reward/*, adv/*, actor/*,
        mismatch/*, async/*, time/*, perf/*. Losses and metrics stay on the device until the step's end: the
        host waits for the device once per optimizer step (the gradient norm decides whether to step) and once
        at the end.
        """
        import torch
        import torch.distributed as dist

        from agentloop.train.batching import kl_reward_advantages
        from agentloop.train.losses import Stats, interpolate_proximal

        t0 = time.perf_counter()
        algo, cfg = self.algo, self.cfg
        step = batch.step
        mine = self.layout()
        if (batch.layout.world, batch.layout.layout) != (mine.world, mine.layout):
            raise ValueError(f"step {step}: the batch was planned for {batch.layout.world} rank(s) of "
                             f"{batch.layout.layout} rows; this learner runs {mine.world} of {mine.layout} rows")
        eps = batch.episodes()
        lr = lr_at(step, cfg)
        metrics: dict[str, float] = dict(batch.metrics)
        metrics["actor/lr"] = lr
        if not eps:
            self.step = step
            metrics["actor/skipped"] = 1.0
            return metrics
        interpolate = algo.old_logprobs == "recompute" and algo.proximal == "interpolate"
        if interpolate:
            for i, e in enumerate(eps):
                if e.versions is None or any(m and v < 0 for m, v in zip(e.response_mask, e.versions)):
                    raise ValueError(f"algo.proximal=interpolate needs the weight version of every model token "
                                     f"(token_versions, from asynchronous rollouts); episode {i} of step {step} "
                                     "has none or some unknown")
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
            from agentloop.train.verl_order import apply_verl_order

            def reduce_sum(t):
                if self.world > 1:
                    dist.all_reduce(t)

            beta = self.kl_ctrl.value
            vm, current_kl = apply_verl_order(plans, minis, batch.prepared(eps), algo, beta, all_reduce=reduce_sum)
            metrics.update(vm)
            if algo.use_kl_in_reward:
                self.kl_ctrl.update(current_kl, len(eps))
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
        episode_tokens = sum(e.length for e in eps)
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
    def save_hf(self, path: str | Path, *, max_shard_bytes: int = 5 * 1024**3) -> Path:
        """Collective: gather full weights to rank 0 and write an HF directory at `path`.

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
                _copy_aux_files(self.model_path, tmp)
                conf = self.hf_config.__class__.from_dict(self.hf_config.to_dict())
                conf.dtype = self.compute_dtype
                conf.save_pretrained(tmp)
                if path.exists():
                    old = path.with_name(f".{path.name}.old-{os.getpid()}")
                    os.replace(path, old)
                    shutil.rmtree(old, ignore_errors=True)
                os.replace(tmp, path)
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
        """Collective: resumable checkpoint of `self.step` under root (see agentloop.train.checkpoint).

        background=True: returns once the state is being copied; the files are written while training goes
        on and the checkpoint appears (atomically) when `poll_checkpoint` / `wait_checkpoint` finalizes it.
        """
        from agentloop.train.checkpoint import CheckpointWriter, save_checkpoint

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
        from agentloop.train.checkpoint import load_checkpoint

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


# the mailbox loop ----------------------------------------------------------------------------

EXIT_OK, EXIT_FAILED, EXIT_TIMEOUT = 0, 1, 2


def _bcast(obj: Any, device) -> Any:
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


def serve(
    run_dir: str | Path,
    model_path: str | Path,
    algo: AlgoConfig,
    cfg: LearnerConfig,
    *,
    resume: bool = True,
    heartbeat_s: float = 5.0,
    max_len: int | None = None,
    inbox: Any = None,
) -> int:
    """Train the steps the inbox hands over until a stop; returns an exit code (EXIT_OK / EXIT_FAILED /
    EXIT_TIMEOUT).

    `run_dir` holds the learner's files (weights/, checkpoints/, learner_config.json). `inbox`: how rank 0 hears
    from the orchestrator (handle.LearnerInbox; called on rank 0 only, with the time this learner started): by
    default the file mailbox in run_dir (agentloop.train.mailbox.LearnerMailbox). Rank 0 polls it and broadcasts
    one message per poll ("wait", "batch", "stop", "timeout") so the other ranks never sit in a collective
    longer than `poll_s`.
    """
    import torch.distributed as dist

    from agentloop.train.checkpoint import latest_checkpoint
    from agentloop.train.handle import LearnerError
    from agentloop.train.mailbox import LearnerMailbox, MailboxPaths
    from agentloop.train.weight_sync import sync_from_config

    started = time.time()
    paths = MailboxPaths(Path(run_dir))
    learner = Learner(model_path, algo, cfg, max_len=max_len)
    rank = learner.rank
    if rank == 0:
        logger.info("model %s loaded in %.1fs: %d rank(s) on %s, %s, run dir %s", model_path, time.time() - started,
                    learner.world, learner.device_type, str(learner.compute_dtype).replace("torch.", ""), run_dir)
    dev = learner.device if learner.device_type == "cuda" else None
    box = None
    if rank == 0:
        box = inbox(started) if callable(inbox) else LearnerMailbox(run_dir, heartbeat_s=heartbeat_s, started=started)
    syncer = None
    code = EXIT_OK
    try:
        syncer = sync_from_config(cfg)  # the learner half of the weight transport (agentloop.train.weight_transport)
        syncer.check(learner)
        if box is not None:
            box.start()
            paths.weights_root.mkdir(parents=True, exist_ok=True)
            (Path(run_dir) / "learner_config.json").write_text(json.dumps(
                {"algo": algo.model_dump(), "learner": cfg.model_dump(), "model": str(model_path),
                 "world_size": learner.world}, indent=1))
        for note in learner.notes:
            if rank == 0:
                print(f"agentloop learner: {note}", file=sys.stderr, flush=True)
        ck = latest_checkpoint(paths.checkpoints) if (resume and rank == 0) else None
        ck = _bcast(str(ck) if ck else None, dev)
        data_position = None
        resumed_step = None
        if ck is not None:
            meta = learner.load_checkpoint(ck)
            data_position, resumed_step = meta.data_position, meta.step
            if not _bcast(paths.weights(meta.step).is_dir() if rank == 0 else None, dev):
                # The orchestrator reloads its servers from weights/step-C after a resume. Pushing paths write
                # no HF weights while training, and weights pruned by an older learner are gone: any sync
                # path, they are written now, once, from the checkpoint just loaded.
                learner.save_hf(paths.weights(meta.step))
                if rank == 0:
                    logger.info("weights of checkpoint step %d were missing: written to %s", meta.step,
                                paths.weights(meta.step))
        next_step = learner.step + 1
        ckpt_step = resumed_step  # the newest checkpoint asked for (it may still be written in the background)
        probe = learner.probe() if ck is None else None  # collective: every rank runs the forward
        if box is not None:
            box.forget_after(learner.step)
            _clear_weights_after(paths, learner.step)
        # Batches submitted before the run stopped (steps next_step..replay_through) are trained again first, while
        # the orchestrator waits for that (wait_caught_up) with no step loop running: none is pushed, the last one's
        # weights are written for the servers to load (WeightSync.publish_replayed).
        replay_through = _bcast(box.submitted_through(next_step) if box is not None else None, dev)
        if box is not None and replay_through >= next_step:
            logger.info("steps %d-%d were submitted before the stop: trained again first, their weights pushed to no "
                        "server (the servers load weights/step-%d once this learner has caught up)", next_step,
                        replay_through, replay_through)
        if box is not None:
            box.report(status="ready", next_step=next_step, resumed_step=resumed_step,
                       data_position=data_position, world_size=learner.world, layout=learner.layout().to_json(),
                       probe=probe)
            logger.info("ready for step %d (%s)", next_step,
                        f"resumed from checkpoint {ck}" if ck is not None else "fresh start")
        waited_since = time.monotonic()
        ckpt_written: float | None = None  # seconds the last background checkpoint took, until reported
        while True:
            msg: Any = None
            if box is not None:
                msg = box.poll(next_step)
                if msg is None:
                    msg = ("timeout",) if time.monotonic() - waited_since > cfg.batch_timeout_s else ("wait",)
            msg = _bcast(msg, dev)
            if msg[0] == "wait":
                # a background checkpoint goes into place as soon as its files are written, also while the
                # learner waits for a batch (a run killed during long rollouts keeps it)
                written = learner.checkpoint_written_s()
                if written is not None:
                    ckpt_written = written
                time.sleep(cfg.poll_s)
                continue
            if msg[0] == "stop":
                if rank == 0:
                    logger.info("STOP received before step %d: %s", next_step,
                                "saving the final model" if msg[1] else "exiting")
                if msg[1]:  # the run ended normally: the last step reaches disk, whatever the sync path
                    weights_dir, ck_dir = save_final(learner, paths, data_position, dev)
                    if box is not None:
                        box.final(learner.step, None if weights_dir is None else str(weights_dir),
                                  None if ck_dir is None else str(ck_dir))
                        logger.info("final model of step %d: HF weights %s, checkpoint %s", learner.step,
                                    weights_dir, ck_dir)
                break
            if msg[0] == "bad_batch":
                raise LearnerError(f"step {next_step}: unreadable batch: {msg[1]}")
            if msg[0] == "timeout":
                if box is not None:
                    box.report(status="failed", error=f"no batch for step {next_step} in {cfg.batch_timeout_s}s")
                    logger.error("no batch for step %d within learner.batch_timeout_s=%gs: exiting with code %d",
                                 next_step, cfg.batch_timeout_s, EXIT_TIMEOUT)
                code = EXIT_TIMEOUT
                break
            _, batch, meta = msg
            step = next_step
            try:
                if batch.step != step:
                    raise ValueError(f"the batch handed over for step {step} is step {batch.step}'s")
                if box is not None:
                    box.report(status="training", step=step)
                    logger.info("step %d: training on %d episodes", step, batch.num_episodes)
                t_step = time.perf_counter()
                metrics = learner.train_batch(batch)
                # checkpoint_every None (null) = never
                ckpt_due = cfg.checkpoint_every is not None and step % cfg.checkpoint_every == 0
                data_position = meta.get("data_position")
                written = learner.checkpoint_written_s()
                if written is not None or ckpt_written is not None:
                    metrics["time/checkpoint_written_s"] = written if written is not None else ckpt_written
                    ckpt_written = None
                if ckpt_due:
                    t = time.perf_counter()  # the part of the save the step waits for
                    background = cfg.checkpoint_async == "on" or (cfg.checkpoint_async == "auto"
                                                                   and learner.device_type == "cuda")
                    ck_dir = learner.save_checkpoint(paths.checkpoints, data_position=data_position,
                                                     background=background)
                    ckpt_step = step
                    metrics["time/checkpoint_s"] = time.perf_counter() - t
                    if rank == 0:
                        logger.info("step %d: checkpoint saved to %s", step, ck_dir)
                # disk saves weights/step-N (the servers load it); tensor|nccl push after the orchestrator paused
                # the servers (it answers the request with where to push, in which interrupt mode)
                if step <= replay_through:
                    pub = syncer.publish_replayed(learner, step, paths.weights(step), last=step == replay_through)
                else:
                    pub = syncer.publish(learner, step, paths.weights(step), ask=lambda s, method: _ask_push(
                        box, s, method, dev, cfg.weight_sync_timeout_s))
                metrics.update(pub.metrics)
                if box is not None:
                    logger.info("step %d done: %s", step, _step_summary(
                        metrics, time.perf_counter() - t_step, "pushed to the servers" if pub.pushed
                        else f"weights in {pub.weights_dir}" if pub.weights_dir is not None
                        else "replayed, weights not published"))
                    box.done(step, None if pub.weights_dir is None else str(pub.weights_dir), metrics,
                             pushed=pub.pushed)
                    _prune_weights(paths, cfg.keep_weights, protect=_checkpoint_steps(paths, ckpt_step))
                    # next_step and data_position together say where the run stands (wait_caught_up)
                    box.report(status="ready", next_step=step + 1, last_step=step, data_position=data_position)
            except Exception as e:
                if box is not None:
                    box.failed(step, e)
                    box.report(status="failed", error=f"{type(e).__name__}: {e}")
                raise
            next_step = step + 1
            waited_since = time.monotonic()
        return code
    except Exception:
        code = EXIT_FAILED
        raise
    finally:
        if syncer is not None and rank == 0:
            syncer.close()
        if box is not None:
            box.close(status="stopped" if code == EXIT_OK else "failed")
        learner.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _clear_weights_after(paths: Any, step: int) -> None:
    """Weights of steps > step go (the learner resumed from a checkpoint of `step`: they are redone)."""
    for d in paths.weights_root.glob("step-*"):
        try:
            s = int(d.name.split("-", 1)[1])
        except ValueError:
            continue
        if s > step:
            shutil.rmtree(d, ignore_errors=True)


def _prune_weights(paths: Any, keep: int | None, *, protect: Any = ()) -> None:
    """Delete all but the newest `keep` weights/step-N directories, never those of the steps in `protect`
    (the newest checkpoint's: a resume loads them into the servers)."""
    if keep is None:
        return
    dirs = sorted((d for d in paths.weights_root.glob("step-*") if d.name[5:].isdigit()), key=lambda d: int(d.name[5:]))
    keep_steps = set(protect)
    for d in dirs[:-keep]:
        if int(d.name[5:]) not in keep_steps:
            shutil.rmtree(d, ignore_errors=True)


def _checkpoint_steps(paths: Any, requested: int | None) -> set[int]:
    """Steps whose weights/step-N a resume may need: the newest complete checkpoint's and the newest one
    asked for (still being written in the background, or complete)."""
    from agentloop.train.checkpoint import latest_checkpoint, read_meta

    ck = latest_checkpoint(paths.checkpoints)
    return {s for s in (read_meta(ck).step if ck is not None else None, requested) if s is not None}


@dataclass(frozen=True)
class FinalPlan:
    """What the end of a run still has to write (`plan_final_save`)."""

    save_weights: bool
    """Write weights/step-N (HF) of the last trained step N."""
    save_checkpoint: bool
    """Write a resumable checkpoint of step N."""


def plan_final_save(step: int, weights_on_disk: bool, checkpoint_step: int | None) -> FinalPlan:
    """At the end of a run the last trained step `step` must be on disk twice: as an HF directory
    (weights/step-N: disk sync wrote it at the step, tensor|nccl never do while training) and as a
    resumable checkpoint (unless the newest complete one, `checkpoint_step`, is of that step). Nothing
    trained (step 0, a learner that never got a batch): nothing to write."""
    if step <= 0:
        return FinalPlan(save_weights=False, save_checkpoint=False)
    return FinalPlan(save_weights=not weights_on_disk, save_checkpoint=checkpoint_step != step)


def save_final(learner: Learner, paths: Any, data_position: Any, dev: Any) -> tuple[Path | None, Path | None]:
    """Collective, the same for every sync path: after a final STOP, write what `plan_final_save` says the
    last step lacks; returns (its HF directory, its checkpoint), (None, None) if nothing was trained.
    `data_position` is the one stored with the last step's batch, as a periodic checkpoint would store it."""
    from agentloop.train.checkpoint import latest_checkpoint, read_meta

    if learner.step <= 0:
        return None, None
    learner.wait_checkpoint()  # a background checkpoint of the last step counts once it is in place
    facts = None
    if learner.rank == 0:
        ck = latest_checkpoint(paths.checkpoints)
        facts = (paths.weights(learner.step).is_dir(), read_meta(ck).step if ck is not None else None,
                 None if ck is None else str(ck))
    weights_on_disk, ck_step, ck_path = _bcast(facts, dev)
    plan = plan_final_save(learner.step, weights_on_disk, ck_step)
    weights_dir = paths.weights(learner.step)
    if plan.save_weights:
        learner.save_hf(weights_dir)
    if plan.save_checkpoint:
        return weights_dir, learner.save_checkpoint(paths.checkpoints, data_position=data_position, background=False)
    return weights_dir, Path(ck_path)


def _step_summary(metrics: dict[str, float], seconds: float, weights: str) -> str:
    keys = (("actor/loss", "loss"), ("actor/grad_norm", "grad_norm"), ("actor/kl_ref", "kl"),
            ("actor/entropy", "entropy"), ("perf/tokens_per_s", "tok/s"))
    parts = [f"{label} {metrics[k]:.4g}" for k, label in keys if isinstance(metrics.get(k), (int, float))]
    return ", ".join(parts + [f"{seconds:.1f}s", weights])


def _ask_push(box: Any, step: int, method: str, dev: Any, timeout_s: float) -> Any:
    """Collective (weight_sync tensor|nccl): rank 0 asks the orchestrator to pause the servers and waits for its
    answer (a PushOrder: where to push, in which interrupt mode); every rank learns the outcome, so no rank
    waits in a gather for a push that will not come."""
    from agentloop.train.handle import LearnerError

    out: Any = None
    if box is not None:
        try:
            out = ("go", box.ask_push(step, method, timeout_s))
        except (LearnerError, ValueError) as e:
            out = ("fail", str(e))
    out = _bcast(out, dev)
    if out[0] != "go":
        raise LearnerError(out[1])
    return out[1]


# command line --------------------------------------------------------------------------------

def load_sections(config: str | Path | None, overrides: list[str]) -> tuple[AlgoConfig, LearnerConfig]:
    """The algo and learner sections of the run's config: `load_config` (the CLI's parser and syntax) on the
    file plus `--set` overrides. An override outside algo./learner. is refused: the learner reads nothing else."""
    from agentloop.config import load_config, parse_override, validate_for_training
    from agentloop.errors import ConfigError

    for ov in overrides:
        key, _ = parse_override(ov)
        if key.split(".", 1)[0] not in ("algo", "learner") or "." not in key:
            raise ConfigError(f"override {ov!r}: expected algo.KEY=VALUE or learner.KEY=VALUE (the learner reads no "
                              "other section)")
    cfg = validate_for_training(load_config(config, overrides))  # algo.temperature is sampling.temperature
    return cfg.algo, cfg.learner


def log_to_stdout(rank: int) -> None:
    """The learner process's log handler: rank 0 logs INFO and up, other ranks WARNING and up, each line
    prefixed with the time and rank. logging.StreamHandler flushes after every record, so a line is in
    learner.log when the call returns, block-buffered stdout or not."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(asctime)s learner[{rank}] %(levelname)s %(message)s"))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="agentloop.train.learner", description="Mailbox-driven FSDP2 learner.")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--no-resume", dest="resume", action="store_false")
    p.add_argument("--heartbeat-s", type=float, default=5.0)
    a = p.parse_args(argv)
    log_to_stdout(int(os.environ.get("RANK", "0")))
    try:
        algo, cfg = load_sections(a.config, a.overrides)
        from agentloop.config import load_config

        max_len = load_config(a.config, []).model.context_length if a.config else None
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        logger.info("starting (pid %d): model %s, run dir %s, temperature %g", os.getpid(), a.model, a.run_dir,
                    algo.temperature)
        code = serve(a.run_dir, a.model, algo, cfg, resume=a.resume, heartbeat_s=a.heartbeat_s, max_len=max_len)
    except Exception as e:  # logged (with the traceback) on every rank, then the process exits 1
        logger.exception("failed: %s: %s", type(e).__name__, e)
        code = EXIT_FAILED
    logger.info("exiting with code %d", code)
    return code


if __name__ == "__main__":
    sys.exit(main())

