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

The process trains mailbox steps in order until RUN_DIR/mailbox/STOP appears (exit 0), a
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
    lr_at                  warmup + constant/cosine schedule, a pure function of the step
    init_distributed       join torchrun's process group, or make a single-rank one
    Learner                model + optimizer (+ reference); compute_logprobs, train_step,
                           save_hf, save_checkpoint, load_checkpoint, close; its micro-batches
                           share a GRPO group's prompt per row where `flops.row_cost` says it pays
    serve                  the mailbox loop (rank 0 polls and broadcasts; every rank trains and logs)
    log_to_stdout          the learner process's log handler (flushed line by line)
    _push_weights          weight_sync tensor|nccl: the sync.request/sync.go handshake, then the push
    main                   the command line (learner_process.learner_command builds it)

Who calls whom: serve -> Learner -> batching / losses / checkpoint; serve -> weight_sync (pushes);
Learner never touches the mailbox, so it is the API for an in-process trainer too.

Simplified: every rank loads the full HF model on CPU before sharding (no meta-device init);
logits are materialised for a whole micro-batch in float32 (size micro_batch_tokens x vocab).
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
from pathlib import Path
from typing import Any

from agentloop.train.config import AlgoConfig, LearnerConfig
from agentloop.train.flops import row_cost

# Heavy imports (torch, transformers) happen inside functions, after the config has parsed.
logger = logging.getLogger("agentloop.train.learner")
__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_TIMEOUT",
    "Learner",
    "init_distributed",
    "load_sections",
    "log_to_stdout",
    "lr_at",
    "main",
    "resolve_device",
    "serve",
]


