"""`agentloop bench train`: learner tokens/s and MFU on synthetic batches, and where a step's time goes.

Modes:
    learner (default)  synthetic records (random token ids, GRPO groups, random rewards) go through the
                       real `Learner.train_step` of `agentloop train`: FSDP2 on one process, or on every
                       rank of a torchrun group when `learner.ranks` (--nproc) > 1. `--bench-warmup` steps
                       are run untimed, then `--bench-steps` timed ones.
    --run-dir DIR      the time split of an `agentloop train` run, read from DIR/metrics.jsonl.
    --full             run a short `agentloop train` (--full-steps, default 3; the train preset unless
                       --config) and report its split.

Map:
    TrainBenchConfig     the learner bench's settings (CLI flags map onto it; it goes to torchrun ranks as JSON)
    synthetic_records    EpisodeRecords in the learner's input format
    (the FLOP model and the GPUs' peak table live in agentloop.train.flops)
    learner_bench        warmup + timed train_steps on this rank; rank 0 returns the report
    step_split           time split of metrics.jsonl rows
    format_*, write_outputs, run_bench_train               tables, files, the CLI entry

Who calls whom: run_bench_train -> learner_bench (in process, or `python -m agentloop.bench.train
--worker` on each torchrun rank) -> agentloop.train.trainer.learner.Learner; the loss, batching and
optimizer are the learner's own, nothing is re-implemented here.

FLOPs (the model of agentloop.train.flops). A step runs `ppo_epochs` training passes, plus one forward pass when
the old logprobs are recomputed in a pass of their own (`learner.old_logprob_pass`: not for one
epoch of one mini-batch, where the loss pass's detached logprobs are the old ones) and one more (the
reference model) when `algo.kl_coef > 0`; these
forward passes are the algorithm's, so they count as model FLOPs. With shared prompts
(`learner.share_prompt`) the linear term runs over the tokens the learner ran (a prompt once, then its
responses) and the attention term over the pairs the episodes need, a shared prompt's own pairs once
(p^2 + sum((p + k_i)^2 - p^2); masked pairs a dense mask computes are work, not model FLOPs). Padding
is not counted. Activation recomputation (`learner.gradient_checkpointing`) is not counted either.
With `--bench-max-lag` the records carry token versions (lags 0..max_lag), as asynchronous rollouts do,
so `algo.proximal=interpolate` can be timed against recompute.
    MFU = step FLOPs / step wall time / (ranks * peak dense bf16 FLOP/s per GPU)
Step wall time is the whole `train_step` (batch preparation on the CPU and the optimizer step
included), synchronised with the GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentloop.models.modelzoo import resolve_named_model
from agentloop.train.flops import flop_params, peak_tflops, step_flops_from_sums

SPLIT_KEYS = ("time/rollout_s", "time/reward_s", "time/learner_s", "time/sync_s", "time/step_s")
"""Keys of metrics.jsonl rows that `step_split` reads (written by `agentloop train`)."""


class TrainBenchConfig(BaseModel):
    """Settings of the learner bench (the learner's own settings come from the config's learner/algo)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: str = "tiny"
    """`tiny` (the project's tiny model), a name in `agentloop.models.modelzoo.MODEL_SHAPES` (random weights of
    a real shape, e.g. qwen2.5-0.5b-shape), or a local HF model directory."""
    sequences: int = Field(default=64, ge=1)
    """Sequences (episodes) per training step."""
    group_size: int = Field(default=8, ge=1)
    """Episodes per prompt (the GRPO group); `sequences` must be a multiple of it."""
    prompt_tokens: int = Field(default=256, ge=1)
    """Prompt length of every sequence."""
    response_tokens: int = Field(default=768, ge=1)
    """Response length of every sequence."""
    env_tokens: int = Field(default=0, ge=0)
    """Of the response, tokens with mask 0 (a tool result in the middle, as in a multi-turn episode)."""
    warmup_steps: int = Field(default=1, ge=0)
    """Untimed steps first (allocation, kernel selection)."""
    steps: int = Field(default=3, ge=1)
    """Timed steps."""
    seed: int = 0
    """Seed of the synthetic records."""
    max_lag: int | None = Field(default=None, ge=0)
    """Give the records token versions (as asynchronous rollouts do): token k of an episode was sampled
    (k mod (max_lag + 1)) versions before the step's starting weights (never below version 0). None: no
    versions (synchronous records)."""
    peak_tflops: float | None = Field(default=None, gt=0)
    """Peak dense TFLOP/s per device for MFU; None: from PEAK_TFLOPS by GPU name (on CPU: no MFU)."""

    @model_validator(mode="after")
    def _check(self) -> "TrainBenchConfig":
        if self.sequences % self.group_size:
            raise ValueError(f"sequences ({self.sequences}) must be a multiple of group_size ({self.group_size})")
        if self.env_tokens >= self.response_tokens:
            raise ValueError(f"env_tokens ({self.env_tokens}) must be < response_tokens ({self.response_tokens})")
        return self


