#!/bin/bash
# Where a real GPU `agentloop train` step's time goes, for one or more checkouts of agentloop side by side
# on the same card and the same SGLang server (so "before" and "after" compare like with like).
#   A real `agentloop train` run (configs/train_qwen_gpu.yaml: the calculator task with the tool loop,
#   64 prompts x 8 samples, up to 512 new tokens a turn) of a random-weight Qwen2.5-0.5B-shaped model on one
#   GPU: one SGLang server and the learner share it, weights pushed by CUDA IPC (learner.weight_sync=tensor),
#   a checkpoint every SPLIT_CKPT_EVERY steps. `agentloop bench train --run-dir` then splits each run's steps
#   into rollout, reward, learner and sync, and reports the learner's tokens/s, MFU and peak memory.
# Random weights never call the tool, so every episode is one turn of 512 tokens (~362 prompt + 512
# response tokens) and the reward is 0: the shapes, not the learning, decide the timings here.
# Usage, from the repo root on the GPU machine (`.sglang-gpu` staged and carried):
#   SPLIT_CODES="base=/path/to/old/checkout new=." bash benchmarks/gpu_train_split.sh
# Each code dir holds `agentloop/` and `configs/`. Env: OUT (results, default ./bench_out), SPLIT_CODES
# ("new=."), SPLIT_STEPS (4), SPLIT_CKPT_EVERY (2), SPLIT_BUDGET_S (540), SPLIT_OVERRIDES_<name> (extra
# overrides for that code's run, e.g. SPLIT_OVERRIDES_new="learner.micro_batch_tokens=32768").
set -u
source benchmarks/gpu_env.sh split_script.log
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
T0=$(date +%s)
BUDGET=${SPLIT_BUDGET_S:-540}
STEPS=${SPLIT_STEPS:-4}
CKPT=${SPLIT_CKPT_EVERY:-2}
CODES=${SPLIT_CODES:-new=.}
BASEPATH=$PYTHONPATH  # the bundle's paths (gpu_env.sh sourced .sglang-gpu/install.sh)
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

log "launching sglang (a quarter of the GPU: the learner shares it)"
setsid python3 -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port $PORT \
  --attention-backend triton --sampling-backend pytorch --grammar-backend none \
  --mem-fraction-static 0.25 --cuda-graph-backend-prefill disabled > "$OUT/split_server.log" 2>&1 &
SERVER_PID=$!
deadline=$(( $(date +%s) + 240 ))
until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=3)" 2>/dev/null; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null || [ "$(date +%s)" -ge $deadline ]; then
    log "server did not come up"; tail -30 "$OUT/split_server.log"; exit 1
  fi
  sleep 2
done
log "server healthy"

n_codes=$(echo "$CODES" | wc -w)
i=0
for pair in $CODES; do
  name=${pair%%=*}; dir=$(cd "${pair#*=}" && pwd)
  i=$(( i + 1 ))
  # an even share of what is left for each remaining run, less a margin for the split report
  t=$(( ( $(left) - 20 ) / ( n_codes - i + 1 ) ))
  [ "$t" -gt 60 ] || { log "skip $name: budget spent"; continue; }
  extra_var="SPLIT_OVERRIDES_$name"
  RUN=/tmp/split_run_$name
  rm -rf "$RUN"
  log "[$name] agentloop train from $dir, $STEPS steps, checkpoint every $CKPT, up to ${t}s: ${!extra_var:-}"
  ( cd "$dir" && PYTHONPATH="$dir:$BASEPATH" timeout -k 10 "$t" python3 -m agentloop.cli train \
      --server-url "http://127.0.0.1:$PORT" --model "$MODEL" --config configs/train_qwen_gpu.yaml --run-dir "$RUN" \
      train.steps="$STEPS" train.val_every=0 learner.weight_sync=tensor learner.checkpoint_every="$CKPT" \
      ${!extra_var:-} ) > "$OUT/split_${name}_train.log" 2>&1
  log "[$name] train exit $?"
  tail -8 "$OUT/split_${name}_train.log"
  ( cd "$dir" && PYTHONPATH="$dir:$BASEPATH" python3 -m agentloop.cli bench train --run-dir "$RUN" ) 2>&1 | tail -22
  for f in metrics.jsonl bench_train.md learner.log; do [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUT/split_${name}_$f"; done
  # the step's model FLOPs from its records, whatever the checkout reports: every episode's own tokens, a
  # GRPO group's shared prompt once (agentloop.train.flops), so MFU compares across checkouts
  python3 - "$RUN" "$OUT/split_${name}_flops.json" <<'PY'
import json, sys
from pathlib import Path
run, out = Path(sys.argv[1]), Path(sys.argv[2])
res = {}
for f in sorted((run / "rollouts").glob("step-*.jsonl")):
    groups = {}
    for line in f.open():
        r = json.loads(line)
        if r.get("error") is None and r.get("reward") is not None and sum(r["response_mask"]):
            groups.setdefault(tuple(r["prompt_ids"]), []).append(len(r["response_ids"]))
    tokens = pairs = episode_tokens = 0
    for prompt, resp in groups.items():
        p = len(prompt) - 1
        tokens += p + sum(resp)
        pairs += p * p + sum((p + k) ** 2 - p * p for k in resp)
        episode_tokens += sum(p + k for k in resp)
    res[int(f.stem.split("-")[1])] = {"computed_tokens": tokens, "pairs": pairs, "episode_tokens": episode_tokens}
out.write_text(json.dumps(res, indent=1))
print("flops inputs per step:", res)
PY
done
stop_server
log "done"
