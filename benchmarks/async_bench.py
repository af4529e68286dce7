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


FLAGS = {
    # item 2 of issue 29: in-flight requests per server follow what each server reports (AIMD)
    "conc": ["manager.concurrency.adaptive=true"],
    # item 1: the servers on the learner's GPUs (the part's LENT indices) sleep while it trains
    "lend": ["server.lend_learner_gpus=true"],
}


def run_overrides(spec: str, lent: str = "") -> list[str]:
    """`sync`, `async:ETA` (interrupt abort), `async:ETA:MODE` (abort | retract | in_place), each optionally followed
    by flags (`sync:conc`, `async:2:in_place:conc.lend`; see FLAGS)."""
    parts = spec.split(":")
    if parts[0] == "sync":
        out, flags = ["train.schedule=sync"], parts[1] if len(parts) > 1 else ""
    else:
        kind, eta = parts[0], parts[1] if len(parts) > 1 else ""
        mode, flags = parts[2] if len(parts) > 2 else "abort", parts[3] if len(parts) > 3 else ""
        if kind != "async" or not eta.isdigit() or mode not in ("abort", "retract", "in_place"):
            raise SystemExit(f"bad run spec {spec!r}: sync[:FLAGS], async:ETA or async:ETA:abort|retract|in_place"
                             "[:FLAGS]")
        out = ["train.schedule=async", f"train.max_staleness={eta}", f"train.interrupt={mode}"]
    for f in filter(None, flags.split(".")):
        if f not in FLAGS:
            raise SystemExit(f"bad flag {f!r} in run spec {spec!r}: one of {sorted(FLAGS)}")
        out += FLAGS[f]
        if f == "lend":
            if not lent:
                raise SystemExit(f"run spec {spec!r} lends servers but the part names none (its LENT field)")
            out.append(f"server.lent_servers=[{lent.replace('.', ',')}]")
    return out