# ---------------------------------------------------------------------------- synthetic batch


def synthetic_records(bench: TrainBenchConfig, vocab_size: int, *, step: int = 1) -> list[Any]:
    """`bench.sequences` EpisodeRecords: groups of `group_size` sharing a prompt, random responses.

    Token ids are uniform in [0, vocab_size); rewards are uniform in [0, 1) (so every group has
    non-zero advantages); rollout logprobs are -log(vocab_size) on mask-1 tokens (what a random
    model gives, so the TIS weights stay near 1) and 0.0 on the `env_tokens` mask-0 tokens, which sit
    in the middle of the response like a tool result.
    """
    import torch

    from agentloop.records import EpisodeRecord

    g = torch.Generator().manual_seed(bench.seed * 1_000_003 + step)
    groups = bench.sequences // bench.group_size
    R, E = bench.response_tokens, bench.env_tokens
    start = (R - E) // 2
    mask = [1] * start + [0] * E + [1] * (R - E - start)
    lp = -math.log(vocab_size)
    logprobs = [lp if m else 0.0 for m in mask]
    rewards = torch.rand(bench.sequences, generator=g).tolist()
    versions: list[int | None] = []
    if bench.max_lag is not None:
        versions = [max(0, step - 1 - k % (bench.max_lag + 1)) if m else None for k, m in enumerate(mask)]
    records = []
    for index in range(groups):
        prompt = torch.randint(0, vocab_size, (bench.prompt_tokens,), generator=g).tolist()
        for repeat in range(bench.group_size):
            records.append(EpisodeRecord(
                prompt_ids=prompt, response_ids=torch.randint(0, vocab_size, (R,), generator=g).tolist(),
                response_mask=list(mask), response_logprobs=list(logprobs),
                reward=rewards[index * bench.group_size + repeat], finish_reason="length",
                episode_id=f"bench-{step}-{index}-{repeat}", index=index, repeat=repeat,
                data_source="bench", loop="bench", seed=0, step=step, token_versions=list(versions),
            ))
    return records


# ---------------------------------------------------------------------------- FLOP model


# ---------------------------------------------------------------------------- the learner bench


