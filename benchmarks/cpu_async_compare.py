"""Sync vs async runs of the embedded default, side by side: learning and wall time.

Usage (each OUT_DIR made by benchmarks/cpu_train_seeds.py, the same seeds):
    python benchmarks/cpu_train_seeds.py /tmp/sync train.schedule=sync --seeds 1 2 3
    python benchmarks/cpu_train_seeds.py /tmp/async1 train.schedule=async train.max_staleness=1 --seeds 1 2 3
    python benchmarks/cpu_async_compare.py /tmp/sync /tmp/async1 OUT_DIR
Writes OUT_DIR/async_compare.md: per seed, the final validation reward of each, the wall time of each
run's steps, and the wall time each schedule needed to reach the sync run's final validation reward
(first validation at or above it; steps' wall time summed from metrics.jsonl, the initial validation
excluded); and OUT_DIR/async_compare.html: the reward curves of both, against wall time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from agentloop.report.plots import write_curves_html


def rows(run: Path) -> list[dict]:
    merged: dict[float, dict] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            merged.setdefault(r["step"], {}).update(r)
    return [merged[k] for k in sorted(merged)]


def timeline(run: Path) -> list[tuple[float, dict]]:
    """(wall seconds since the first step began, row) per step."""
    t, out = 0.0, []
    for r in rows(run):
        if r["step"] >= 1:
            t += r.get("time/step_s", 0.0)
        out.append((t, r))
    return out


def time_to(run: Path, target: float) -> float | None:
    for t, r in timeline(run):
        if r["step"] >= 1 and r.get("val/reward", -1.0) >= target - 1e-9:
            return t
    return None


def main(sync_dir: str, async_dir: str, out_dir: str) -> None:
    a, b, out = Path(sync_dir), Path(async_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seeds = sorted(int(p.name.split("-")[1]) for p in a.glob("seed-*") if (b / p.name / "metrics.jsonl").is_file())
    lines = ["| seed | sync final val | async final val | sync wall s | async wall s | sync time to sync's final val "
             "| async time to it | speed-up |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    charts = []
    for s in seeds:
        ra, rb = a / f"seed-{s}", b / f"seed-{s}"
        va = [r["val/reward"] for r in rows(ra) if "val/reward" in r]
        vb = [r["val/reward"] for r in rows(rb) if "val/reward" in r]
        wall_a, wall_b = timeline(ra)[-1][0], timeline(rb)[-1][0]
        ta, tb = time_to(ra, va[-1]), time_to(rb, va[-1])
        speed = f"{ta / tb:.2f}x" if ta and tb else "not reached"
        lines.append(f"| {s} | {va[-1]:.3f} | {vb[-1]:.3f} | {wall_a:.0f} | {wall_b:.0f} | "
                     f"{ta if ta is None else round(ta)} | {tb if tb is None else round(tb)} | {speed} |")
        charts.append((f"seed {s}: reward vs wall seconds", {
            "sync train": [(t, r["train/reward"]) for t, r in timeline(ra) if "train/reward" in r],
            "async train": [(t, r["train/reward"]) for t, r in timeline(rb) if "train/reward" in r],
            "sync val": [(t, r["val/reward"]) for t, r in timeline(ra) if "val/reward" in r],
            "async val": [(t, r["val/reward"]) for t, r in timeline(rb) if "val/reward" in r]}))
    (out / "async_compare.md").write_text("\n".join(lines) + "\n")
    write_curves_html(out / "async_compare.html", "sync vs async, embedded default", charts, str(out))
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:4])
