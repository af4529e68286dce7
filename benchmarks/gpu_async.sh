#!/bin/bash
# Synchronous vs asynchronous `agentloop train` on GPUs, side by side (benchmarks/async_bench.py), with a
# random-weight Qwen2.5-0.5B-shaped model (agentloop.models.modelzoo.ensure_shape_model).
# Usage, from the repo root on the GPU machine (`.sglang-gpu` staged and carried):
#   ASYNC_PART=separate  bash benchmarks/gpu_async.sh   # server on GPU 0, learner on GPU 1 (nccl sync):
#                                                       # the long-tail tool workload, then the 512-token single turn
#   ASYNC_PART=colocated bash benchmarks/gpu_async.sh   # server and learner share GPU 0 (CUDA IPC sync)
# Env: OUT (results, default ./bench_out), ASYNC_RUNS/ASYNC_RUNS2 (runs joined by +), ASYNC_STEPS (8), ASYNC_PROMPTS (32),
# ASYNC_SAMPLES (8), ASYNC_BUDGET_S (480: no run starts after it; each command must end inside 10 minutes).
set -u
PART=${ASYNC_PART:-separate}
source benchmarks/gpu_env.sh "async_$PART.log"
STEPS=${ASYNC_STEPS:-8}  # 8: with 4 (3 measured) η >= 2 mostly consumes the prefill of step 1 (RESULTS_async.md)
PROMPTS=${ASYNC_PROMPTS:-32}
SAMPLES=${ASYNC_SAMPLES:-8}
BUDGET=${ASYNC_BUDGET_S:-480}
MODEL=$(python3 -c "from agentloop.models.modelzoo import ensure_shape_model; print(ensure_shape_model('qwen2.5-0.5b-shape'))" | tail -1)
echo "model $MODEL"
common=(--model "$MODEL" --steps "$STEPS" --prompts "$PROMPTS" --samples "$SAMPLES" --budget-s "$BUDGET" --out "$OUT")
# one server (GPU 0) for every part of a call; separate = learner on GPU 1 (nccl), colocated = GPU 0 (CUDA IPC)
case "$PART" in
  separate)
    python3 benchmarks/async_bench.py "${common[@]}" --name separate --mem-fraction 0.8 \
      --part "longtail_2gpu:longtail:128:1:nccl:${ASYNC_RUNS:-sync+async:1+async:2}" \
      --part "single_2gpu:single:512:1:nccl:${ASYNC_RUNS2:-sync+async:1}" ;;
  colocated)
    python3 benchmarks/async_bench.py "${common[@]}" --name colocated --mem-fraction 0.3 --set learner.micro_batch_tokens=8192 \
      --part "longtail_1gpu:longtail:128:0:tensor:${ASYNC_RUNS:-sync+async:1}" ;;
  *) echo "unknown ASYNC_PART $PART (separate | colocated)"; exit 2 ;;
esac
echo "exit $?"
