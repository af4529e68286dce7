#!/bin/bash
# `agentloop bench train` on one GPU (or BT_NPROC GPUs): learner tokens/s, step time, peak memory and MFU of the
# real train_step (FSDP2, bf16 compute, fp32 master weights) for a random-weight Qwen2.5-shaped model, on
# synthetic GRPO batches of the GPU config's shape (512 episodes = 64 prompts x 8, 362 prompt + 512 response
# tokens) and of a long one (64 x (1024 + 1024)), through benchmarks/gpu_bench_train.py (one process per run;
# a failed or timed-out run is reported and skipped).
# Before/after on the same card: BT_BASE=/path/to/older/checkout adds that checkout's runs (its own
# defaults, learner.micro_batch_tokens BT_BASE_MBT) beside the current code's.
# Usage, from the repo root on the GPU machine (torch + transformers there; no sglang needed):
#   bash benchmarks/gpu_bench_train.sh
# Env: OUT (results, default ./bench_out), BT_MODEL (qwen2.5-0.5b-shape), BT_NPROC (1), BT_RUNS (the new code's
# runs as "name:PxR:seqs:overrides;..."; default below), BT_BASE, BT_BASE_MBT (16384), BT_WARMUP (1),
# BT_STEPS (2), BT_TIMEOUT_S (per run, 240), BT_BUDGET_S (540).
# CPU smoke test of the script: BT_MODEL=tiny BT_RUNS="cpu:16x16:8:learner.device=cpu,learner.dtype=float32" bash ...
set -uo pipefail
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 AGENTLOOP_CACHE_DIR=${AGENTLOOP_CACHE_DIR:-/tmp/alc}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
MODEL=${BT_MODEL:-qwen2.5-0.5b-shape}
KL=algo.kl_coef=0.001  # the GPU config's: a reference forward pass, as in a real step
RUNS=${BT_RUNS:-"flex32k:362x512:512:learner.micro_batch_tokens=32768,$KL;compile32k:362x512:512:learner.micro_batch_tokens=32768,learner.compile=true,$KL;flex32k:1024x1024:64:learner.micro_batch_tokens=32768,$KL"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"
python3 -c "from agentloop.bench.train import resolve_bench_model; print('model', resolve_bench_model('$MODEL'))" | tail -1

args=(--model "$MODEL" --nproc "${BT_NPROC:-1}" --warmup "${BT_WARMUP:-1}" --steps "${BT_STEPS:-2}"
      --timeout-s "${BT_TIMEOUT_S:-240}" --budget-s "${BT_BUDGET_S:-540}" --code "new=$PWD")
IFS=';' read -ra NEW <<< "$RUNS"
for r in "${NEW[@]}"; do
  # name:PxR:seqs:overrides -> new:name-PxR:PxR:seqs:overrides (shape in the name: a name may be reused per shape)
  IFS=':' read -r name shape seqs ov <<< "$r"
  args+=(--run "new:$name-$shape:$shape:$seqs:$ov")
done
if [ -n "${BT_BASE:-}" ]; then
  args+=(--code "base=$BT_BASE")
  for shape_seqs in 362x512:512 1024x1024:64; do
    args+=(--run "base:mbt${BT_BASE_MBT:-16384}-${shape_seqs%%:*}:$shape_seqs:learner.micro_batch_tokens=${BT_BASE_MBT:-16384}")
  done
fi
python3 benchmarks/gpu_bench_train.py "${args[@]}"
