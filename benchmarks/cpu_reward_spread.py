"""Is an asynchronous run's reward curve within the synchronous run's seed-to-seed spread? (issue 29, item 3)

Every run trains the same number of samples per step (train.prompts_per_step x rollout.n_samples), so step k of each
is the same number of trained samples; the same seeds (rollout.seed = learner.seed = S) on both sides.

Usage (each DIR made by benchmarks/cpu_train_seeds.py with the same --seeds):
    python benchmarks/cpu_train_seeds.py /tmp/sync train.schedule=sync train.steps=10 --seeds 1 2 3
    python benchmarks/cpu_train_seeds.py /tmp/async2 train.schedule=async train.max_staleness=2 \\
        manager.concurrency.adaptive=true train.steps=10 --seeds 1 2 3
    python benchmarks/cpu_reward_spread.py /tmp/sync /tmp/async2 [more DIRs] > spread.md
Per step: the sync seeds' train reward min..max (the spread) and mean, and each other schedule's mean over its
seeds, marked `in` when it lies within the spread; then the final validation reward of every seed.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def rows(run: Path) -> dict[int, dict]:
    merged: dict[int, dict] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            merged.setdefault(int(r["step"]), {}).update(r)
    return merged


def seeds_of(d: Path) -> dict[str, dict[int, dict]]:
    return {p.name: rows(p) for p in sorted(d.glob("seed-*")) if (p / "metrics.jsonl").exists()}


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    dirs = [Path(a) for a in argv]
    runs = {d.name: seeds_of(d) for d in dirs}
    ref_name = dirs[0].name
    ref = runs[ref_name]
    others = [d.name for d in dirs[1:]]
    steps = sorted({s for seeds in runs.values() for r in seeds.values() for s in r if s >= 1})
    out = [f"Train reward per step (same trained samples per step): `{ref_name}` seeds {', '.join(ref)} as the "
           "spread; others: mean over their seeds (`in`: within the spread).", "",
           f"| step | {ref_name} min..max | {ref_name} mean | " + " | ".join(f"{o} mean" for o in others) + " |",
           "|---:|---|---:|" + "---|" * len(others)]
    inside = {o: [0, 0] for o in others}
    for s in steps:
        ref_vals = [r[s]["train/reward"] for r in ref.values() if s in r and "train/reward" in r[s]]
        if not ref_vals:
            continue
        lo, hi = min(ref_vals), max(ref_vals)
        cells = []
        for o in others:
            vals = [r[s]["train/reward"] for r in runs[o].values() if s in r and "train/reward" in r[s]]
            if not vals:
                cells.append("")
                continue
            m = statistics.fmean(vals)
            ok = lo - 1e-9 <= m <= hi + 1e-9
            inside[o][0] += ok
            inside[o][1] += 1
            cells.append(f"{m:.3f} {'in' if ok else 'OUT'} ({len(vals)} seeds)")
        out.append(f"| {s} | {lo:.3f}..{hi:.3f} | {statistics.fmean(ref_vals):.3f} | " + " | ".join(cells) + " |")
    out += ["", "| schedule | steps within the sync spread | final val reward per seed | mean |", "|---|---|---|---:|"]
    for name, seeds in runs.items():
        finals = []
        for r in seeds.values():
            vals = [r[s]["val/reward"] for s in sorted(r) if "val/reward" in r[s]]
            if vals:
                finals.append(vals[-1])
        within = "(the spread)" if name == ref_name else f"{inside[name][0]}/{inside[name][1]}"
        out.append(f"| {name} | {within} | {', '.join(f'{v:.3f}' for v in finals)} | "
                   f"{statistics.fmean(finals) if finals else float('nan'):.3f} |")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
