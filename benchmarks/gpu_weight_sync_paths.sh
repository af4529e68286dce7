#!/bin/bash
# Sync time and logprob check of the three weight-sync paths (disk, tensor, nccl) for a random
# Qwen2.5-0.5B-shaped model; see gpu_weight_sync_paths.py. Needs 2 GPUs (device kind nvidia-h100-x2).
# Usage, from the repo root on the GPU machine (`.sglang-gpu` staged and carried):
#   bash benchmarks/gpu_weight_sync_paths.sh        (installs the bundle itself)
# Env: OUT (results folder, default ./bench_out), WS_BUDGET_S (420), WS_UPDATES (5), WS_BUCKETS_MB (64,256,1024).
set -u
source benchmarks/gpu_env.sh wsp_script.log
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
timeout $(( ${WS_BUDGET_S:-420} + 60 )) python3 benchmarks/gpu_weight_sync_paths.py "$OUT"
RC=$?
echo "gpu_weight_sync_paths.py exit $RC"
exit $RC
