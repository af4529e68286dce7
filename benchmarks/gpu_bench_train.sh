#!/bin/bash
# `agentloop bench train` on one GPU: learner tokens/s, step time, peak memory and MFU of the real
# train_step (FSDP2, bf16 compute, fp32 master weights) for a random-weight Qwen2.5-0.5B-shaped model
# (agentloop.models.modelzoo.ensure_shape_model), on synthetic GRPO batches of 64 sequences x 1024 tokens.
# Runs: base (learner.micro_batch_tokens 8192; one epoch of one mini-batch, so no separate old-logprob
# pass), bigger micro-batches (16384), and two mini-batches (learner.mini_batches=2: two optimizer
# steps, and the old logprobs need their own forward pass). A failed variant is logged and skipped.
# Usage, from the repo root on the GPU machine:
#   source .sglang-gpu/install.sh && bash benchmarks/gpu_bench_train.sh
# (without the bundle it puts the repo on PYTHONPATH itself: the learner bench needs torch + transformers,
# not sglang). Env: OUT (results folder, default ./bench_out), BT_SEQS (64), BT_PROMPT (256),
# BT_RESPONSE (768), BT_GROUP (8), BT_VARIANTS ("base mbt16k two_minibatches"), BT_WARMUP (2), BT_STEPS (5), BT_TIMEOUT_S (per run, 300),
# BT_PEAK_TFLOPS (only for GPUs missing from agentloop.bench.train.PEAK_TFLOPS); for a CPU smoke test of
# the script itself: BT_MODEL=tiny BT_DEVICE=cpu BT_DTYPE=float32 BT_SEQS=4 BT_GROUP=2 BT_PROMPT=8 BT_RESPONSE=8.
# Writes under $OUT: bench_train_script.log, bench_train_<run>.json / .md / .log, bench_train_summary.md.
set -euo pipefail
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/bench_train_script.log") 2>&1
export PYTHONUNBUFFERED=1
export AGENTLOOP_CACHE_DIR=${AGENTLOOP_CACHE_DIR:-/tmp/alc}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SEQS=${BT_SEQS:-64}; PROMPT=${BT_PROMPT:-256}; RESPONSE=${BT_RESPONSE:-768}; GROUP=${BT_GROUP:-8}
WARMUP=${BT_WARMUP:-2}; STEPS=${BT_STEPS:-5}; TMO=${BT_TIMEOUT_S:-300}
SHAPE=${BT_MODEL:-qwen2.5-0.5b-shape}; DEVICE=${BT_DEVICE:-cuda}; DTYPE=${BT_DTYPE:-bfloat16}
PEAK=""
if [ -n "${BT_PEAK_TFLOPS:-}" ]; then PEAK="--peak-tflops=$BT_PEAK_TFLOPS"; fi
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

if ! python3 -c "import agentloop.bench.train" 2>/dev/null && [ -f .sglang-gpu/install.sh ]; then
  log "agentloop not importable: sourcing .sglang-gpu/install.sh"
  set +u; source .sglang-gpu/install.sh || { log "bundle install failed"; exit 1; }; set -u
fi
log "host $(hostname), $(nproc) cores"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"

log "model $SHAPE: building (once, cached in $AGENTLOOP_CACHE_DIR) or finding it"
MODEL=$(python3 -c "from agentloop.bench.train import resolve_bench_model; print(resolve_bench_model('$SHAPE'))" | tail -1)
log "model dir: $MODEL (the runs name it $SHAPE and find it in the cache)"; ls -la "$MODEL"

FAILED=""
bench() {  # $1 run name, then extra overrides
  local name=$1; shift
  log "run $name: $SEQS seqs x ($PROMPT + $RESPONSE) tokens, group $GROUP, $WARMUP warmup + $STEPS steps, $*"
  if timeout -k 10 "$TMO" python3 -m agentloop.cli bench train --model "$SHAPE" \
      --bench-sequences "$SEQS" --bench-group-size "$GROUP" --bench-prompt-tokens "$PROMPT" \
      --bench-response-tokens "$RESPONSE" --bench-warmup "$WARMUP" --bench-steps "$STEPS" $PEAK \
      --out "$OUT/bench_train_$name.json" "run_dir=/tmp/bench_train_runs/$name" \
      "learner.device=$DEVICE" "learner.dtype=$DTYPE" "$@" 2>&1 | tee "$OUT/bench_train_$name.log"; then
    cp "/tmp/bench_train_runs/$name/bench_train.md" "$OUT/bench_train_$name.md"
    log "run $name done"
  else
    log "run $name FAILED (exit ${PIPESTATUS[0]}); tail of its log above"
    FAILED="$FAILED $name"
  fi
}

VARIANTS=" ${BT_VARIANTS:-base mbt16k two_minibatches} "
[[ $VARIANTS == *" base "* ]] && bench base learner.micro_batch_tokens=8192
[[ $VARIANTS == *" mbt16k "* ]] && bench mbt16k learner.micro_batch_tokens=16384
[[ $VARIANTS == *" two_minibatches "* ]] && bench two_minibatches learner.micro_batch_tokens=8192 learner.mini_batches=2

{
  echo "# bench train, $SHAPE, $SEQS x $(( PROMPT + RESPONSE )) tokens per step"
  echo
  for f in "$OUT"/bench_train_base.md "$OUT"/bench_train_mbt16k.md "$OUT"/bench_train_two_minibatches.md; do
    [ -f "$f" ] || continue
    echo "## $(basename "$f" .md)"; tail -n +3 "$f"
  done
} > "$OUT/bench_train_summary.md"
cat "$OUT/bench_train_summary.md"
if [ -n "$FAILED" ]; then
  log "failed runs:$FAILED"
  exit 1
fi
log "done"
