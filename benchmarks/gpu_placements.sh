#!/bin/bash
# Issue 29: the placements on 2 GPUs, one command per row set, bounded time (benchmarks/async_bench.py with two servers launched
# once: server 0 on GPU 0, server 1 on GPU 1 with --enable-memory-saver; both see every GPU, --base-gpu-id picks).
# Usage, from the repo root on a 2-GPU machine (`.gpu-stage` or `.sglang-gpu` carried, as for gpu_async.sh):
#   bash benchmarks/gpu_placements.sh
# Rows (the long-tail tool workload, 0.5B shape, PLACE_STEPS steps of PLACE_PROMPTS x PLACE_SAMPLES). Two servers
# start in ~140 s and an 8-step run takes 80-150 s (learner start included; RESULTS_async.md), so every row does
# not fit one 9-minute call: PLACE_SET picks the rows, in this order (a run that would start past PLACE_BUDGET_S
# is reported as skipped, not run):
#   a (default)  separate@0     server 0 only, learner GPU 1, nccl: sync; async η=2 (in_place)
#                lend@0.1@1     servers 0 and 1, learner GPU 1, tensor (CUDA IPC): async η=2 + conc + lend
#   b            colocated@0.1  servers 0 and 1, learner GPUs 0 and 1 (2 ranks), tensor: sync (both GPUs generate,
#                               then both train)
#                separate@0     async η=2 + conc (item 2 alone)
#                lend@0.1@1     async η=2 + lend (item 1 alone)
#   c            separate@0     async η=1 (in_place), async η=1 + conc
#                lend@0.1@1     async η=1 + conc + lend
# conc: manager.concurrency.adaptive (item 2); lend: server.lend_learner_gpus with server 1 lent (item 1). Each run
# is killed past budget + PLACE_GRACE_S and the whole command past PLACE_WALL_S (fails loudly: exit 124).
# Env: OUT (default ./bench_out), PLACE_SET (a), PLACE_ALL_VISIBLE (1), PLACE_STEPS (8), PLACE_PROMPTS (32), PLACE_SAMPLES (8),
#      PLACE_BUDGET_S (390), PLACE_GRACE_S (100), PLACE_WALL_S (520), PLACE_SMOKE=1: the CPU smoke (tiny model, 2
#      CPU servers, disk sync, 2 steps of 2 x 2; parts like set a and b's colocated sync; health probes tolerant of
#      a loaded 2-core box), for checking the logic off the GPU.
set -u
if [ "${PLACE_SMOKE:-0}" = 1 ]; then
  OUT=${OUT:-$PWD/bench_out}; mkdir -p "$OUT"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  exec timeout -k 20 "${PLACE_WALL_S:-1500}" python3 benchmarks/async_bench.py --device cpu --cpu-servers 2 \
    --name placements_smoke --steps "${PLACE_STEPS:-2}" --prompts "${PLACE_PROMPTS:-2}" --samples "${PLACE_SAMPLES:-2}" \
    --budget-s "${PLACE_BUDGET_S:-1200}" --run-grace-s "${PLACE_GRACE_S:-240}" --out "$OUT" \
    --set learner.micro_batch_tokens=2048 --set manager.health_timeout_s=60 --set manager.answered_grace_s=900 \
    --part "separate@0:longtail:16::disk:sync+async:1:abort:conc" \
    --part "lend@0.1@1:longtail:16::disk:async:1:abort:conc.lend" \
    --part "colocated@0.1:longtail:16::disk:sync"
fi
source benchmarks/gpu_env.sh placements.log
MODEL=$(python3 -c "from agentloop.models.modelzoo import ensure_shape_model; print(ensure_shape_model('qwen2.5-0.5b-shape'))" | tail -1)
echo "model $MODEL"
# The lent server releases its KV cache with SGLang's memory saver, which needs torch_memory_saver (not in the
# offline bundle): without it, server 1 starts without --enable-memory-saver and its release is SGLang's no-op
# (it still stops taking episodes while the learner trains: a KV pool sized to fit beside the learner, 0.35).
SAVER=1
python3 -c "import torch_memory_saver" 2>/dev/null || { SAVER=""; echo "torch_memory_saver missing: server 1 keeps its KV cache while asleep"; }
# Servers see every GPU (--base-gpu-id picks theirs): server 0 must open CUDA IPC handles of the learner on GPU 1 in
# the lend rows. PLACE_ALL_VISIBLE=0: each server sees only its GPU (as gpu_async.sh; the nccl rows as measured
# before), which the lend rows' tensor sync to server 0 cannot work with.
VISIBLE=--all-gpus-visible
[ "${PLACE_ALL_VISIBLE:-1}" = 0 ] && VISIBLE=""
case "${PLACE_SET:-a}" in
  a) PARTS=(--part "separate@0:longtail:128:1:nccl:sync+async:2:in_place"
            --part "lend@0.1@1:longtail:128:1:tensor:async:2:in_place:conc.lend") ;;
  b) PARTS=(--part "colocated@0.1:longtail:128:0,1:tensor:sync"
            --part "separate@0:longtail:128:1:nccl:async:2:in_place:conc"
            --part "lend@0.1@1:longtail:128:1:tensor:async:2:in_place:lend") ;;
  c) PARTS=(--part "separate@0:longtail:128:1:nccl:async:1:in_place+async:1:in_place:conc"
            --part "lend@0.1@1:longtail:128:1:tensor:async:1:in_place:conc.lend") ;;
  *) echo "unknown PLACE_SET ${PLACE_SET} (a | b | c)"; exit 2 ;;
esac
timeout -k 20 "${PLACE_WALL_S:-520}" python3 benchmarks/async_bench.py --model "$MODEL" --name "placements_${PLACE_SET:-a}" \
  --steps "${PLACE_STEPS:-8}" --prompts "${PLACE_PROMPTS:-32}" --samples "${PLACE_SAMPLES:-8}" \
  --budget-s "${PLACE_BUDGET_S:-390}" --run-grace-s "${PLACE_GRACE_S:-100}" --out "$OUT" \
  --server-gpu 0,1 --mem-fraction 0.45,0.35 --memory-saver "$SAVER" $VISIBLE \
  --set learner.micro_batch_tokens=8192 "${PARTS[@]}"
rc=$?
echo "exit $rc"
exit $rc