def _log(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def learner_bench(bench: TrainBenchConfig, model_path: str | Path, algo: Any, cfg: Any) -> dict[str, Any] | None:
    """Warmup + timed `Learner.train_step`s on this rank (collective); rank 0 returns the report."""
    import torch
    import torch.distributed as dist

    from agentloop.train.trainer.learner import Learner

    t_load = time.perf_counter()
    learner = Learner(model_path, algo, cfg)
    try:
        load_s = time.perf_counter() - t_load
        rank, world = learner.rank, learner.world
        cuda = learner.device_type == "cuda"
        say = _log if rank == 0 else (lambda msg: None)
        hf = learner.hf_config
        n_params = flop_params(learner.model)
        say(f"model loaded and sharded over {world} rank(s) in {load_s:.1f}s: {n_params / 1e6:.1f}M matmul params, "
            f"{hf.num_hidden_layers} layers, hidden {hf.hidden_size}, vocab {hf.vocab_size}, "
            f"{learner.device_type} {str(learner.compute_dtype).removeprefix('torch.')}")

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        steps: list[dict[str, float]] = []
        total = bench.warmup_steps + bench.steps
        for i in range(1, total + 1):
            records = synthetic_records(bench, hf.vocab_size, step=i)
            if i == bench.warmup_steps + 1 and cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            metrics = learner.train_step(records, i)
            sync()
            wall = time.perf_counter() - t0
            warm = i <= bench.warmup_steps
            label = f"warmup {i}/{bench.warmup_steps}" if warm else f"step {i - bench.warmup_steps}/{bench.steps}"
            tok = sum(len(r.prompt_ids) + len(r.response_ids) - 1 for r in records)
            say(f"{label}: {wall:.3f}s, {tok / wall:,.0f} tok/s, loss {metrics.get('actor/loss', float('nan')):.4f}")
            if not warm:
                steps.append({"wall_s": wall, **{k: float(v) for k, v in metrics.items()}})
        if cuda:
            mem = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()],
                               dtype=torch.float64, device=learner.device)
        else:  # the process's peak RSS (model load and everything else included)
            mem = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0, 0.0],
                               dtype=torch.float64)
        if world > 1:
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        if rank != 0:
            return None
        device_name = torch.cuda.get_device_name(learner.device) if cuda else "cpu"
        return _report(bench, learner, steps, n_params, load_s, device_name,
                       peak_mem=mem.tolist(), model_path=str(model_path))
    finally:
        learner.close()


def _report(bench: TrainBenchConfig, learner: Any, steps: list[dict[str, float]], n_params: int, load_s: float,
            device_name: str, *, peak_mem: list[float], model_path: str) -> dict[str, Any]:
    algo, cfg, hf = learner.algo, learner.cfg, learner.hf_config

    def mean_of(key: str) -> float | None:
        vals = [s[key] for s in steps if key in s]
        return sum(vals) / len(vals) if vals else None

    seq = bench.prompt_tokens + bench.response_tokens - 1
    seq_lens = [seq] * bench.sequences
    from agentloop.train.trainer.learner import needs_reference, old_logprob_pass

    interpolate = algo.old_logprobs == "recompute" and algo.proximal == "interpolate"
    fwd_passes = int(old_logprob_pass(algo, cfg) and not interpolate) + int(needs_reference(algo))
    # FLOPs of the rows the learner ran: with shared prompts (learner.share_prompt) a row holds a
    # prompt once and several responses, so the work is less than per-episode rows would need.
    computed = mean_of("batch/computed_tokens")
    computed_sq = mean_of("batch/computed_tokens_sq")
    if computed is None or computed_sq is None:
        computed, computed_sq = float(sum(seq_lens)), float(sum(n * n for n in seq_lens))
    flops = step_flops_from_sums(n_params, hf.num_hidden_layers, hf.hidden_size, computed, computed_sq,
                                 train_passes=cfg.ppo_epochs, forward_passes=fwd_passes)
    walls = sorted(s["wall_s"] for s in steps)
    mean = sum(walls) / len(walls)
    tokens = sum(seq_lens)
    response = bench.sequences * (bench.response_tokens - bench.env_tokens)
    cuda = learner.device_type == "cuda"
    peak = peak_tflops(device_name if cuda else None, bench.peak_tflops)
    achieved = flops["total"] / mean / learner.world  # per device
    mfu = achieved / (peak * 1e12) if peak else None

    return {
        "mode": "learner",
        "bench": bench.model_dump(),
        "model": bench.model, "model_path": model_path,
        "device": device_name, "device_type": learner.device_type, "ranks": learner.world,
        "dtype": str(learner.compute_dtype).removeprefix("torch."),
        "algo": {"estimator": algo.estimator, "old_logprobs": algo.old_logprobs, "proximal": algo.proximal,
                 "kl_coef": algo.kl_coef, "kl_type": algo.kl_type, "loss_agg_mode": algo.loss_agg_mode},
        "learner": {"micro_batch_tokens": cfg.micro_batch_tokens, "mini_batches": cfg.mini_batches,
                    "share_prompt": cfg.share_prompt, "attention": learner.attention,
                    "logprob_chunk_tokens": cfg.logprob_chunk_tokens, "compile": learner.compiled,
                    "ppo_epochs": cfg.ppo_epochs, "gradient_checkpointing": cfg.gradient_checkpointing},
        "model_shape": {"matmul_params": n_params, "layers": hf.num_hidden_layers, "hidden": hf.hidden_size,
                        "vocab": hf.vocab_size},
        "load_s": load_s,
        "tokens_per_step": tokens, "response_tokens_per_step": response,
        "computed_tokens_per_step": computed, "shared_rows_per_step": mean_of("batch/shared_rows"),
        "padded_tokens_per_step": mean_of("batch/padded_tokens"),
        "interpolate_abs_err": mean_of("mismatch/interpolate_abs_err"),
        "step_s": {"mean": mean, "min": walls[0], "max": walls[-1], "all": [s["wall_s"] for s in steps]},
        "tokens_per_s": tokens * cfg.ppo_epochs / mean,
        "response_tokens_per_s": response * cfg.ppo_epochs / mean,
        "flops_per_step": flops, "forward_passes": fwd_passes, "train_passes": cfg.ppo_epochs,
        "achieved_tflops_per_device": achieved / 1e12,
        "peak_tflops_per_device": peak,
        "mfu": mfu,
        "peak_memory_gib": ({"allocated": peak_mem[0] / 2**30, "reserved": peak_mem[1] / 2**30} if cuda
                            else {"rss": peak_mem[0] / 2**30}),
        "learner_time_s": {k.removeprefix("time/"): mean_of(k) for k in ("time/prepare_s", "time/logprobs_s",
                                                                          "time/update_s")},
        "micro_batches_per_step": mean_of("actor/micro_batches"),
        "episodes_per_step": mean_of("batch/episodes"),
        "loss": [s.get("actor/loss") for s in steps],
        "grad_norm": [s.get("actor/grad_norm") for s in steps],
    }


