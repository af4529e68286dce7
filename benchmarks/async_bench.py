"""Synchronous vs asynchronous `agentloop train`, side by side on one machine and one server.

One SGLang server is launched once (agentloop's LocalServer) and reused by every run; between runs it
gets the base weights back. Each run is a real `agentloop train` (its own learner process) with the same
model, task and sizes, differing only in the schedule: `sync`, or `async:η` (train.max_staleness η).
Per run, from its metrics.jsonl and rollouts (steps after the first, whose rollout nothing can overlap):
steps per hour, trained model tokens per second, and the mean split (rollout wait, learner, sync).
The ideal overlap bound comes from the sync run's own split: (rollout + learner + sync) / max(rollout,
learner + sync). Results: OUT/async_<name>.json and .md.

Workloads: `single` (single_turn_agent_loop, fixed-length responses, ignore_eos) and `longtail`
(benchmarks/async_plugin.py: forced calculator calls, heavy-tailed turn counts).

    python benchmarks/async_bench.py --model DIR --workload longtail --runs sync,async:1,async:2 \\
        --device cuda --server-gpu 0 --learner-gpus 1 --weight-sync nccl --out OUT
Several parts on one server (the server is started once): --part NAME:WORKLOAD:TOKENS:LEARNER_GPUS:SYNC:RUNS,
    --part longtail_2gpu:longtail:128:1:nccl:sync+async:1+async:2 --part single_2gpu:single:512:1:nccl:sync+async:1
CPU smoke (tiny model): python benchmarks/async_bench.py --device cpu --runs sync,async:1 --steps 3 ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "benchmarks" / "async_plugin.py"


def workload_overrides(workload: str, tokens: int) -> list[str]:
    common = ["sampling.ignore_eos=true", "sampling.temperature=1.0"]
    if workload == "single":
        return common + ["rollout.loop=single_turn_agent_loop", f"sampling.max_new_tokens={tokens}"]
    return common + ["rollout.loop=longtail_tool_loop", f"plugins=[\"{PLUGIN}\"]", "tools.names=[calculator]",
                     f"tools.max_tokens_per_turn={tokens}", f"sampling.max_new_tokens={tokens}",
                     f"tools.max_response_tokens={tokens * 20 + 1024}"]


def run_overrides(spec: str) -> list[str]:
    """`sync`, `async:ETA` (interrupt abort) or `async:ETA:MODE` (abort | retract | in_place)."""
    if spec == "sync":
        return ["train.schedule=sync"]
    kind, eta, mode = (spec.split(":") + ["abort"])[:3]
    if kind != "async" or not eta.isdigit() or mode not in ("abort", "retract", "in_place"):
        raise SystemExit(f"bad run spec {spec!r}: sync, async:ETA or async:ETA:abort|retract|in_place")
    return ["train.schedule=async", f"train.max_staleness={eta}", f"train.interrupt={mode}"]


async def _post(url: str, path: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=600)) as r:
            return await r.json(content_type=None)


def trained_tokens(run_dir: Path, step: int) -> int:
    n = 0
    p = run_dir / "rollouts" / f"step-{step:06d}.jsonl"
    for line in p.read_text().splitlines():
        r = json.loads(line)
        if r.get("error") is None and r.get("reward") is not None and r.get("finish_reason") != "abort":
            n += sum(r["response_mask"])
    return n


def summarise(run_dir: Path, skip: int) -> dict:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    rows = [r for r in rows if r.get("step", 0) >= 1]
    use = [r for r in rows if r["step"] > skip] or rows
    step_s = [r["time/step_s"] for r in use]
    toks = sum(trained_tokens(run_dir, int(r["step"])) for r in use)
    mean = lambda k: statistics.fmean(r.get(k, 0.0) for r in use)  # noqa: E731
    return {"steps": len(rows), "steps_measured": len(use), "step_s": statistics.fmean(step_s),
            "steps_per_hour": 3600.0 / statistics.fmean(step_s), "trained_tokens_per_s": toks / sum(step_s),
            "rollout_s": mean("time/rollout_s"), "learner_s": mean("time/learner_s"), "sync_s": mean("time/sync_s"),
            "busy_frac": mean("async/busy_frac") if "async/busy_frac" in use[0] else None,
            "lag_mean": mean("staleness/lag_mean"), "lag_max": max(r.get("staleness/lag_max", 0) for r in use),
            "cancelled": sum(r.get("async/groups_cancelled", 0) for r in rows),
            "continued": sum(r.get("async/episodes_continued", 0) for r in rows),
            "cache_hit": mean("server/prefix_cache_hit_rate"),
            "flushes_refused": max(r.get("server/flushes_refused", 0) for r in rows),
            "reward": [round(r.get("train/reward", 0.0), 3) for r in rows]}


def table(name: str, res: dict, card: str) -> str:
    sync = res.get("sync")
    out = [f"## {name} ({card})", "",
           "| run | steps/h | trained tok/s | vs sync | step s | rollout wait s | learner s | sync s | server busy | "
           "lag mean/max | cancelled | continued | prefix-cache hits |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, r in res.items():
        if "error" in r:
            out.append(f"| {k} | failed: {r['error'][:80]} |||||||||||")
            continue
        ratio = (r["trained_tokens_per_s"] / sync["trained_tokens_per_s"] if sync and "error" not in sync
                 else float("nan"))
        busy = "" if r["busy_frac"] is None else f"{r['busy_frac']:.2f}"
        out.append(f"| {k} | {r['steps_per_hour']:.0f} | {r['trained_tokens_per_s']:,.0f} | {ratio:.2f}x | "
                   f"{r['step_s']:.1f} | {r['rollout_s']:.1f} | {r['learner_s']:.1f} | {r['sync_s']:.2f} | {busy} | "
                   f"{r['lag_mean']:.2f}/{r['lag_max']:.0f} | {r['cancelled']:.0f} | {r.get('continued', 0):.0f} | "
                   f"{r.get('cache_hit', 0.0):.0%} |")
    if sync and "error" not in sync:
        R, L = sync["rollout_s"], sync["learner_s"] + sync["sync_s"]
        bound = (R + L) / max(R, L, 1e-9)
        out += ["", f"Ideal overlap bound from the sync run's split: (rollout {R:.1f} + learner/sync {L:.1f}) / "
                    f"max = **{bound:.2f}x**."]
        for k, r in res.items():
            if k != "sync" and "error" not in r:
                ratio = r["trained_tokens_per_s"] / sync["trained_tokens_per_s"]
                out.append(f"- {k}: {ratio:.2f}x sync = {ratio / bound:.0%} of the bound")
    return "\n".join(out) + "\n"


def run_part(a: argparse.Namespace, url: str, model: Path, name: str, workload: str, tokens: int, learner_gpus: str,
             weight_sync: str, runs: list[str], t_start: float, out: Path) -> dict[str, dict]:
    """The runs of one part against the running server (base weights restored after each)."""
    learner = ["learner.device=cuda", "learner.dtype=bfloat16", f"learner.weight_sync={weight_sync}"] \
        if a.device == "cuda" else ["learner.device=cpu"]
    if learner_gpus:
        learner.append(f"learner.gpus=[{learner_gpus}]")
    base = ["train.val_every=0", f"train.steps={a.steps}", f"train.prompts_per_step={a.prompts}",
            f"rollout.n_samples={a.samples}", "learner.checkpoint_every=null", "train.tensorboard=false",
            "rollout.max_concurrency=4096", "learner.lr=1e-6", "algo.kl_coef=0.001",
            *workload_overrides(workload, tokens), *learner, *a.extra]
    results: dict[str, dict] = {}
    for spec in runs:
        if time.monotonic() - t_start > a.budget_s:
            results[spec] = {"error": "budget spent before this run"}
            continue
        run_dir = out / "runs" / f"{name}_{spec.replace(':', '_')}"
        cmd = [sys.executable, "-m", "agentloop.cli", "train", "--quiet", "--server-url", url,
               "--model", str(model), "--run-dir", str(run_dir), "train.resume=false", *base, *run_overrides(spec)]
        if a.device == "cuda":
            cmd[4:4] = ["--config", str(ROOT / "configs" / "train_qwen_gpu.yaml")]
        t0 = time.monotonic()
        left = max(60.0, a.budget_s + 120 - (time.monotonic() - t_start))
        try:
            proc = subprocess.run(cmd, cwd=ROOT, timeout=left, capture_output=True, text=True)
            (out / f"{name}_{spec.replace(':', '_')}.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-600:]}")
            results[spec] = summarise(run_dir, skip=1)
        except Exception as e:  # noqa: BLE001 - one failed run must not lose the others' figures
            results[spec] = {"error": f"{type(e).__name__}: {e}"}
        print(f"[{time.monotonic() - t_start:.0f}s] {name} {spec}: {time.monotonic() - t0:.0f}s "
              f"{json.dumps(results[spec])[:400]}", flush=True)
        asyncio.run(_post(url, "/update_weights_from_disk", {"model_path": str(model), "weight_version": "0"}))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="model dir or a modelzoo shape name (default: tiny on cpu)")
    p.add_argument("--workload", choices=["single", "longtail"], default="single")
    p.add_argument("--runs", default="sync,async:1,async:2")
    p.add_argument("--name", default="")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--server-gpu", type=int, default=0)
    p.add_argument("--learner-gpus", default="", help="e.g. 1 (separate) or 0 (colocated); empty: all visible")
    p.add_argument("--mem-fraction", type=float, default=0.45)
    p.add_argument("--weight-sync", default="disk", choices=["disk", "tensor", "nccl"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512, help="new tokens per response (single) or per turn")
    p.add_argument("--budget-s", type=float, default=560.0, help="stop starting runs past this")
    p.add_argument("--card", default="")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--part", action="append", default=[],
                   help="NAME:WORKLOAD:TOKENS:LEARNER_GPUS:SYNC:RUNS (runs joined by +); repeatable, one server")
    p.add_argument("--set", dest="extra", action="append", default=[], help="more KEY=VALUE overrides")
    a = p.parse_args(argv)
    t_start = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = a.name or f"{a.workload}_{a.device}"
    sys.path.insert(0, str(ROOT))
    from agentloop.inference.launcher import LocalServer
    from agentloop.models.modelzoo import ensure_shape_model, ensure_tiny_model

    model = Path(a.model) if a.model and Path(a.model).is_dir() else (
        ensure_shape_model(a.model) if a.model else ensure_tiny_model())
    card = a.card
    if not card and a.device == "cuda":
        import torch

        card = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    server_args = [] if a.device == "cpu" else [
        "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
        "--cuda-graph-backend-prefill", "disabled"]
    server = LocalServer(model, device=a.device, gpu_id=a.server_gpu if a.device == "cuda" else None,
                         mem_fraction_static=a.mem_fraction if a.device == "cuda" else None,
                         max_total_tokens=None if a.device == "cuda" else 32768, extra_args=server_args,
                         log_path=out / f"{name}_server.log", startup_timeout_s=400).start()
    try:
        asyncio.run(server.wait_ready())
        print(f"[{time.monotonic() - t_start:.0f}s] server up at {server.url} ({model})", flush=True)
        parts = [pt.split(":", 5) for pt in a.part] or [[name, a.workload, str(a.tokens), a.learner_gpus,
                                                           a.weight_sync, a.runs.replace(",", "+")]]
        for pname, workload, tokens, lgpus, wsync, runs in parts:
            results = run_part(a, server.url, model, pname, workload, int(tokens), lgpus, wsync, runs.split("+"),
                               t_start, out)
            report = {"name": pname, "card": card, "model": str(model), "args": vars(a), "workload": workload,
                      "learner_gpus": lgpus, "weight_sync": wsync, "results": results}
            (out / f"async_{pname}.json").write_text(json.dumps(report, indent=1))
            md = table(f"{pname}: {workload}, {a.prompts} prompts x {a.samples}, {tokens} tokens, server GPU "
                       f"{a.server_gpu}, learner GPUs {lgpus or 'all'}, sync {wsync}", results, card or a.device)
            (out / f"async_{pname}.md").write_text(md)
            print(md, flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
