"""Run the embedded default `agentloop train --loop tool_agent_loop` for several seeds; summarise and plot.

Usage: python benchmarks/cpu_train_seeds.py OUT_DIR [key.sub=value ...] [--seeds 1 2 3]
       python benchmarks/cpu_train_seeds.py OUT_DIR --summarize-only
Each seed runs in OUT_DIR/seed-S with rollout.seed=S and learner.seed=S (one after another: the
runs are timed, so they must not share the 2 cores). Writes OUT_DIR/summary.md (reward at the start
and the end of each run, wall time) and OUT_DIR/curves.html (train reward and validation reward of
every seed on one chart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from agentloop.report.plots import write_curves_html


def _rows(run: Path) -> list[dict]:
    rows: dict[float, dict] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows.setdefault(r["step"], {}).update(r)
    return [rows[k] for k in sorted(rows)]


def summarize(out: Path, seeds: list[int]) -> str:
    lines = ["| seed | val reward step 0 | train reward steps 1-3 | train reward last 3 steps | final val reward "
             "| tool-call rate first -> last | wall s |", "|---|---:|---:|---:|---:|---|---:|"]
    train_series, val_series = {}, {}
    for s in seeds:
        run = out / f"seed-{s}"
        rows = _rows(run)
        train = [r for r in rows if "train/reward" in r]
        val = [r for r in rows if "val/reward" in r]
        first3 = statistics.mean(r["train/reward"] for r in train[:3])
        last3 = statistics.mean(r["train/reward"] for r in train[-3:])
        wall = json.loads((run / "wall.json").read_text())["wall_s"] if (run / "wall.json").exists() else float("nan")
        lines.append(f"| {s} | {val[0]['val/reward']:.3f} | {first3:.3f} | {last3:.3f} | {val[-1]['val/reward']:.3f} "
                     f"| {train[0]['train/tool_call_rate']:.2f} -> {train[-1]['train/tool_call_rate']:.2f} "
                     f"| {wall:.0f} |")
        train_series[f"seed {s}"] = [(r["step"], r["train/reward"]) for r in train]
        val_series[f"seed {s}"] = [(r["step"], r["val/reward"]) for r in val]
    table = "\n".join(lines)
    (out / "summary.md").write_text(table + "\n")
    write_curves_html(out / "curves.html", "agentloop train --loop tool_agent_loop, seeds " + " ".join(map(str, seeds)),
                      [("train reward (mean of the step's episodes)", train_series),
                       ("validation reward (32 held-out prompts)", val_series)])
    return table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--summarize-only", action="store_true")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if not a.summarize_only:
        for s in a.seeds:
            run = out / f"seed-{s}"
            t0 = time.monotonic()
            cmd = [sys.executable, "-m", "agentloop.cli", "train", "--loop", "tool_agent_loop", "--run-dir", str(run),
                   f"rollout.seed={s}", f"learner.seed={s}", *a.overrides]
            with open(out / f"seed-{s}.log", "w") as log:
                rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
            (run / "wall.json").write_text(json.dumps({"wall_s": time.monotonic() - t0, "rc": rc}))
            print(f"seed {s}: exit {rc}, {time.monotonic() - t0:.0f} s", flush=True)
    print(summarize(out, a.seeds))


if __name__ == "__main__":
    main()
