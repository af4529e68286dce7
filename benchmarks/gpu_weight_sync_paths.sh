#!/bin/bash
# Sync time and logprob check of the three weight-sync paths (disk, tensor, nccl) for a random
# Qwen2.5-0.5B-shaped model; see gpu_weight_sync_paths.py. Needs 2 GPUs (device kind nvidia-h100-x2).
# Usage, from the repo root on the GPU machine (`.sglang-gpu` staged and carried):
#   bash benchmarks/gpu_weight_sync_paths.sh        (installs the bundle itself)
# Env: OUT (results folder, default ./bench_out), WS_BUDGET_S (420), WS_UPDATES (5), WS_BUCKETS_MB (64,256,1024).
set -u
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/wsp_script.log") 2>&1
export PYTHONUNBUFFERED=1 AGENTLOOP_CACHE_DIR=${AGENTLOOP_CACHE_DIR:-/tmp/alc}
# NVLink multicast stays off on shared hosts (the machine sets these; keep them for the servers too).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
# cuMem handles across processes failed the first broadcast ("Cuda failure 'invalid argument'"); legacy IPC works.
export NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0}
ulimit -n 65536 2>/dev/null || true
source .sglang-gpu/install.sh || { echo "bundle install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
timeout $(( ${WS_BUDGET_S:-420} + 60 )) python3 benchmarks/gpu_weight_sync_paths.py "$OUT"
RC=$?
echo "gpu_weight_sync_paths.py exit $RC"
exit $RC