def _worker(spec_path: str) -> int:
    """One torchrun rank: the spec written by run_learner_bench in, rank 0's report out next to it."""
    from agentloop.train.config import AlgoConfig, LearnerConfig

    spec = json.loads(Path(spec_path).read_text())
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    report = learner_bench(TrainBenchConfig(**spec["bench"]), spec["model_path"], AlgoConfig(**spec["algo"]),
                           LearnerConfig(**spec["learner"]))
    if report is not None:
        Path(spec["report_path"]).write_text(json.dumps(report, indent=2))
    return 0


def run_learner_bench(bench: TrainBenchConfig, algo: Any, learner_cfg: Any, out_dir: Path) -> dict[str, Any]:
    """The learner bench in this process (nproc 1) or as a torchrun group (nproc > 1); rank 0's report."""
    from agentloop.errors import AgentLoopError

    model_path = resolve_named_model(bench.model)
    nproc = learner_cfg.world_size
    _log(f"learner bench: model {bench.model} ({model_path}), {nproc} rank(s), {bench.sequences} sequences x "
         f"({bench.prompt_tokens} prompt + {bench.response_tokens} response) tokens, group {bench.group_size}, "
         f"{bench.warmup_steps} warmup + {bench.steps} timed steps")
    if nproc == 1:
        return learner_bench(bench, model_path, algo, learner_cfg)
    spec_path, report_path = out_dir / "bench_train_spec.json", out_dir / "bench_train_rank0.json"
    spec_path.write_text(json.dumps({"bench": bench.model_dump(), "model_path": str(model_path),
                                     "algo": algo.model_dump(), "learner": learner_cfg.model_dump(),
                                     "report_path": str(report_path)}, indent=1))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "agentloop.bench.train", "--worker", str(spec_path)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    rc = subprocess.run(cmd, env=env).returncode  # ranks print their progress to our stderr
    if rc != 0 or not report_path.is_file():
        raise AgentLoopError(f"learner bench ranks exited with {rc} (command: {' '.join(cmd)})")
    return json.loads(report_path.read_text())