def lr_at(step: int, cfg: LearnerConfig) -> float:
    """Learning rate of training step `step` (1-based): linear warmup, then constant or cosine."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    total = cfg.total_steps or step
    progress = min(max((step - cfg.warmup_steps) / max(total - cfg.warmup_steps, 1), 0.0), 1.0)
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
    return algo.old_logprobs == "recompute" and (cfg.ppo_epochs > 1 or cfg.mini_batches > 1)


class Learner:
    """An FSDP2-sharded policy (and optional frozen reference) with its AdamW optimizer.

    Every rank of the process group constructs one and calls every method (they are collective),
    with the same arguments; `train_step` on every rank gets the full record list and takes its
    own share.
    """

    def __init__(self, model_path: str | Path, algo: AlgoConfig | None = None, cfg: LearnerConfig | None = None):
        import random

        import numpy as np
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoConfig, AutoModelForCausalLM

        from agentloop.train.advantages import get_estimator

        self.algo = algo or AlgoConfig()
        self.cfg = cfg or LearnerConfig()
        get_estimator(self.algo.estimator)  # an unknown name fails before the model loads
        self.model_path = Path(model_path)
        self.device_type = resolve_device(self.cfg)
        self._owns_group = init_distributed(self.cfg, self.device_type)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        if self.device_type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        dt = self.cfg.dtype if self.cfg.dtype != "auto" else ("bfloat16" if self.device_type == "cuda" else "float32")
        self.compute_dtype = getattr(torch, dt)
        seed = self.cfg.seed + self.rank
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        self.pad_id = self.hf_config.pad_token_id if isinstance(self.hf_config.pad_token_id, int) else 0
        self.mesh = init_device_mesh(self.device_type, (self.world,))
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32, attn_implementation="sdpa")
        if self.cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        self.row_cost = row_cost(model)
        self.model = self._shard(model, mixed=self.compute_dtype != torch.float32)
        self.model.train()
        self.ref_model = None
        if self.algo.kl_coef > 0:
            ref = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.compute_dtype,
                                                       attn_implementation="sdpa")
            ref.requires_grad_(False)
            self.ref_model = self._shard(ref, mixed=False)
            self.ref_model.eval()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.cfg.lr, betas=self.cfg.betas, eps=self.cfg.adam_eps,
            weight_decay=self.cfg.weight_decay,
        )
        self.step = 0
        """Last training step applied to the weights (0 = none)."""

    def _shard(self, model, *, mixed: bool):
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if mixed:
            mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        else:
            mp = MixedPrecisionPolicy()
        blocks = set(getattr(model, "_no_split_modules", None) or ())
        layers = [m for m in model.modules() if type(m).__name__ in blocks]
        if not layers:
            raise ValueError(f"{type(model).__name__}: no decoder layers found to shard (_no_split_modules={blocks})")
        for layer in layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=mp)
        fully_shard(model, mesh=self.mesh, mp_policy=mp)
        return model

    # forward ---------------------------------------------------------------------------------
    def _plan(self, eps, idxs):
        """This rank's micro-batches of episodes[idxs] (token budget, shared prompts per config)."""
        from agentloop.train.batching import plan_micro_batches

        return plan_micro_batches(eps, idxs, self.algo.loss_agg_mode, budget=self.cfg.micro_batch_tokens,
                                  rank=self.rank, world=self.world, pad_id=self.pad_id,
                                  share=self.cfg.share_prompt, cost=self.row_cost)

    def _reshard(self) -> None:
        """Free every FSDP2 unsharded parameter, so the next forward gathers them afresh."""
        for m in self.model.modules():
            if hasattr(m, "reshard") and hasattr(m, "unshard"):
                m.reshard()

    def _forward(self, model, mb, *, entropy: bool, entropy_grad: bool):
        """(logp, entropy or None) of mb's targets, Tensor[b, L] float32."""
        import torch

        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                    use_cache=False)
        logits = out.logits.float()
        if self.algo.temperature != 1.0:
            logits = logits / self.algo.temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
        ent = None
        if entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent = -(logp_all.exp() * logp_all).sum(-1)
        return logp, ent

    def compute_logprobs(self, records) -> list[list[float]]:
        """Current-policy logprobs of each record's response tokens (0.0 on mask-0 tokens).

        Collective; every rank gets the full list. Failed records are not skipped here.
        """
        import torch
        import torch.distributed as dist

        from agentloop.train.batching import Episode

        eps = [Episode(list(r.prompt_ids) + list(r.response_ids), len(r.prompt_ids), list(r.response_mask),
                       list(r.response_logprobs), 0.0, 0.0) for r in records]
        result: dict[int, list[float]] = {}
        with torch.no_grad():
            for mb in self._plan(eps, list(range(len(eps)))):
                mb.to(self.device)
                logp, _ = self._forward(self.model, mb, entropy=False, entropy_grad=False)
                logp = (logp * mb.loss_mask).cpu()
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
    def train_step(self, records, step: int) -> dict[str, float]:
        """One training step on `records` (every rank passes the same full list); returns metrics.

        Failed and unscored records are excluded; advantages per (step, index) group; then
        `ppo_epochs` x `mini_batches` optimizer steps. Metric names: batch/*, reward/*, adv/*,
        actor/*, mismatch/*, time/*, perf/*.
        """
        import torch
        import torch.distributed as dist

        from agentloop.train.batching import mini_batch_indices, prepare_episodes
        from agentloop.train.losses import Stats, policy_loss

        t0 = time.perf_counter()
        algo, cfg = self.algo, self.cfg
        prepared = prepare_episodes(list(records), algo)
        eps = prepared.episodes
        lr = lr_at(step, cfg)
        metrics: dict[str, float] = dict(prepared.metrics)
        metrics["actor/lr"] = lr
        if not eps:
            self.step = step
            metrics["actor/skipped"] = 1.0
            return metrics
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        minis = mini_batch_indices(len(eps), cfg.mini_batches, seed=cfg.seed * 1_000_003 + step)
        plans = [self._plan(eps, idxs) for idxs in minis]
        for mbs in plans:
            for mb in mbs:
                mb.to(self.device)

        t1 = time.perf_counter()
        recompute = algo.old_logprobs == "recompute"
        old_pass = old_logprob_pass(algo, cfg)
        on_policy = recompute and not old_pass
        if old_pass or self.ref_model is not None:
            with torch.no_grad():
                for mbs in plans:
                    for mb in mbs:
                        if old_pass:
                            mb.old_logprobs, _ = self._forward(self.model, mb, entropy=False, entropy_grad=False)
                        if self.ref_model is not None:
                            mb.ref_logprobs, _ = self._forward(self.ref_model, mb, entropy=False, entropy_grad=False)
        if old_pass:
            # FSDP2 keeps the root's parameters (embeddings, tied lm_head, final norm) unsharded after a
            # forward; ones gathered under no_grad then serve the loss pass, and the tied weight's
            # gradient came out wrong (test_on_policy_step_skips_...: 14-57% off an unsharded reference).
            # The reference model is never trained, so its no-grad pass needs no reshard.
            self._reshard()

        t2 = time.perf_counter()
        stats = Stats()
        params = [p for p in self.model.parameters() if p.requires_grad]
        losses: list[float] = []
        grad_norms: list[float] = []
        skipped = 0
        want_entropy_grad = algo.entropy_coef > 0
        for _epoch in range(cfg.ppo_epochs):
            for mbs in plans:
                self.optimizer.zero_grad(set_to_none=True)
                part = 0.0
                for j, mb in enumerate(mbs):
                    self.model.set_requires_gradient_sync(j == len(mbs) - 1)
                    logp, ent = self._forward(self.model, mb, entropy=True, entropy_grad=want_entropy_grad)
                    old = (logp.detach() if on_policy else mb.old_logprobs) if recompute else mb.rollout_logprobs
                    out = policy_loss(logp, old, mb.advantages, mb.loss_mask, mb.weights, algo,
                                      rollout_logp=mb.rollout_logprobs, ref_logp=mb.ref_logprobs, entropy=ent)
                    (out.loss * self.world).backward()
                    part += float(out.loss.detach())
                    stats.merge(out.stats)
                losses.append(part)
                max_norm = cfg.grad_clip if cfg.grad_clip is not None else float("inf")
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
                norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                norm = float(norm)
                grad_norms.append(norm)
                if math.isfinite(norm):
                    self.optimizer.step()
                else:
                    skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
        self.model.set_requires_gradient_sync(True)
        t3 = time.perf_counter()

        stats.all_reduce()
        loss_t = torch.tensor(losses, dtype=torch.float64,
                              device=self.device if dist.get_backend() == "nccl" else None)
        if self.world > 1:
            dist.all_reduce(loss_t)
        losses = loss_t.tolist()
        # What the forward passes computed (each prompt once per shared row), summed over ranks.
        lens = [n for mbs in plans for mb in mbs for n in mb.row_lengths]
        work = torch.tensor([float(sum(lens)), float(sum(n * n for n in lens)),
                             float(sum(mb.shared_rows for mbs in plans for mb in mbs))], dtype=torch.float64,
                            device=loss_t.device)
        if self.world > 1:
            dist.all_reduce(work)
        computed, computed_sq, shared_rows = work.tolist()
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
        metrics["actor/micro_batches"] = float(sum(len(m) for m in plans))
        metrics["time/prepare_s"] = t1 - t0
        metrics["time/logprobs_s"] = t2 - t1
        metrics["time/update_s"] = t3 - t2
        episode_tokens = sum(e.length for e in eps)
        metrics["perf/tokens_per_s"] = episode_tokens * cfg.ppo_epochs / max(t3 - t0, 1e-9)
        metrics["batch/computed_tokens"] = computed
        metrics["batch/computed_tokens_sq"] = computed_sq  # sum of squared row lengths: the attention FLOPs
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
        self, root: str | Path, *, data_position: Any = None, extra: dict[str, Any] | None = None
    ) -> Path:
        """Collective: resumable checkpoint of `self.step` under root (see agentloop.train.checkpoint)."""
        from agentloop.train.checkpoint import save_checkpoint

        return save_checkpoint(root, self.step, self.model, self.optimizer, data_position=data_position,
                               extra=extra, keep=self.cfg.keep_checkpoints)

    def load_checkpoint(self, path: str | Path):
        """Collective: restore weights, optimizer, RNG and `self.step`; returns the CheckpointMeta."""
        from agentloop.train.checkpoint import load_checkpoint

        meta = load_checkpoint(path, self.model, self.optimizer)
        self.step = meta.step
        return meta

    def close(self) -> None:
        """Free the models; destroy the process group if this Learner created it."""
        import torch.distributed as dist

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
) -> int:
    """Train mailbox steps until STOP; returns an exit code (EXIT_OK / EXIT_FAILED / EXIT_TIMEOUT).

    Rank 0 polls the mailbox and broadcasts one message per poll ("wait", "batch", "stop",
    "timeout") so the other ranks never sit in a collective longer than `poll_s`.
    """
    import torch.distributed as dist

    from agentloop.train.checkpoint import latest_checkpoint
    from agentloop.train.mailbox import LearnerMailbox, MailboxError, MailboxPaths

    started = time.time()
    paths = MailboxPaths(Path(run_dir))
    learner = Learner(model_path, algo, cfg)
    rank = learner.rank
    if rank == 0:
        logger.info("model %s loaded in %.1fs: %d rank(s) on %s, %s, run dir %s", model_path, time.time() - started,
                    learner.world, learner.device_type, str(learner.compute_dtype).replace("torch.", ""), run_dir)
    dev = learner.device if learner.device_type == "cuda" else None
    box = LearnerMailbox(run_dir, heartbeat_s=heartbeat_s, started=started) if rank == 0 else None
    syncer = None
    code = EXIT_OK
    try:
        if cfg.weight_sync != "disk":
            from agentloop.train.weight_sync import sync_from_config

            if learner.device_type != "cuda":
                raise ValueError(f"learner.weight_sync={cfg.weight_sync!r} needs a GPU learner")
            syncer = sync_from_config(cfg)
        if box is not None:
            box.start_heartbeat()
            (Path(run_dir) / "learner_config.json").write_text(json.dumps(
                {"algo": algo.model_dump(), "learner": cfg.model_dump(), "model": str(model_path),
                 "world_size": learner.world}, indent=1))
        ck = latest_checkpoint(paths.checkpoints) if (resume and rank == 0) else None
        ck = _bcast(str(ck) if ck else None, dev)
        data_position = None
        resumed_step = None
        if ck is not None:
            meta = learner.load_checkpoint(ck)
            data_position, resumed_step = meta.data_position, meta.step
        next_step = learner.step + 1
        if box is not None:
            box.clear_after(learner.step)
            box.update_info(status="ready", next_step=next_step, resumed_step=resumed_step,
                            data_position=data_position, world_size=learner.world)
            logger.info("ready for step %d (%s)", next_step,
                        f"resumed from checkpoint {ck}" if ck is not None else "fresh start")
        waited_since = time.monotonic()
        while True:
            msg: Any = None
            if box is not None:
                if box.batch_ready(next_step):
                    try:
                        records, meta = box.read_batch(next_step)
                        msg = ("batch", records, meta)
                    except Exception as e:  # unreadable batch: every rank stops, the orchestrator is told
                        box.write_failed(next_step, e)
                        msg = ("bad_batch", f"{type(e).__name__}: {e}")
                elif box.stop_requested():
                    msg = ("stop",)
                elif time.monotonic() - waited_since > cfg.batch_timeout_s:
                    msg = ("timeout",)
                else:
                    msg = ("wait",)
            msg = _bcast(msg, dev)
            if msg[0] == "wait":
                time.sleep(cfg.poll_s)
                continue
            if msg[0] == "stop":
                if rank == 0:
                    logger.info("STOP received before step %d: exiting", next_step)
                break
            if msg[0] == "bad_batch":
                raise MailboxError(f"step {next_step}: unreadable batch: {msg[1]}")
            if msg[0] == "timeout":
                if box is not None:
                    box.update_info(status="failed", error=f"no batch for step {next_step} in {cfg.batch_timeout_s}s")
                    logger.error("no batch for step %d within learner.batch_timeout_s=%gs: exiting with code %d",
                                 next_step, cfg.batch_timeout_s, EXIT_TIMEOUT)
                code = EXIT_TIMEOUT
                break
            _, records, meta = msg
            step = next_step
            try:
                if box is not None:
                    box.update_info(status="training", step=step)
                    logger.info("step %d: training on %d records", step, len(records))
                t_step = time.perf_counter()
                metrics = learner.train_step(records, step)
                ckpt_due = bool(cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
                wdir = None
                if syncer is None or ckpt_due:  # GPU pushes keep an HF copy at checkpoints, for resumes
                    t = time.perf_counter()
                    wdir = learner.save_hf(paths.weights(step))
                    metrics["time/save_hf_s"] = time.perf_counter() - t
                data_position = meta.get("data_position")
                if ckpt_due:
                    t = time.perf_counter()
                    ck_dir = learner.save_checkpoint(paths.checkpoints, data_position=data_position)
                    metrics["time/checkpoint_s"] = time.perf_counter() - t
                    if rank == 0:
                        logger.info("step %d: checkpoint saved to %s", step, ck_dir)
                if syncer is not None:
                    metrics.update(_push_weights(learner, syncer, box, step, dev, cfg.weight_sync_timeout_s))
                if box is not None:
                    logger.info("step %d done: %s", step, _step_summary(metrics, time.perf_counter() - t_step,
                                                                       "pushed to the servers" if syncer is not None
                                                                       else f"weights in {wdir}"))
                    box.write_done(step, wdir, metrics, pushed=syncer is not None)
                    box.prune_weights(cfg.keep_weights)
                    box.update_info(status="ready", next_step=step + 1, last_step=step)
            except Exception as e:
                if box is not None:
                    box.write_failed(step, e)
                    box.update_info(status="failed", error=f"{type(e).__name__}: {e}")
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


def _step_summary(metrics: dict[str, float], seconds: float, weights: str) -> str:
    keys = (("actor/loss", "loss"), ("actor/grad_norm", "grad_norm"), ("actor/kl_ref", "kl"),
            ("actor/entropy", "entropy"), ("perf/tokens_per_s", "tok/s"))
    parts = [f"{label} {metrics[k]:.4g}" for k, label in keys if isinstance(metrics.get(k), (int, float))]
    return ", ".join(parts + [f"{seconds:.1f}s", weights])


def _push_weights(learner: Learner, syncer: Any, box: Any, step: int, dev: Any, timeout_s: float) -> dict[str, float]:
    """weight_sync tensor|nccl, collective: rank 0 asks the orchestrator to pause the servers
    (sync.request) and waits for its sync.go; then every rank joins the push (the FSDP gathers) and
    rank 0 sends to the servers named in sync.go, with the step as weight version."""
    from agentloop.train.mailbox import MailboxError

    go: Any = None
    if box is not None:
        box.request_sync(step, syncer.name)
        try:
            go = ("go", list(box.wait_sync_go(step, timeout_s).get("urls") or []))
        except MailboxError as e:
            go = ("fail", str(e))
    go = _bcast(go, dev)  # the other ranks learn the outcome instead of waiting in a gather
    if go[0] != "go":
        raise MailboxError(go[1])
    t = time.perf_counter()
    metrics = syncer.push(learner.model, dtype=learner.compute_dtype, device=learner.device, rank=learner.rank,
                          urls=go[1], version=str(step))
    metrics["time/sync_s"] = time.perf_counter() - t
    return metrics


# command line --------------------------------------------------------------------------------

def load_sections(config: str | Path | None, overrides: list[str]) -> tuple[AlgoConfig, LearnerConfig]:
    """The algo and learner sections of the run's config: `load_config` (the CLI's parser and syntax) on the
    file plus `--set` overrides. An override outside algo./learner. is refused: the learner reads nothing else."""
    from agentloop.config import load_config, parse_override, validate_for_training
    from agentloop.errors import ConfigError

    for ov in overrides:
        key, _ = parse_override(ov)
        if key.split(".", 1)[0] not in ("algo", "learner") or "." not in key:
            raise ConfigError(f"override {ov!r}: expected algo.KEY=VALUE or learner.KEY=VALUE (the learner reads no other section)")
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
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        logger.info("starting (pid %d): model %s, run dir %s, temperature %g", os.getpid(), a.model, a.run_dir,
                    algo.temperature)
        code = serve(a.run_dir, a.model, algo, cfg, resume=a.resume, heartbeat_s=a.heartbeat_s)
    except Exception as e:  # logged (with the traceback) on every rank, then the process exits 1
        logger.exception("failed: %s: %s", type(e).__name__, e)
        code = EXIT_FAILED
    logger.info("exiting with code %d", code)
    return code


if __name__ == "__main__":
    sys.exit(main())

