"""The warm start's skill under each harness's rendering of the calculator task (transformers, CPU, T=1).

Usage:
    PYTHONPATH=. .venv/bin/python benchmarks/warm_renderings_eval.py [MODEL_DIR] [--n 64]
MODEL_DIR: default the shipped warm start (ensure_warm_model()). Prints one line per rendering of
agentloop.models.warmstart.renderings: the well-formed tool-call rate and the accuracy (the task's reward).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from agentloop.models.warmstart import ensure_warm_model, evaluate_tool_use
from agentloop.models.warmstart.renderings import renderings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", type=Path)
    ap.add_argument("--n", type=int, default=64)
    args = ap.parse_args()
    model = args.model or ensure_warm_model()
    print(f"| rendering | tool-call rate | accuracy |  ({model.name}, n={args.n}, T=1)\n| --- | --- | --- |")
    for name in renderings():
        t0 = time.monotonic()
        s = evaluate_tool_use(model, n=args.n, temperature=1.0, rendering=name)
        print(f"| {name} | {s.tool_call_rate:.3f} | {s.accuracy:.3f} |  ({time.monotonic() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