# ---------------------------------------------------------------------------- step split


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    """Rows of run_dir/metrics.jsonl that are training steps (rows with time/step_s), by step, last write wins."""
    from agentloop.data.loader import read_jsonl_rows
    from agentloop.errors import ConfigError

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{path}: not found (is {run_dir} an `agentloop train` run directory?)")
    rows: dict[float, dict[str, float]] = {}
    for _, row in read_jsonl_rows(path):  # a bad line raises DataError naming file and line
        if "time/step_s" in row:
            rows[row["step"]] = row  # a resumed run re-logs a step: keep the last
    return [rows[k] for k in sorted(rows)]


def step_split(rows: list[dict[str, float]], *, skip_first: int = 0) -> dict[str, Any]:
    """Mean seconds per phase over the steps and their shares of the mean step time.

    Phases: rollout (generation and scoring of every episode), learner (batch submitted -> weights
    saved), sync (pause -> load weights -> resume), other (the rest of the step: bookkeeping).
    `reward` is summed over episodes and runs inside rollout, concurrently with other episodes, so
    its share is not additive; `learner.*` rows split the learner's own time (as it measured it).
    """
    from agentloop.errors import ConfigError

    used = rows[skip_first:] if len(rows) > skip_first else rows
    if not used:
        raise ConfigError("no training steps with time/step_s in metrics.jsonl")

    def mean(key: str) -> float | None:
        vals = [float(r[key]) for r in used if key in r]
        return sum(vals) / len(vals) if vals else None

    step = mean("time/step_s") or 0.0
    phases: dict[str, float | None] = {
        "rollout": mean("time/rollout_s"), "reward (in rollout)": mean("time/reward_s"),
        "learner": mean("time/learner_s"), "sync": mean("time/sync_s"),
    }
    additive = sum(phases[k] or 0.0 for k in ("rollout", "learner", "sync"))
    phases["other"] = max(0.0, step - additive)
    for k in ("prepare_s", "logprobs_s", "update_s", "save_hf_s", "checkpoint_s"):
        v = mean(f"learner/time/{k}")
        if v is not None:
            phases[f"learner: {k.removesuffix('_s')}"] = v
    perf = {k.removeprefix("learner/perf/"): mean(k) for k in
            ("learner/perf/tokens_per_s", "learner/perf/tflops_per_device", "learner/perf/mfu",
             "learner/perf/peak_memory_gib")}
    return {
        "learner_perf": {k: v for k, v in perf.items() if v is not None},
        "steps": [int(r["step"]) for r in used],
        "step_s": step,
        "phases": {k: {"seconds": v, "share": (v / step if v is not None and step > 0 else None)}
                   for k, v in phases.items()},
        "per_step": [{"step": int(r["step"]), **{k.removeprefix("time/"): r.get(k) for k in SPLIT_KEYS}}
                     for r in used],
    }


# ---------------------------------------------------------------------------- output


