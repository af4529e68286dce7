"""A matrix of `agentloop bench train` runs on one machine, side by side: code versions x shapes x settings.

Each run is `python -m agentloop.cli bench train ...` in a fresh process, with PYTHONPATH set to the run's
code directory (so an older checkout of agentloop is measured on the same card, in the same call, as the
current one). Runs that fail or time out are reported and skipped. A markdown table goes to stdout and
$OUT/bench_train_summary.md, each run's report to $OUT/bench_<code>_<name>.json.

Run spec, one per --run (or ';'-separated in --runs):  CODE:NAME:PROMPTxRESPONSE:SEQS[:override,override,...]
    e.g.  new:flex32k:362x512:512:learner.micro_batch_tokens=32768,learner.attention=flex
Code: --code NAME=DIR (repeatable; DIR holds the `agentloop` package).

Usage (GPU machine, repo root):
    python3 benchmarks/gpu_bench_train.py --code new=. --runs "new:base:362x512:512"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def parse_run(spec: str) -> dict:
    parts = spec.split(":")
    if len(parts) < 4:
        raise SystemExit(f"bad run spec {spec!r}: CODE:NAME:PxR:SEQS[:overrides]")
    code, name, shape, seqs = parts[:4]
    prompt, response = (int(x) for x in shape.lower().split("x"))
    overrides = [o for o in (parts[4].split(",") if len(parts) > 4 else []) if o]
    return {"code": code, "name": name, "prompt": prompt, "response": response, "seqs": int(seqs),
            "overrides": overrides}


def run_one(r: dict, code_dir: Path, out: Path, *, model: str, group: int, warmup: int, steps: int, timeout_s: float,
            nproc: int) -> dict | None:
    tag = f"{r['code']}_{r['name']}"
    report = out / f"bench_{tag}.json"
    cmd = [sys.executable, "-m", "agentloop.cli", "bench", "train", "--model", model,
           "--bench-sequences", str(r["seqs"]), "--bench-group-size", str(group),
           "--bench-prompt-tokens", str(r["prompt"]), "--bench-response-tokens", str(r["response"]),
           "--bench-warmup", str(warmup), "--bench-steps", str(steps), "--out", str(report),
           f"run_dir=/tmp/bench_runs/{tag}", "learner.dtype=bfloat16", *r["overrides"]]
    if nproc > 1:
        cmd[5:5] = ["--nproc", str(nproc)]  # before --model
    code_dir = code_dir.resolve()  # also the cwd: `python -m` puts the cwd before PYTHONPATH
    paths = [str(code_dir)] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1")
    t0 = time.time()
    print(f"== {tag}: {r['seqs']} x ({r['prompt']} + {r['response']}) {' '.join(r['overrides'])}", flush=True)
    try:
        with (out / f"bench_{tag}.log").open("w") as log:
            rc = subprocess.run(cmd, env=env, cwd=code_dir, stdout=log, stderr=subprocess.STDOUT,
                                timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    tail = (out / f"bench_{tag}.log").read_text(errors="replace").splitlines()[-12:]
    print("\n".join("   " + line for line in tail), flush=True)
    print(f"   -> rc {rc} in {time.time() - t0:.0f}s", flush=True)
    if rc != 0 or not report.is_file():
        return None
    return json.loads(report.read_text())["learner"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--run", action="append", default=[], metavar="SPEC")
    p.add_argument("--runs", default="", metavar="SPEC;SPEC")
    p.add_argument("--model", default="qwen2.5-0.5b-shape")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=240.0, help="per run")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting runs after this many seconds")
    a = p.parse_args()
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    codes = {k: Path(v) for k, v in (c.split("=", 1) for c in a.code)} or {"new": Path(".")}
    runs = [parse_run(s) for s in a.run + [x for x in a.runs.split(";") if x.strip()]]
    t_start = time.time()
    rows = []
    for r in runs:
        left = a.budget_s - (time.time() - t_start)
        if left < 30:
            print(f"== skip {r['code']}_{r['name']}: budget spent", flush=True)
            continue
        rep = run_one(r, codes[r["code"]], out, model=a.model, group=a.group, warmup=a.warmup, steps=a.steps,
                      timeout_s=min(a.timeout_s, left), nproc=a.nproc)
        rows.append((r, rep))
    lines = ["| code | run | shape | settings | device | step s | tok/s | MFU | peak alloc GiB | micro-batches |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r, rep in rows:
        shape = f"{r['seqs']} x ({r['prompt']}+{r['response']})"
        settings = " ".join(o.split(".", 1)[-1] for o in r["overrides"]) or "defaults"
        if rep is None:
            lines.append(f"| {r['code']} | {r['name']} | {shape} | {settings} | - | failed | | | | |")
            continue
        mfu = "-" if rep["mfu"] is None else f"{100 * rep['mfu']:.1f}%"
        mem = rep["peak_memory_gib"].get("allocated", rep["peak_memory_gib"].get("rss", 0.0))
        lines.append(f"| {r['code']} | {r['name']} | {shape} | {settings} | {rep['device']} x{rep['ranks']} | "
                     f"{rep['step_s']['mean']:.2f} | {rep['tokens_per_s']:,.0f} | {mfu} | {mem:.1f} | "
                     f"{rep.get('micro_batches_per_step') or 0:g} |")
    text = "\n".join(lines)
    (out / "bench_train_summary.md").write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
