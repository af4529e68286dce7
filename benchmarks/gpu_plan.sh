#!/bin/bash
# The GPU plan against what a run measures (issue 18): `agentloop train --config configs/train_qwen_gpu.yaml`
# on the random-weight Qwen2.5-0.5B shape with every memory/sync/timeout default left to the plan, a few
# steps, then the plan (plan.json) next to what the run measured (train_summary.json: the learner's peak,
# the servers' KV pool). Two placements, one after the other:
#   separate   both GPUs visible: the plan puts the server on one GPU and the learner on the other (nccl)
#   colocated  CUDA_VISIBLE_DEVICES=0: server and learner share the GPU (memory split, tensor sync)
# Usage, from the repo root on the GPU machine (`.sglang-gpu` staged and carried):
#   bash benchmarks/gpu_plan.sh                 # PLAN_PARTS="separate colocated", PLAN_STEPS=3
# Results: $OUT/plan_<part>.json (plan vs measured) and $OUT/plan.log.
set -u
source benchmarks/gpu_env.sh plan.log
STEPS=${PLAN_STEPS:-3}
MODEL=$(python3 -c "from agentloop.models.modelzoo import ensure_shape_model; print(ensure_shape_model('qwen2.5-0.5b-shape'))" | tail -1)
echo "model $MODEL"
# the bundle's SGLang 0.5.17 needs these launch flags (../shared/sglang-gpu/README.md)
SERVER_ARGS='server.extra_args=["--attention-backend","triton","--sampling-backend","pytorch","--grammar-backend","none","--cuda-graph-backend-prefill","disabled"]'
for part in ${PLAN_PARTS:-separate colocated}; do
  run=/tmp/plan_$part
  rm -rf "$run"
  vis=""
  [ "$part" = colocated ] && vis=0
  echo "=== $part (CUDA_VISIBLE_DEVICES=${vis:-all})"
  t0=$(date +%s)
  CUDA_VISIBLE_DEVICES=${vis:-${CUDA_VISIBLE_DEVICES:-0,1}} timeout 420 python3 -m agentloop.cli train \
    --config configs/train_qwen_gpu.yaml --model "$MODEL" --run-dir "$run" \
    "train.steps=$STEPS" train.val_every=0 train.prompts_per_step=32 learner.checkpoint_every=null \
    train.tensorboard=false "$SERVER_ARGS"
  echo "$part: exit $? after $(( $(date +%s) - t0 )) s"
  python3 - "$run" "$OUT/plan_$part.json" <<'EOF'
import json, sys
from pathlib import Path
run, out = Path(sys.argv[1]), Path(sys.argv[2])
res = {"plan": json.loads((run / "plan.json").read_text()) if (run / "plan.json").is_file() else None}
summary = run / "train_summary.json"
if summary.is_file():
    s = json.loads(summary.read_text())
    res.update({"summary_plan": s.get("plan"), "last_weights": s.get("last_weights"), "checkpoint": s.get("checkpoint")})
rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()] \
    if (run / "metrics.jsonl").is_file() else []
res["steps"] = [{k: r.get(k) for k in ("step", "time/step_s", "time/learner_s", "time/sync_s", "perf/peak_alloc_gib",
                                       "learner/perf/peak_alloc_gib", "learner/perf/peak_reserved_gib",
                                       "server/prefix_cache_hit_rate", "train/reward")} for r in rows]
res["config"] = (run / "config.yaml").read_text() if (run / "config.yaml").is_file() else None
out.write_text(json.dumps(res, indent=1))
print(json.dumps({k: v for k, v in res.items() if k != "config"}, indent=1)[:4000])
EOF
done
