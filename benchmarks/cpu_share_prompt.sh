#!/bin/bash
# learner.share_prompt side by side on this CPU: `agentloop bench train` with the embedded default's
# learner settings (the train preset) on synthetic GRPO groups of its shape: 8 prompts x 8 samples,
# 362 prompt tokens (the calculator task's templated prompt) + 48 response tokens.
# Runs off and auto alternately, ROUNDS times each, so drift of the machine hits both alike.
# Usage: bash benchmarks/cpu_share_prompt.sh [OUT_DIR]   (writes OUT_DIR/share_<mode>_<round>.json and summary.md)
set -euo pipefail
OUT=${1:-/tmp/cpu_share_prompt}
ROUNDS=${ROUNDS:-2}
AGENTLOOP=${AGENTLOOP:-$(command -v agentloop || echo .venv/bin/agentloop)}
mkdir -p "$OUT"
for r in $(seq 1 "$ROUNDS"); do
  for mode in off auto; do
    "$AGENTLOOP" bench train --model tiny --config agentloop/presets/train_tiny.yaml --bench-sequences 64 \
      --bench-group-size 8 --bench-prompt-tokens 362 --bench-response-tokens 48 --bench-warmup 1 --bench-steps 3 \
      --out "$OUT/share_${mode}_$r.json" "run_dir=$OUT/run_${mode}_$r" "learner.share_prompt=$mode" 2>&1 \
      | grep -E "step time|tokens/s|rows"
  done
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows, steps = [], {}
for f in sorted(out.glob("share_*.json")):
    r = json.loads(f.read_text())["learner"]
    mode = r["learner"]["share_prompt"]
    steps.setdefault(mode, []).append(r["step_s"]["mean"])
    rows.append(f"| {f.stem} | {mode} | {r['computed_tokens_per_step']:,.0f} of {r['tokens_per_step']:,} | "
                f"{r['step_s']['mean']:.2f} | {r['tokens_per_s']:,.0f} |")
mean = {m: sum(v) / len(v) for m, v in steps.items()}
text = "\n".join(["| run | share_prompt | tokens computed per step | step s | episode tok/s |",
                  "|---|---|---|---:|---:|", *rows, "",
                  f"mean step: off {mean['off']:.2f} s, auto {mean['auto']:.2f} s: **{mean['off'] / mean['auto']:.2f}x**"])
(out / "summary.md").write_text(text + "\n")
print(text)
PY