async def _post(url: str, path: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
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
            # the learner's share of wall time it does not train (its GPUs may serve rollouts meanwhile: lend)
            "learner_idle": 1.0 - sum(r.get("time/learner_s", 0.0) for r in use) / sum(step_s),
            "conc_limit": mean("server/conc_limit"), "conc_kv_usage": mean("server/conc_kv_usage"),
            "conc_waiting": mean("server/conc_waiting"),
            "lend_sleep_s": mean("time/lend_sleep_s"), "lend_wake_s": mean("time/lend_wake_s"),
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
           "learner idle | conc limit (kv, waiting) | lend sleep/wake s | lag mean/max | cancelled | continued | "
           "prefix-cache hits |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, r in res.items():
        if "error" in r:
            out.append(f"| {k} | failed: {r['error'][:80]} ||||||||||||||")
            continue
        ratio = (r["trained_tokens_per_s"] / sync["trained_tokens_per_s"] if sync and "error" not in sync
                 else float("nan"))
        busy = "" if r["busy_frac"] is None else f"{r['busy_frac']:.2f}"
        out.append(f"| {k} | {r['steps_per_hour']:.0f} | {r['trained_tokens_per_s']:,.0f} | {ratio:.2f}x | "
                   f"{r['step_s']:.1f} | {r['rollout_s']:.1f} | {r['learner_s']:.1f} | {r['sync_s']:.2f} | {busy} | "
                   f"{r.get('learner_idle', 0.0):.0%} | {r.get('conc_limit', 0.0):.0f} "
                   f"({r.get('conc_kv_usage', 0.0):.2f}, {r.get('conc_waiting', 0.0):.1f}) | "
                   f"{r.get('lend_sleep_s', 0.0):.2f}/{r.get('lend_wake_s', 0.0):.2f} | "
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


def combined_table(title: str, res: dict, card: str) -> str:
    """Every run of every part, against the best synchronous run (highest trained tok/s)."""
    syncs = [r for k, r in res.items() if k.split("/")[-1].startswith("sync") and "error" not in r]
    best = max(syncs, key=lambda r: r["trained_tokens_per_s"]) if syncs else None
    best_name = next((k for k, r in res.items() if r is best), "none")
    out = [f"## {title} ({card})", "", f"Against the best synchronous run: {best_name}.", "",
           "| run | placement | steps/h | trained tok/s | vs best sync | server busy | learner idle | sync s | "
           "conc limit | lend sleep/wake s | reward (last) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, r in res.items():
        where = f"{r.get('servers', '')}; learner GPUs {r.get('learner_gpus') or 'all'}; {r.get('weight_sync', '')}"
        if "error" in r:
            out.append(f"| {k} | {where} | failed: {r['error'][:80]} ||||||||")
            continue
        ratio = r["trained_tokens_per_s"] / best["trained_tokens_per_s"] if best else float("nan")
        busy = "" if r["busy_frac"] is None else f"{r['busy_frac']:.2f}"
        out.append(f"| {k} | {where} | {r['steps_per_hour']:.0f} | {r['trained_tokens_per_s']:,.0f} | {ratio:.2f}x | "
                   f"{busy} | {r['learner_idle']:.0%} | {r['sync_s']:.2f} | {r['conc_limit']:.0f} | "
                   f"{r['lend_sleep_s']:.2f}/{r['lend_wake_s']:.2f} | {r['reward'][-1] if r['reward'] else ''} |")
    return "\n".join(out) + "\n"


def run_part(a: argparse.Namespace, urls: list[str], model: Path, name: str, workload: str, tokens: int,
             learner_gpus: str, weight_sync: str, runs: list[str], t_start: float, out: Path,
             lent: str = "") -> dict[str, dict]:
    """The runs of one part against the running servers `urls` (base weights restored after each); `lent`: the
    indices (in `urls`, joined by '.') of the servers on the learner's GPUs, for runs with the `lend` flag."""
    learner = ["learner.device=cuda", "learner.dtype=bfloat16", f"learner.weight_sync={weight_sync}"] \
        if a.device == "cuda" else ["learner.device=cpu", f"learner.weight_sync={weight_sync}"]
    if learner_gpus:
        learner.append(f"learner.gpus=[{learner_gpus}]")
        if "," in learner_gpus:  # a learner over several GPUs: one rank each
            learner.append(f"learner.ranks={len(learner_gpus.split(','))}")
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
        cmd = [sys.executable, "-m", "agentloop.cli", "train", "--quiet",
               *[x for u in urls for x in ("--server-url", u)],
               "--model", str(model), "--run-dir", str(run_dir), "train.resume=false", *base,
               *run_overrides(spec, lent)]
        if a.device == "cuda":
            cmd[4:4] = ["--config", str(ROOT / "configs" / "train_qwen_gpu.yaml")]
        t0 = time.monotonic()
        # every run ends by budget + run_grace_s (killed past it: the learner dies with its parent), so the whole
        # benchmark fails loudly in bounded time instead of hanging
        left = max(30.0, a.budget_s + a.run_grace_s - (time.monotonic() - t_start))
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
        for url in urls:  # the base weights back; a server that died fails the next runs, which say so
            try:
                asyncio.run(_post(url, "/update_weights_from_disk", {"model_path": str(model), "weight_version": "0"}))
            except Exception as e:  # noqa: BLE001 - the figures so far must be written
                print(f"restoring the base weights on {url} failed: {type(e).__name__}: {e}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="model dir or a modelzoo shape name (default: tiny on cpu)")
    p.add_argument("--workload", choices=["single", "longtail"], default="single")
    p.add_argument("--runs", default="sync,async:1,async:2")
    p.add_argument("--name", default="")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--server-gpu", default="0", help="GPU of each server, joined by commas (one server each)")
    p.add_argument("--cpu-servers", type=int, default=1, help="--device cpu: servers to launch")
    p.add_argument("--all-gpus-visible", action="store_true",
                   help="servers see every GPU and pick theirs with --base-gpu-id (else CUDA_VISIBLE_DEVICES=GPU)")
    p.add_argument("--memory-saver", default="", help="indices of servers started with --enable-memory-saver "
                   "(the lent ones: they release their KV cache while the learner trains), joined by commas")
    p.add_argument("--run-grace-s", type=float, default=120.0,
                   help="a run is killed past budget + this (the whole benchmark ends in bounded time)")
    p.add_argument("--learner-gpus", default="", help="e.g. 1 (separate) or 0 (colocated); empty: all visible")
    p.add_argument("--mem-fraction", default="0.45", help="per server, joined by commas (one value: every server)")
    p.add_argument("--weight-sync", default="disk", choices=["disk", "tensor", "nccl"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512, help="new tokens per response (single) or per turn")
    p.add_argument("--budget-s", type=float, default=560.0, help="stop starting runs past this")
    p.add_argument("--card", default="")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--part", action="append", default=[],
                   help="NAME[@SERVERS[@LENT]]:WORKLOAD:TOKENS:LEARNER_GPUS:SYNC:RUNS (runs joined by +; SERVERS: "
                   "indices of the launched servers the part uses, joined by '.', default all; LENT: those of them "
                   "on the learner's GPUs, for runs flagged lend); repeatable, the servers are started once")
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
    gpus = [int(g) for g in a.server_gpu.split(",")] if a.device == "cuda" else [None] * a.cpu_servers
    fracs = [float(f) for f in a.mem_fraction.split(",")]
    fracs = fracs * len(gpus) if len(fracs) == 1 else fracs
    if len(fracs) != len(gpus):
        raise SystemExit(f"--mem-fraction gives {len(fracs)} values for {len(gpus)} servers")
    saver = {int(i) for i in a.memory_saver.split(",") if i}
    servers = []
    try:
        for i, g in enumerate(gpus):
            extra = server_args + (["--enable-memory-saver"] if a.device == "cuda" and i in saver else [])
            if g is not None and a.all_gpus_visible:
                # every GPU visible, the server's own picked by --base-gpu-id: a server may then open CUDA IPC
                # handles of a learner on another GPU (tensor sync to a server beside a lent one), and NCCL's P2P
                # wants learner and servers to see the same devices (agentloop.train.weights.nccl)
                extra += ["--base-gpu-id", str(g)]
            servers.append(LocalServer(model, device=a.device, gpu_id=None if a.all_gpus_visible else g,
                                       mem_fraction_static=fracs[i] if g is not None else None,
                                       max_total_tokens=None if a.device == "cuda" else 32768,
                                       extra_args=extra, log_path=out / f"{name}_server{i}.log",
                                       startup_timeout_s=400).start())

        async def ready() -> None:
            await asyncio.gather(*(s.wait_ready() for s in servers))

        asyncio.run(ready())
        urls = [s.url for s in servers]
        print(f"[{time.monotonic() - t_start:.0f}s] servers up at {urls} ({model})", flush=True)
        parts = [pt.split(":", 5) for pt in a.part] or [[name, a.workload, str(a.tokens), a.learner_gpus,
                                                           a.weight_sync, a.runs.replace(",", "+")]]
        everything: dict[str, dict] = {}
        for head, workload, tokens, lgpus, wsync, runs in parts:
            pname, sel, lent = (head.split("@") + ["", ""])[:3]
            use = [int(i) for i in sel.split(".")] if sel else list(range(len(urls)))
            if lent and not set(int(i) for i in lent.split(".")) <= set(range(len(use))):
                raise SystemExit(f"part {head}: LENT {lent} must index the part's servers ({len(use)})")
            results = run_part(a, [urls[i] for i in use], model, pname, workload, int(tokens), lgpus, wsync,
                               runs.split("+"), t_start, out, lent=lent)
            where = ", ".join(f"server {i} on {'GPU ' + str(gpus[i]) if gpus[i] is not None else 'CPU'}" for i in use)
            report = {"name": pname, "card": card, "model": str(model), "args": vars(a), "workload": workload,
                      "servers": where, "lent": lent, "learner_gpus": lgpus, "weight_sync": wsync, "results": results}
            (out / f"async_{pname}.json").write_text(json.dumps(report, indent=1))
            md = table(f"{pname}: {workload}, {a.prompts} prompts x {a.samples}, {tokens} tokens, {where}, "
                       f"learner GPUs {lgpus or 'all'}, sync {wsync}", results, card or a.device)
            (out / f"async_{pname}.md").write_text(md)
            print(md, flush=True)
            everything.update({f"{pname}/{k}": {**v, "servers": where, "lent": lent, "learner_gpus": lgpus,
                                                "weight_sync": wsync} for k, v in results.items()})
        if len(parts) > 1:  # every part in one table, each run against the best synchronous one
            (out / f"async_{name}_all.json").write_text(json.dumps({"card": card, "model": str(model),
                                                                    "args": vars(a), "results": everything}, indent=1))
            md = combined_table(f"{name}: every placement, {a.prompts} prompts x {a.samples}", everything,
                                card or a.device)
            (out / f"async_{name}_all.md").write_text(md)
            print(md, flush=True)
    finally:
        for s in servers:
            s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
