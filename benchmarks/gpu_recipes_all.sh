#!/bin/bash
# Every recipe (gsm8k, countdown, search_r1, code) for a few steps on one GPU, sharing one SGLang server of
# the random-weight Qwen2.5-0.5B shape (benchmarks/gpu_recipe.sh with SERVER_URL), so one server start
# serves all four. The learner shares the GPU (CUDA IPC weight sync).
# Usage, from the repo root on the GPU machine (`.sglang-gpu` staged and carried):
#   bash benchmarks/gpu_recipes_all.sh            # RECIPES="gsm8k countdown search_r1 code", STEPS=2, PROMPTS=16, N=4
set -u
source benchmarks/gpu_env.sh recipes_all.log
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
MODEL=$(python3 -c "from agentloop.models.modelzoo import ensure_shape_model; print(ensure_shape_model('qwen2.5-0.5b-shape'))" | tail -1)
PORT=31000
setsid python3 -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port $PORT \
  --attention-backend triton --sampling-backend pytorch --grammar-backend none \
  --mem-fraction-static 0.3 --cuda-graph-backend-prefill disabled > "$OUT/recipes_server.log" 2>&1 &
SERVER_PID=$!
trap 'kill -TERM -- -$SERVER_PID 2>/dev/null' EXIT
for _ in $(seq 1 150); do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=3)" 2>/dev/null && break
  kill -0 $SERVER_PID 2>/dev/null || { echo "server died"; tail -30 "$OUT/recipes_server.log"; exit 1; }
  sleep 2
done
echo "server up"
for r in ${RECIPES:-gsm8k countdown search_r1 code}; do
  t0=$(date +%s)
  SERVER_URL=http://127.0.0.1:$PORT MODEL="$MODEL" STEPS=${STEPS:-2} PROMPTS=${PROMPTS:-16} N=${N:-4} \
    TRAIN_TIMEOUT_S=${TRAIN_TIMEOUT_S:-200} \
    EXTRA="learner.weight_sync=tensor learner.micro_batch_tokens=8192 ${EXTRA:-}" bash benchmarks/gpu_recipe.sh "$r" \
    2>&1 | grep -E "recipe|step [0-9]|error|Error|failed|done" | tail -20
  echo "recipe $r: $(( $(date +%s) - t0 ))s; $(tail -1 "$OUT/run_$r/metrics.jsonl" 2>/dev/null | cut -c1-300)"
done