def format_learner(r: dict[str, Any]) -> str:
    b = r["bench"]
    mfu = "n/a (no peak for this device; pass --peak-tflops)" if r["mfu"] is None else \
        f"{100 * r['mfu']:.1f}% of {r['peak_tflops_per_device']:g} TFLOP/s per device"
    mem = r["peak_memory_gib"]
    mem_s = (f"{mem['allocated']:.2f} GiB allocated, {mem['reserved']:.2f} GiB reserved (max over ranks)"
             if "allocated" in mem else f"{mem['rss']:.2f} GiB process RSS")
    fl = r["flops_per_step"]
    lines = [
        f"bench train (learner): {r['model']} on {r['ranks']} x {r['device']} ({r['dtype']}), "
        f"{b['sequences']} seqs x ({b['prompt_tokens']} prompt + {b['response_tokens']} response) tokens, "
        f"group {b['group_size']}, micro_batch_tokens {r['learner']['micro_batch_tokens']}, attention "
        f"{r['learner'].get('attention', '-')}",
        f"  rows               share_prompt {r['learner'].get('share_prompt', 'off')}: "
        f"{r.get('computed_tokens_per_step') or r['tokens_per_step']:,.0f} tokens computed of "
        f"{r['tokens_per_step']:,} in the episodes, {r.get('shared_rows_per_step') or 0:g} shared rows",
        f"  step time          {r['step_s']['mean']:.3f} s mean of {len(r['step_s']['all'])} "
        f"(min {r['step_s']['min']:.3f}, max {r['step_s']['max']:.3f}); model load {r['load_s']:.1f} s",
        f"  tokens/s           {r['tokens_per_s']:,.0f} total, {r['response_tokens_per_s']:,.0f} response (mask 1)",
        f"  model FLOPs/step   {fl['total']:.3g} ({r['train_passes']} train pass(es) 6N+attn, "
        f"{r['forward_passes']} forward pass(es) 2N+attn; N = {r['model_shape']['matmul_params'] / 1e6:.1f}M)",
        f"  achieved           {r['achieved_tflops_per_device']:.3g} TFLOP/s per device",
        f"  MFU                {mfu}",
        f"  peak memory        {mem_s}",
    ]
    return "\n".join(lines)


def _phase_cells(p: dict[str, Any]) -> tuple[str, str]:
    """(seconds, share) of one split phase as text; '-' where unknown."""
    sec = "-" if p["seconds"] is None else f"{p['seconds']:.3f}"
    share = "-" if p["share"] is None else f"{100 * p['share']:.1f}%"
    return sec, share


