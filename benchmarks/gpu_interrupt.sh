#!/bin/bash
# Every `train.interrupt` mode through a real `agentloop train` on GPUs, with each weight sync, side by side
# (benchmarks/async_bench.py: one server per part, reused by its runs; the long-tail tool workload of
# gpu_async.sh; random-weight Qwen2.5-0.5B shape). Usage, from the repo root on a 2-GPU machine
# (`.sglang-gpu` staged and carried):
#   INTERRUPT_PART=colocated bash benchmarks/gpu_interrupt.sh
#       two independent one-GPU parts at once: GPU 0 server + learner with tensor sync (CUDA IPC), GPU 1
#       server + learner with disk sync; eta=1 with abort, retract and in_place on each
#   INTERRUPT_PART=separate bash benchmarks/gpu_interrupt.sh
#       server on GPU 0, learner on GPU 1, nccl sync: sync, then eta=1 (and eta=2) with each mode
# Env: OUT (results, default ./bench_out), INTERRUPT_STEPS (8), INTERRUPT_MODES (the runs of each colocated
# part, joined by +; INTERRUPT_MODES_TENSOR / INTERRUPT_MODES_DISK per part), INTERRUPT_RUNS (the separate
# part's), INTERRUPT_BUDGET_S (no run starts after it; a command must end inside 10 minutes).
# Each run's logs, metrics and summaries (not its rollouts or weights) are packed into
# $OUT/interrupt_<part>_raw.tgz (the device returns 8 files at most, 16 MiB each).
set -u
PART=${INTERRUPT_PART:-colocated}
source benchmarks/gpu_env.sh "interrupt_$PART.log"
STEPS=${INTERRUPT_STEPS:-8}
BUDGET=${INTERRUPT_BUDGET_S:-420}
WORK=/tmp/interrupt_$PART
mkdir -p "$WORK"
MODEL=$(python3 -c "from agentloop.models.modelzoo import ensure_shape_model; print(ensure_shape_model('qwen2.5-0.5b-shape'))" | tail -1)
echo "model $MODEL"
common=(--model "$MODEL" --steps "$STEPS" --prompts 32 --samples 8 --budget-s "$BUDGET" --out "$WORK")
modes="${INTERRUPT_MODES:-async:1:abort+async:1:retract+async:1:in_place}"
case "$PART" in
  colocated)
    python3 benchmarks/async_bench.py "${common[@]}" --name tensor_gpu0 --server-gpu 0 --mem-fraction 0.3 \
      --set learner.micro_batch_tokens=8192 --part "colocated_tensor:longtail:128:0:tensor:${INTERRUPT_MODES_TENSOR:-$modes}" &
    a=$!
    python3 benchmarks/async_bench.py "${common[@]}" --name disk_gpu1 --server-gpu 1 --mem-fraction 0.3 \
      --set learner.micro_batch_tokens=8192 --part "colocated_disk:longtail:128:1:disk:${INTERRUPT_MODES_DISK:-$modes}" &
    b=$!
    wait $a; echo "tensor part exit $?"
    wait $b; echo "disk part exit $?" ;;
  separate)
    python3 benchmarks/async_bench.py "${common[@]}" --name separate --server-gpu 0 --mem-fraction 0.8 \
      --part "separate_nccl:longtail:128:1:nccl:${INTERRUPT_RUNS:-sync+$modes+async:2:abort+async:2:in_place}"
    echo "separate part exit $?" ;;
  *) echo "unknown INTERRUPT_PART $PART (colocated | separate)"; exit 2 ;;
esac
cat "$WORK"/async_*.md > "$OUT/interrupt_${PART}_tables.md" 2>/dev/null
cp "$WORK"/async_*.json "$OUT/" 2>/dev/null
(cd "$WORK" && find . \( -name '*.log' -o -name '*.json' -o -name '*.md' -o -name metrics.jsonl -o -name config.yaml \) \
   -not -path '*/checkpoints/*' -not -path '*/weights/*' -not -path '*/mailbox/step-*' -print0 \
   | tar czf "$OUT/interrupt_${PART}_raw.tgz" --null -T -) \
  && echo "raw: $OUT/interrupt_${PART}_raw.tgz"
cat "$OUT/interrupt_${PART}_tables.md"
