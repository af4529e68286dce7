#!/bin/bash
# `agentloop bench rollout` against real SGLang on a GPU machine, for two model shapes:
#   tiny  the project's own tiny Qwen2 (agentloop.models.modelzoo.ensure_tiny_model), with its tokenizer
#   q05   a random-weight Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, 14/2 heads, vocab 151936,
#         bf16), served with --skip-tokenizer-init (our 2k-token tokenizer cannot detokenize its ids)
# Usage, from the repo root on the GPU machine (after `bash ../shared/sglang-gpu/stage.sh` here and
# with `.sglang-gpu` carried):  source .sglang-gpu/install.sh && bash benchmarks/gpu_bench_rollout.sh
# Env: OUT (results folder, default ./bench_out), BENCH_BUDGET_S (whole-script budget, default 540),
#      BENCH_REQUESTS / BENCH_CONC / BENCH_NEW / BENCH_PROMPT / BENCH_ROUNDS / BENCH_EPISODES.
# Writes under $OUT: script.log, server_<m>.log, bench_<m>.log, bench_<m>.json (7 files).
set -u
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/script.log") 2>&1
T0=$(date +%s)
BUDGET=${BENCH_BUDGET_S:-540}
REQ=${BENCH_REQUESTS:-1024}; CONC=${BENCH_CONC:-256}; NEW=${BENCH_NEW:-128}; PROMPT=${BENCH_PROMPT:-128}
ROUNDS=${BENCH_ROUNDS:-2}; EPIS=${BENCH_EPISODES:-4000}
PORT=30000
export AGENTLOOP_CACHE_DIR=${AGENTLOOP_CACHE_DIR:-/tmp/alc}
export PYTHONUNBUFFERED=1
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
log() { echo "[$(elapsed)s] $*"; }

SERVER_PID=""
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  log "stopping server pgid $SERVER_PID"
  kill -TERM -- "-$SERVER_PID" 2>/dev/null
  for _ in $(seq 1 30); do kill -0 -- "-$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$SERVER_PID" 2>/dev/null
  sleep 2
  SERVER_PID=""
}
trap stop_server EXIT

log "host: $(hostname); nproc $(nproc); ulimit -n $(ulimit -n)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import sglang, torch, transformers, aiohttp; print('sglang', sglang.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'aiohttp', aiohttp.__version__)"

# ---- models
TINY=$(python3 -c "from agentloop.models.modelzoo import ensure_tiny_model; print(ensure_tiny_model())" | tail -1)
log "tiny model: $TINY"; ls -la "$TINY"
# built (once, cached) by agentloop.models.modelzoo.ensure_shape_model, in the background while tiny is benched
(python3 -c "from agentloop.models.modelzoo import ensure_shape_model; print(ensure_shape_model('qwen2.5-0.5b-shape'))") \
  > /tmp/build_q05.txt 2>&1 &
BUILD_PID=$!

# ---- server + bench for one model
launch() {  # $1 name, $2 model dir, extra flags...
  local name=$1 dir=$2; shift 2
  log "launching sglang for $name ($dir) $*"
  setsid python3 -m sglang.launch_server --model-path "$dir" --host 127.0.0.1 --port $PORT \
    --attention-backend triton --sampling-backend pytorch --grammar-backend none \
    --mem-fraction-static 0.5 --cuda-graph-backend-prefill disabled --cuda-graph-max-bs-decode "$CONC" "$@" \
    > "$OUT/server_$name.log" 2>&1 &
  SERVER_PID=$!
  local deadline=$(( $(date +%s) + 220 ))
  while :; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then log "server for $name exited early"; tail -30 "$OUT/server_$name.log"; SERVER_PID=""; return 1; fi
    code=$(python3 -c "import urllib.request as u
try: print(u.urlopen('http://127.0.0.1:$PORT/health', timeout=3).status)
except Exception as e: print(getattr(e, 'code', 0))" 2>/dev/null)
    [ "$code" = 200 ] && { log "server for $name healthy"; return 0; }
    [ "$(date +%s)" -ge "$deadline" ] && { log "server for $name not healthy in time"; tail -30 "$OUT/server_$name.log"; return 1; }
    sleep 2
  done
}

probe() {  # one /generate to show the response shape
  python3 - "$1" <<'EOF'
import json, sys, urllib.request as u
vocab = int(sys.argv[1])
req = {"input_ids": [11, 12, 13, vocab - 1], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
       "return_logprob": True, "logprob_start_len": -1}
body = json.loads(u.urlopen(u.Request("http://127.0.0.1:30000/generate", json.dumps(req).encode(),
                                      {"Content-Type": "application/json"}), timeout=60).read())
meta = body["meta_info"]
print("probe keys:", sorted(body), "meta keys:", sorted(meta))
print("probe output_ids:", body.get("output_ids"), "logprobs[:2]:", meta.get("output_token_logprobs")[:2],
      "finish:", meta.get("finish_reason"))
from agentloop.server_manager import parse_generate_response
print("agentloop parse:", parse_generate_response(body, "probe"))
EOF
}

bench() {  # $1 name, $2 model dir, $3 requests, $4 episodes, $5 timeout
  log "bench $1: requests $3, concurrency $CONC, new $NEW, prompt $PROMPT, rounds $ROUNDS, episodes $4"
  timeout -k 5 "$5" python3 -m agentloop.cli bench rollout --server-url "http://127.0.0.1:$PORT" --model "$2" \
    --bench-requests "$3" --bench-concurrency "$CONC" --bench-new-tokens "$NEW" --bench-prompt-tokens "$PROMPT" \
    --bench-rounds "$ROUNDS" --bench-episodes "$4" --out "$OUT/bench_$1.json" "run_dir=/tmp/runs/$1" \
    2>&1 | tee "$OUT/bench_$1.log"
  log "bench $1 exit ${PIPESTATUS[0]}"
}

name=tiny
if launch tiny "$TINY"; then
  probe "$(python3 -c "import json;print(json.load(open('$TINY/config.json'))['vocab_size'])")" || log "probe tiny failed"
  bench tiny "$TINY" "$REQ" "$EPIS" $(( $(left) > 300 ? 200 : $(left) - 100 ))
fi
stop_server

wait "$BUILD_PID"; log "build q05 exit $?"; cat /tmp/build_q05.txt
Q05=$(tail -1 /tmp/build_q05.txt)
name=q05
LEFT=$(left)
log "time left for q05: ${LEFT}s"
REQ5=$REQ; EP5=$EPIS
[ "$LEFT" -lt 230 ] && { REQ5=$(( REQ / 2 )); EP5=$(( EPIS / 2 )); }
if [ "$LEFT" -gt 130 ] && [ -f "$Q05/config.json" ] && launch q05 "$Q05" --skip-tokenizer-init; then
  probe 151936 || log "probe q05 failed"
  bench q05 "$Q05" "$REQ5" "$EP5" $(( $(left) - 15 ))
else
  log "q05 skipped or failed to start"
fi
stop_server
log "done"