def format_split(s: dict[str, Any], title: str = "") -> str:
    head = f"{'phase':<22} {'seconds':>9} {'share':>7}"
    lines = [f"step time split{title}: mean of steps {s['steps']}, step {s['step_s']:.2f} s", head, "-" * len(head)]
    for name, p in s["phases"].items():
        sec, share = _phase_cells(p)
        lines.append(f"{name:<22} {sec:>9} {share:>7}")
    lines.append("(reward is summed over episodes and overlaps rollout; learner: rows split the learner's time)")
    perf = s.get("learner_perf") or {}
    if perf:
        bits = [f"{perf['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in perf else "",
                f"{perf['tflops_per_device']:.3g} TFLOP/s/device" if "tflops_per_device" in perf else "",
                f"MFU {100 * perf['mfu']:.1f}%" if "mfu" in perf else "",
                f"peak {perf['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in perf else ""]
        lines.append("learner train_step: " + ", ".join(b for b in bits if b))
    return "\n".join(lines)


def to_markdown(report: dict[str, Any]) -> str:
    out = ["# agentloop bench train", ""]
    if "learner" in report:
        r = report["learner"]
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        mem = r["peak_memory_gib"]
        mem_s = f"{mem['allocated']:.2f} GiB alloc" if "allocated" in mem else f"{mem['rss']:.2f} GiB RSS"
        b = r["bench"]
        share = r["learner"].get("share_prompt", "off")
        computed = r.get("computed_tokens_per_step") or r["tokens_per_step"]
        att = r["learner"].get("attention", "-")
        out += ["| model | device | ranks | dtype | seqs x len | attention | share_prompt | computed tokens | step s | "
                "tok/s | response tok/s | TFLOP/s/dev | MFU | peak mem |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
                f"| {r['model']} | {r['device']} | {r['ranks']} | {r['dtype']} | {b['sequences']} x "
                f"{b['prompt_tokens'] + b['response_tokens']} | {att} | {share} | {computed:,.0f} of "
                f"{r['tokens_per_step']:,} | "
                f"{r['step_s']['mean']:.3f} | {r['tokens_per_s']:,.0f} | "
                f"{r['response_tokens_per_s']:,.0f} | {r['achieved_tflops_per_device']:.3g} | {mfu} | {mem_s} |", ""]
    if "split" in report:
        s = report["split"]
        out += [f"Step time split, mean of steps {s['steps']} (step {s['step_s']:.2f} s); reward overlaps rollout.",
                "", "| phase | seconds | share of step |", "|---|---|---|"]
        for name, p in s["phases"].items():
            sec, share = _phase_cells(p)
            out.append(f"| {name} | {sec} | {share} |")
        perf = s.get("learner_perf") or {}
        if perf:
            out += ["", "| learner train_step | value |", "|---|---|"]
            out += [f"| {k} | {v:,.4g} |" for k, v in perf.items()]
        out.append("")
    return "\n".join(out)


def write_outputs(out_dir: Path, report: dict[str, Any], out: str | None = None) -> tuple[Path, Path]:
    from agentloop.util.rundir import write_json

    json_path, md_path = out_dir / "bench_train.json", out_dir / "bench_train.md"
    write_json(json_path, report)
    md_path.write_text(to_markdown(report))
    if out:
        write_json(Path(out), report)
    return json_path, md_path


def bench_settings(args: argparse.Namespace, cfg: Any) -> TrainBenchConfig:
    """TrainBenchConfig from the `--bench-*` flags (unset flags keep the defaults)."""
    flags = {"model": args.bench_model or cfg.model.path, "sequences": args.bench_sequences,
             "group_size": args.bench_group_size, "prompt_tokens": args.bench_prompt_tokens,
             "response_tokens": args.bench_response_tokens, "env_tokens": args.bench_env_tokens,
             "warmup_steps": args.bench_warmup, "steps": args.bench_steps, "seed": args.bench_seed,
             "peak_tflops": args.peak_tflops, "max_lag": args.bench_max_lag}
    from pydantic import ValidationError

    from agentloop.errors import ConfigError

    try:
        return TrainBenchConfig(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as e:
        raise ConfigError(f"bench train settings: {e}") from None


def run_bench_train(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The CLI entry: the mode from the flags, the report printed and written (JSON + markdown)."""
    from agentloop.errors import ConfigError
    from agentloop.util.rundir import make_run_dir

    if args.split_run_dir and args.full:
        raise ConfigError("--run-dir reads an existing run and --full makes a new one: give one of them")
    if args.nproc is not None:
        cfg.learner.ranks = args.nproc
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    report: dict[str, Any]
    if args.split_run_dir or args.full:
        if args.full:
            from agentloop.train.orchestrator.loop import run_train

            cfg.train.steps = args.full_steps
            if args.bench_model and args.bench_model != "tiny":
                cfg.model.path = str(resolve_named_model(args.bench_model))
            if not cfg.run_dir:
                cfg.name = "bench-train-full"
            print(f"bench train --full: running `agentloop train` for {cfg.train.steps} steps",
                  file=sys.stderr, flush=True)
            run_dir, _ = run_train(cfg)
        else:
            run_dir = Path(args.split_run_dir)
        rows = read_metrics(run_dir)
        report = {"mode": "split", "run_dir": str(run_dir), "split": step_split(rows)}
        if len(rows) >= 3:  # the first step also pays for warm-up (first compiles, cache misses)
            report["split_after_first"] = step_split(rows, skip_first=1)
        out_dir = Path(run_dir)
        print(format_split(report["split"]))
        if "split_after_first" in report:
            print(format_split(report["split_after_first"], " without step 1"))
    else:
        bench = bench_settings(args, cfg)
        cfg = cfg.model_copy(update={"name": "bench-train"})
        out_dir = make_run_dir(cfg)
        learner = run_learner_bench(bench, cfg.algo, cfg.learner, out_dir)
        report = {"mode": "learner", "learner": learner}
        print(format_learner(learner))
    json_path, md_path = write_outputs(out_dir, report, args.out)
    print(f"  report: {json_path}  table: {md_path}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="agentloop.bench.train", description="torchrun rank of `agentloop bench train`")
    p.add_argument("--worker", required=True, metavar="SPEC.json")
    return _worker(p.parse_args(argv).worker)


if __name__ == "__main__":
    sys.exit(main())
