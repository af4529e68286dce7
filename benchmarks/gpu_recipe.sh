#!/bin/bash
# STATUS: run on 2026-11-26 on one NVIDIA H100 (all four recipes, 2 steps x 8 prompts x 4 samples, through
# benchmarks/gpu_recipes_all.sh; results in benchmarks/RESULTS_recipes.md).
# One recipe (gsm8k | countdown | search_r1 | code) on one GPU with a 0.5B-shaped model: its data
# preparation, then `agentloop train --config configs/recipe_$RECIPE.yaml` for a few steps, then the
# step time split (`agentloop bench train --run-dir`).
# Usage, from the repo root (on the GPU machine: `.sglang-gpu` staged and carried):
#   bash benchmarks/gpu_recipe.sh gsm8k
#   DRY_RUN=1 bash benchmarks/gpu_recipe.sh search_r1     # CPU: prepare the data, validate the config, print the command
# Env: MODEL (a model dir, or qwen2.5-0.5b-shape = random weights; default), STEPS (3), PROMPTS (64), N (5),
#      TRAIN_INPUT / TEST_INPUT (the data set's own files; default: small stand-ins built from the bundled
#      sets, since the GPU machine has no network), CORPUS (search_r1's retriever corpus; default the demo
#      corpus), OUT (results folder, default ./bench_out), EXTRA (more key=value overrides), SERVER_URL (a
#      running SGLang server of the same model to use instead of launching one: several recipes can then
#      share one server start; it gets the base weights back afterwards).
set -euo pipefail
RECIPE=${1:?usage: gpu_recipe.sh gsm8k|countdown|search_r1|code}
case $RECIPE in gsm8k|countdown|search_r1|code) ;; *) echo "unknown recipe $RECIPE" >&2; exit 2 ;; esac
DRY=${DRY_RUN:-0}
OUT=${OUT:-$PWD/bench_out}
if [ "$DRY" = 1 ]; then
  mkdir -p "$OUT"
  AL="python3 -m agentloop.cli"
else
  source benchmarks/gpu_env.sh "recipe_$RECIPE.log"
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
  AL="python3 -m agentloop.cli"
fi
DATA=$OUT/data_$RECIPE
RUN=$OUT/run_$RECIPE
mkdir -p "$DATA"
log() { echo "[recipe $RECIPE] $*"; }

# The data set's own file format; without TRAIN_INPUT, a stand-in in that format from the bundled sets.
standin() {  # $1 = output jsonl in the data set's own columns
  python3 - "$RECIPE" "$1" <<'EOF'
import json, sys
from agentloop.data import builtin_rows
recipe, out = sys.argv[1], sys.argv[2]
if recipe == "gsm8k":
    rows = [{"question": r["extra_info"]["question"], "answer": r["extra_info"]["answer"]} for r in builtin_rows("gsm8k_mini")]
else:  # search_r1
    rows = [{"question": r["extra_info"]["question"], "golden_answers": r["reward_model"]["ground_truth"]["target"],
             "data_source": "nq"} for r in builtin_rows("search_qa")]
open(out, "w").write("".join(json.dumps(r) + "\n" for r in rows))
EOF
}
case $RECIPE in
  gsm8k|search_r1)
    if [ -z "${TRAIN_INPUT:-}" ]; then standin "$DATA/own.jsonl"; TRAIN_INPUT=$DATA/own.jsonl; TEST_INPUT=$DATA/own.jsonl; fi
    $AL data prepare "$RECIPE" --input "$TRAIN_INPUT" --output "$DATA/train.parquet" --split train
    $AL data prepare "$RECIPE" --input "${TEST_INPUT:-$TRAIN_INPUT}" --output "$DATA/test.parquet" --split test
    TRAIN=$DATA/train.parquet; TEST=$DATA/test.parquet ;;
  countdown)
    if [ -n "${TRAIN_INPUT:-}" ]; then
      $AL data prepare countdown --input "$TRAIN_INPUT" --output "$DATA/train.parquet" --limit 327680
      $AL data prepare countdown --input "${TEST_INPUT:-$TRAIN_INPUT}" --output "$DATA/test.parquet" --offset 327680 --limit 1024 --split test
    else
      $AL data prepare countdown --generate 4096 --output "$DATA/train.parquet"
      $AL data prepare countdown --generate 256 --seed 1 --output "$DATA/test.parquet" --split test
    fi
    TRAIN=$DATA/train.parquet; TEST=$DATA/test.parquet ;;
  code)
    if [ -n "${TRAIN_INPUT:-}" ]; then
      $AL data prepare code --input "$TRAIN_INPUT" --output "$DATA/train.jsonl"
    else
      $AL data prepare code --builtin code --output "$DATA/train.jsonl"
    fi
    TRAIN=$DATA/train.jsonl; TEST=$DATA/train.jsonl ;;
