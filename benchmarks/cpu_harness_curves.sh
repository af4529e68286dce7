#!/usr/bin/env bash
# The reward curve of each real harness in a 20-step `agentloop train --loop openai_agent_loop agent.command=...`
# on the CPU (the embedded default: calculator task, tiny warm-started model), one run per harness, written to
# benchmarks/results_harness_curves/<harness>/ (metrics.jsonl, curves.html) and summarised in
# benchmarks/results_harness_curves/summary.md (train reward of steps 1-3 -> the last 3, validation at 0 and 20).
# The harness envs are those tests/integration/test_harnesses_real.py builds (~/.cache/agentloop/harness-envs).
# Run it once the warm start over varied renderings is shipped (benchmarks/gpu_build_warm_varied.sh): with the
# fixed-rendering warm start every harness but agentloop's own rendering starts near 0.
set -euo pipefail
cd "$(dirname "$0")/.."
ENVS=${AGENTLOOP_HARNESS_ENVS:-$HOME/.cache/agentloop/harness-envs}
OUT=benchmarks/results_harness_curves
mkdir -p "$OUT"
env_of() { ls -d "$ENVS/$1"-* | head -n 1; }
H=examples/harnesses
declare -A CMD=(
  [agents_sdk_responses]="agent.command=\"$(env_of agents_sdk)/bin/python $H/agents_sdk_worker.py\" agent.workers=2 agent.worker_concurrency=32"
  [agents_sdk_chat]="agent.command=\"$(env_of agents_sdk)/bin/python $H/agents_sdk_worker.py\" agent.workers=2 agent.worker_concurrency=32 agent.env.AGENT_API=chat"
  [langgraph_react]="agent.command=\"$(env_of langgraph)/bin/python $H/langgraph_react.py\""
  [smolagents]="agent.command=\"$(env_of smolagents)/bin/python $H/smolagents_tool_calling.py\""
)
for name in "${!CMD[@]}"; do
  rm -rf "$OUT/$name"
  eval .venv/bin/agentloop train --quiet --loop openai_agent_loop --run-dir "$OUT/$name" \
      sampling.max_new_tokens=160 agent.timeout_s=600 ${CMD[$name]} 2>&1 | tail -n 3
done
.venv/bin/python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
lines = ["| harness | train reward, steps 1-3 | last 3 | validation, step 0 | step 20 |", "| --- | --- | --- | --- | --- |"]
for run in sorted(p for p in out.iterdir() if (p / "metrics.jsonl").is_file()):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    tr = [r["train/reward"] for r in rows if "train/reward" in r]
    val = {r["step"]: r["val/reward"] for r in rows if "val/reward" in r}
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    lines.append(f"| {run.name} | {mean(tr[:3]):.2f} | {mean(tr[-3:]):.2f} | {val.get(0.0, float('nan')):.2f} | "
                 f"{val.get(max(val) if val else 0, float('nan')):.2f} |")
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
