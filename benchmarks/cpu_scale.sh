#!/usr/bin/env bash
# Issue 21 scale benches on the 2-core CPU box, scripted servers (no model; SGLang's HTTP API; latencies
# scripted): episodes in flight per engine process (engine vs bare client, one run), remote vs local tools,
# prefix-cache reuse with sticky routing vs without. Results: benchmarks/results_scale/*.json and *.log.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results_scale
mkdir -p "$out"
agentloop bench rollout --scripted-server --bench-requests 0 --bench-episodes "${EPISODES:-10000}" \
    --out "$out/bench_rollout_10k.json" 2>&1 | tee "$out/bench_rollout_10k.log"
agentloop bench tools --remote --scripted-server --bench-episodes 1000 \
    --out "$out/bench_tools_remote_1k.json" 2>&1 | tee "$out/bench_tools_remote_1k.log"
agentloop bench cache --scripted-server --bench-servers 4 --bench-episodes 1000 \
    --out "$out/bench_cache_4servers.json" 2>&1 | tee "$out/bench_cache_4servers.log"
