#!/bin/bash
# Synchronous vs asynchronous `agentloop train` on GPUs, side by side (benchmarks/async_bench.py), with a
# random-weight Qwen2.5-0.5B-shaped model (agentloop.models.modelzoo.ensure_shape_model).
# Usage, from the repo root on the GPU machine (`.sglang-gpu` staged and carried):
#   ASYNC_PART=longtail2 bash benchmarks/gpu_async.sh   # server on GPU 0, learner on GPU 1 (nccl sync)
#   ASYNC_PART=single2   bash benchmarks/gpu_async.sh   # the plain 512-token single-turn shape, same placement
#   ASYNC_PART=colocated bash benchmarks/gpu_async.sh   # server and learner share GPU 0 (CUDA IPC sync)
# Env: OUT (results, default ./bench_out), ASYNC_RUNS (default per part), ASYNC_STEPS (4), ASYNC_PROMPTS (32),
# ASYNC_SAMPLES (8), ASYNC_BUDGET_S (480: no run starts after it; each command must end inside 10 minutes).
set -u
PART=${ASYNC_PART:-longtail2}
source benchmarks/gpu_env.sh "async_$PART.log"
STEPS=${ASYNC_STEPS:-4}
PROMPTS=${ASYNC_PROMPTS:-32}
SAMPLES=${ASYNC_SAMPLES:-8}
BUDGET=${ASYNC_BUDGET_S:-480}
MODEL=$(python3 -c "from agentloop.models.modelzoo import ensure_shape_model; print(ensure_shape_model('qwen2.5-0.5b-shape'))" | tail -1)
echo "model $MODEL"
common=(--model "$MODEL" --steps "$STEPS" --prompts "$PROMPTS" --samples "$SAMPLES" --budget-s "$BUDGET" --out "$OUT")
case "$PART" in
  longtail2)
    python3 benchmarks/async_bench.py "${common[@]}" --name longtail_2gpu --workload longtail --tokens 128 \
      --runs "${ASYNC_RUNS:-sync,async:1,async:2,async:4}" --server-gpu 0 --learner-gpus 1 --weight-sync nccl --mem-fraction 0.8 ;;
  single2)
    python3 benchmarks/async_bench.py "${common[@]}" --name single_2gpu --workload single --tokens 512 \
      --runs "${ASYNC_RUNS:-sync,async:1,async:2}" --server-gpu 0 --learner-gpus 1 --weight-sync nccl --mem-fraction 0.8 ;;
  colocated)
    python3 benchmarks/async_bench.py "${common[@]}" --name longtail_1gpu --workload longtail --tokens 128 \
      --runs "${ASYNC_RUNS:-sync,async:1}" --server-gpu 0 --learner-gpus 0 --weight-sync tensor --mem-fraction 0.35 ;;
  *) echo "unknown ASYNC_PART $PART"; exit 2 ;;
esac
echo "exit $?"
