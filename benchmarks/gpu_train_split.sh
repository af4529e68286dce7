#!/bin/bash
# STATUS: written on 2026-11-26 and not yet run on a GPU (that session had no device time left).
# Where a GPU `agentloop train` step's time goes, and what shared prompts buy the GPU learner.
#   1. A real `agentloop train` run (configs/train_qwen_gpu.yaml: the calculator task with the tool loop,
#      64 prompts x 8 samples, up to 512 new tokens a turn) of a random-weight Qwen2.5-0.5B-shaped model
#      on one GPU: one SGLang server and the learner share it, weights pushed by CUDA IPC
#      (learner.weight_sync=tensor). `agentloop bench train --run-dir` then splits its steps into
#      rollout, reward, learner and sync.
#   2. `agentloop bench train` (the learner alone, synthetic GRPO groups) with learner.share_prompt off
#      vs on vs auto, for a prompt-heavy shape (1024 prompt + 256 response) and the bench's usual one
#      (256 + 768).
# Random weights never call the tool, so every episode is one turn of 512 tokens and the reward is 0:
# the shapes, not the learning, decide the timings here (GRPO still runs the full loss and KL).
# Usage, from the repo root on the GPU machine (`.sglang-gpu` staged and carried):
#   bash benchmarks/gpu_train_split.sh
# Env: OUT (results folder, default ./bench_out), SPLIT_STEPS (4), SPLIT_BUDGET_S (560), SPLIT_PARTS ("train bench").
set -u
source benchmarks/gpu_env.sh split_script.log
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
T0=$(date +%s)
BUDGET=${SPLIT_BUDGET_S:-560}
STEPS=${SPLIT_STEPS:-4}
PARTS=" ${SPLIT_PARTS:-train bench} "
PORT=30000
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( BUDGET - $(date +%s) + T0 )); }

log "host $(hostname), $(nproc) cores"
python3 -c "import sglang, torch, transformers; print('sglang', sglang.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
MODEL=$(python3 -c "from agentloop.models.modelzoo import ensure_shape_model; print(ensure_shape_model('qwen2.5-0.5b-shape'))" | tail -1)
log "model: $MODEL"

SERVER_PID=""
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  kill -TERM -- "-$SERVER_PID" 2>/dev/null
  for _ in $(seq 1 30); do kill -0 -- "-$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$SERVER_PID" 2>/dev/null
  SERVER_PID=""
}
trap stop_server EXIT

if [[ $PARTS == *" train "* ]]; then
  log "launching sglang (a quarter of the GPU: the learner shares it)"
  setsid python3 -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port $PORT \
    --attention-backend triton --sampling-backend pytorch --grammar-backend none \
    --mem-fraction-static 0.25 --cuda-graph-backend-prefill disabled > "$OUT/split_server.log" 2>&1 &
  SERVER_PID=$!
  deadline=$(( $(date +%s) + 240 ))
  until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=3)" 2>/dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null || [ "$(date +%s)" -ge $deadline ]; then
      log "server did not come up"; tail -30 "$OUT/split_server.log"; SERVER_PID=""; break
    fi
    sleep 2
  done
  if [ -n "$SERVER_PID" ]; then
    log "server healthy; agentloop train, $STEPS steps"
    RUN=/tmp/split_run
    timeout -k 10 $(( $(left) - 150 )) python3 -m agentloop.cli train --server-url "http://127.0.0.1:$PORT" \
      --model "$MODEL" --config configs/train_qwen_gpu.yaml --run-dir "$RUN" \
      train.steps="$STEPS" train.val_every=0 learner.weight_sync=tensor learner.micro_batch_tokens=8192 \
      learner.checkpoint_every=null 2>&1 | tail -40
    log "train exit ${PIPESTATUS[0]}"
    python3 -m agentloop.cli bench train --run-dir "$RUN" 2>&1 | tail -20
    for f in metrics.jsonl config.yaml bench_train.md; do [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUT/split_$f"; done
    tail -5 "$RUN"/learner*.log 2>/dev/null
    stop_server
  fi
fi

if [[ $PARTS == *" bench "* ]]; then
  bench() {  # $1 name, $2 prompt, $3 response, $4 share
    local t=$(( $(left) - 10 ))
    [ "$t" -gt 40 ] || { log "skip $1: budget spent"; return; }
    log "learner bench $1: 64 x ($2 + $3), group 8, share_prompt $4"
    timeout -k 5 "$t" python3 -m agentloop.cli bench train --model qwen2.5-0.5b-shape --bench-sequences 64 \
      --bench-group-size 8 --bench-prompt-tokens "$2" --bench-response-tokens "$3" --bench-warmup 1 \
      --bench-steps 3 --out "$OUT/share_$1.json" "run_dir=/tmp/share_$1" learner.device=cuda \
      learner.dtype=bfloat16 learner.micro_batch_tokens=8192 algo.kl_coef=0.001 "learner.share_prompt=$4" 2>&1 | tail -12
  }
  bench p1024_off 1024 256 off
  bench p1024_on 1024 256 on
  bench p256_off 256 768 off
  bench p256_auto 256 768 auto
  bench p256_on 256 768 on
fi
cd "$OUT" && python3 - <<'EOF'
import glob, json
for f in sorted(glob.glob("share_*.json")):
    r = json.load(open(f))["learner"]
    print(f"{f}: share {r['learner'].get('share_prompt')}, step {r['step_s']['mean']:.3f}s, "
          f"{r['tokens_per_s']:,.0f} episode tok/s, computed {r.get('computed_tokens_per_step')} of {r['tokens_per_step']}, "
          f"MFU {r['mfu']}, mem {r['peak_memory_gib']}")
EOF
log "done"
