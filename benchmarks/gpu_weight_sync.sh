#!/bin/bash
# Weight-sync time of SGLang's /update_weights_from_disk for a random Qwen2.5-0.5B-shaped model, and a
# logprob check (server vs transformers bf16/fp32) before and after the sync. See gpu_weight_sync.py.
# Usage, from the repo root on the GPU machine (`.sglang-gpu` staged and carried):
#   bash benchmarks/gpu_weight_sync.sh        (installs the bundle itself)
# Env: OUT (results folder, default ./bench_out), WS_BUDGET_S (default 360), WS_UPDATES (default 5).
set -u
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/ws_script.log") 2>&1
export PYTHONUNBUFFERED=1 AGENTLOOP_CACHE_DIR=${AGENTLOOP_CACHE_DIR:-/tmp/alc}
ulimit -n 65536 2>/dev/null || true
source .sglang-gpu/install.sh || { echo "bundle install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
# no tokenizer needed: the server runs with --skip-tokenizer-init and the check works on token ids
python3 benchmarks/gpu_weight_sync.py "$OUT"
RC=$?
echo "gpu_weight_sync.py exit $RC"
exit $RC
