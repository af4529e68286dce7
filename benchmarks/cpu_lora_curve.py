"""The calculator task's reward curve, LoRA against full weights, on the CPU: the embedded default `agentloop
train` (GRPO, tool_agent_loop, the tiny model's warm start) run twice with matched settings, one after another.

Usage: python benchmarks/cpu_lora_curve.py OUT_DIR [--steps N] [--lora-lr LR] [key=value ...]
Runs OUT_DIR/full and OUT_DIR/lora (learner.lora.enabled=true, rank 16, alpha 32, lr --lora-lr: LoRA takes a
larger learning rate than full weights, ~10x being the usual rule), then writes OUT_DIR/summary.md (train reward
of the first and last steps, validation rewards, wall time, the learner's step time and the weight sync's
time) and OUT_DIR/curves.html (both train and validation curves on one chart).
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


def _mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.mean(vals) if vals else float("nan")


def summarize(out: Path, note: str) -> str:
    lines = ["| run | train reward steps 1-3 | train reward last 3 | val rewards (by step) | learner s/step "
             "| sync s/step | wall s |", "|---|---:|---:|---|---:|---:|---:|"]
    train_series, val_series = {}, {}
    for name in ("full", "lora"):
        run = out / name
        if not (run / "metrics.jsonl").exists():
            continue
        rows = _rows(run)
        train = [r for r in rows if "train/reward" in r]
        val = [r for r in rows if "val/reward" in r]
        wall = json.loads((run / "wall.json").read_text())["wall_s"] if (run / "wall.json").exists() else float("nan")
        vals = ", ".join(f"{int(r['step'])}: {r['val/reward']:.3f}" for r in val)
        lines.append(f"| {name} | {_mean(train[:3], 'train/reward'):.3f} | {_mean(train[-3:], 'train/reward'):.3f} "
                     f"| {vals} | {_mean(train, 'time/learner_s'):.1f} | {_mean(train, 'time/sync_s'):.3f} "
                     f"| {wall:.0f} |")
        train_series[name] = [(r["step"], r["train/reward"]) for r in train]
        val_series[name] = [(r["step"], r["val/reward"]) for r in val]
    table = "\n".join(lines)
    (out / "summary.md").write_text(f"{note}\n\n{table}\n")
    write_curves_html(out / "curves.html", "calculator task, LoRA vs full weights (CPU)",
                      [("train reward (mean of the step's episodes)", train_series),
                       ("validation reward (32 held-out prompts)", val_series)])
    return table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--lora-lr", default="2e-3")
    ap.add_argument("--only", choices=["full", "lora"], default=None)
    ap.add_argument("--summarize-only", action="store_true")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args()
    out = Path(a.out)
    common = [f"train.steps={a.steps}", "train.val_every=4", "train.tensorboard=false", *a.overrides]
    runs = {"full": common, "lora": [*common, "learner.lora.enabled=true", "learner.lora.rank=16",
                                     "learner.lora.alpha=32", f"learner.lr={a.lora_lr}"]}
    if not a.summarize_only:
        for name, ov in runs.items():
            if a.only and name != a.only:
                continue
            run = out / name
            run.mkdir(parents=True, exist_ok=True)
            t0 = time.time()
            cmd = [sys.executable, "-c", "from agentloop.cli import main; main()", "train", f"run_dir={run}", *ov]
            with open(run / "train.log", "w") as log:
                subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
            (run / "wall.json").write_text(json.dumps({"wall_s": time.time() - t0, "cmd": ["agentloop", *cmd[3:]]}))
    note = (f"`python benchmarks/cpu_lora_curve.py {a.out} --steps {a.steps} --lora-lr {a.lora_lr}`: the embedded "
            "default `agentloop train` (calculator, tool_agent_loop, GRPO with k3 KL 0.1, 8 prompts x 8 samples, "
            "full weights at lr 2e-4) and the same with learner.lora (rank 16, alpha 32, all attention and MLP "
            f"projections, lr {a.lora_lr}), one after another on the shared 2-core CPU box")
    print(summarize(out, note))


if __name__ == "__main__":
    main()