esac
for f in "$TRAIN" "$TEST"; do $AL data check "$f" --max-problems 5; done

MODEL=${MODEL:-qwen2.5-0.5b-shape}
if [ "$MODEL" = qwen2.5-0.5b-shape ] && [ "$DRY" != 1 ]; then
  MODEL=$(python3 -c "from agentloop.models.modelzoo import ensure_shape_model; print(ensure_shape_model('qwen2.5-0.5b-shape'))" | tail -1)
fi
ARGS=(--config "configs/recipe_$RECIPE.yaml" --model "$MODEL" --run-dir "$RUN"
      --data "$TRAIN" --val-data "$TEST" "train.steps=${STEPS:-3}"
      "train.prompts_per_step=${PROMPTS:-64}" "rollout.n_samples=${N:-5}" "train.val_every=0"
      "learner.warmup_steps=0" "learner.checkpoint_every=1000")
RETRIEVER_PID=""
if [ "$RECIPE" = search_r1 ]; then
  CORPUS=${CORPUS:-agentloop/data/corpus_demo.jsonl}
  ARGS+=("tools.search.url=\"http://127.0.0.1:8765/retrieve\"")
fi
# shellcheck disable=SC2206
ARGS+=(${EXTRA:-})

if [ "$DRY" = 1 ]; then
  $AL config "${ARGS[@]}" > "$OUT/config_$RECIPE.yaml"
  log "dry run: data in $DATA, resolved config in $OUT/config_$RECIPE.yaml; would run:"
  echo "$AL train ${ARGS[*]}"
  exit 0
fi
if [ "$RECIPE" = search_r1 ]; then
  $AL retriever serve --corpus "$CORPUS" --port 8765 > "$OUT/retriever.log" 2>&1 &
  RETRIEVER_PID=$!
  trap '[ -n "$RETRIEVER_PID" ] && kill "$RETRIEVER_PID"' EXIT
  for _ in $(seq 1 60); do grep -q serving "$OUT/retriever.log" && break; sleep 1; done
fi
if [ -n "${SERVER_URL:-}" ]; then ARGS+=(--server-url "$SERVER_URL"); fi
log "model $MODEL; agentloop train ${ARGS[*]}"
rm -rf "$RUN"  # a fresh run each time: an existing --run-dir would be resumed with its saved config
timeout -k 10 "${TRAIN_TIMEOUT_S:-540}" $AL train "${ARGS[@]}" || log "train failed: exit $?"
if [ -n "${SERVER_URL:-}" ]; then
  python3 -c "import json, sys, urllib.request as u; u.urlopen(u.Request(sys.argv[1] + '/update_weights_from_disk', json.dumps({'model_path': sys.argv[2], 'weight_version': '0'}).encode(), {'Content-Type': 'application/json'}), timeout=300).read()" "$SERVER_URL" "$MODEL" || log "could not restore the server's weights"
fi
$AL bench train --run-dir "$RUN" --out "$OUT/split_$RECIPE.json" || true
log "done: $RUN (metrics.jsonl, curves.html), split in $OUT/split_$RECIPE.json"
