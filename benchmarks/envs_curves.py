"""The environment libraries' CPU training curves (benchmarks/results_envs/*/metrics.jsonl) as one figure and a table.

    .venv/bin/python benchmarks/envs_curves.py        # -> benchmarks/results_envs/curves.png, prints the table

Each run is `agentloop train --config configs/envs/<lib>_tiny.yaml --env ...` (the command is in each config's
header and in docs/environments.md, "Parity, exactness, scale"): the tiny warm-started model, 20 GRPO steps of
8 prompts x 8 samples.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results_envs"
RUNS = {"verifiers_calculator": "verifiers: ToolEnv calculator", "openenv_calculator": "OpenEnv: calculator server",
        "reasoning_gym_gcd": "reasoning-gym: gcd", "reasoning_gym_basic_arithmetic": "reasoning-gym: basic_arithmetic",
        "textarena_guess_the_number": "TextArena: GuessTheNumber-v0"}


def curves() -> dict[str, dict[str, list[tuple[int, float]]]]:
    out = {}
    for name in RUNS:
        path = RESULTS / name / "metrics.jsonl"
        if not path.is_file():
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out[name] = {k: [(int(r["step"]), r[k]) for r in rows if r.get(k) is not None]
                     for k in ("train/reward", "val/reward")}
    return out


def table(c: dict) -> str:
    lines = ["| run | train reward, first 3 -> last 3 steps | validation reward, first -> last |", "|---|---|---|"]
    for name, ks in c.items():
        tr = [v for _, v in ks["train/reward"]]
        va = [v for _, v in ks["val/reward"]]
        first, last = sum(tr[:3]) / 3, sum(tr[-3:]) / 3
        lines.append(f"| {RUNS[name]} | {first:.3f} -> {last:.3f} | {va[0]:.3f} -> {va[-1]:.3f} |")
    return "\n".join(lines)


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = curves()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for name, ks in c.items():
        for ax, k in zip(axes, ("train/reward", "val/reward")):
            xs, ys = zip(*ks[k]) if ks[k] else ((), ())
            ax.plot(xs, ys, marker="o" if k == "val/reward" else None, label=RUNS[name])
    for ax, title in zip(axes, ("training reward per step", "validation reward")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean reward")
    axes[1].legend(fontsize=8, loc="upper left")
    fig.suptitle("agentloop train, tiny warm-started model, 2-core CPU: one environment per library")
    fig.tight_layout()
    fig.savefig(RESULTS / "curves.png", dpi=110)
    print(table(c))
    print(f"wrote {RESULTS / 'curves.png'}")


if __name__ == "__main__":
    main()
