#!/bin/bash
# The cost of Ray: the same `agentloop train` on one GPU, server and learner colocated (CUDA IPC weight sync),
# once on this host's backend (cluster.backend=local) and once through Ray (cluster.backend=ray, a local Ray
# instance started for the run, cluster.colocate=true: the server actor and the learner's rank actor share
# GPU 0's placement-group bundle). Steps/h of each (steps after the first), side by side; Ray must cost < 2%.
# A random-weight Qwen2.5-0.5B-shaped model (agentloop.models.modelzoo.ensure_shape_model), the single-turn
# 512-token workload of benchmarks/gpu_async.sh's colocated part.
#
# Usage, from the repo root on the GPU machine (`.sglang-gpu` staged and carried, as for gpu_async.sh):
#   bash benchmarks/gpu_ray.sh
# Env: OUT (results, default ./bench_out), RAY_STEPS (8), RAY_PROMPTS (32), RAY_SAMPLES (8), RAY_TOKENS (512),
#      RAY_ORDER (local,ray: the order of the two runs; run it twice, once each way, to see the drift).
#
# Ray on the GPU machine: it has no package index, and the Ray wheel (~80 MB) is larger than one call may carry
# (64 MiB). Stage it in two halves, each carried by its own call (an ignored path that stays on the machine
# between calls), then this script joins and installs them into .ray-site (no dependencies: the bundle's
# environment has the rest but msgpack, staged with the first half):
#   here:    pip download --no-deps -d .ray-wheel ray==2.60.0 'msgpack>=1,<2'   (cp311 manylinux wheels)
#            split -b 60M .ray-wheel/ray-2.60.0-*.whl .ray-wheel/ray.whl.part-
#            mv .ray-wheel/ray-2.60.0-*.whl /tmp/     # the whole wheel must not travel
#   call 1:  carry [".ray-wheel/ray.whl.part-aa", ".ray-wheel/msgpack-*.whl"]: `ls .ray-wheel`
#   call 2:  carry [".ray-wheel/ray.whl.part-ab"]: `bash benchmarks/gpu_ray.sh`
set -u
source benchmarks/gpu_env.sh "ray_cost.log"
STEPS=${RAY_STEPS:-8}
PROMPTS=${RAY_PROMPTS:-32}
SAMPLES=${RAY_SAMPLES:-8}
TOKENS=${RAY_TOKENS:-512}
ORDER=${RAY_ORDER:-local,ray}

if ! python3 -c "import ray" 2>/dev/null; then
  if ! ls .ray-wheel/ray.whl.part-* >/dev/null 2>&1; then
    echo "Ray is not installed and no staged wheel is in .ray-wheel/ (see the top of this script)"; exit 2
  fi
  whl=$(python3 -c "import sys; print(f'ray-2.60.0-cp{sys.version_info[0]}{sys.version_info[1]}-cp{sys.version_info[0]}{sys.version_info[1]}-manylinux2014_x86_64.whl')")
  cat .ray-wheel/ray.whl.part-* > "/tmp/$whl"
  python3 -m pip install -q --no-deps --no-index --target "$PWD/.ray-site" "/tmp/$whl" .ray-wheel/msgpack-*.whl \
    || { echo "installing the staged Ray wheel failed"; exit 2; }
  export PYTHONPATH="$PWD/.ray-site${PYTHONPATH:+:$PYTHONPATH}"  # the Ray instance's workers inherit it
fi
python3 -c "import ray; print('ray', ray.__version__)" || exit 2

MODEL=$(python3 -c "from agentloop.models.modelzoo import ensure_shape_model; print(ensure_shape_model('qwen2.5-0.5b-shape'))" | tail -1)
echo "model $MODEL"
common=(train --quiet --model "$MODEL" --loop single_turn_agent_loop train.val_every=0 train.tensorboard=false
        "train.steps=$STEPS" "train.prompts_per_step=$PROMPTS" "rollout.n_samples=$SAMPLES"
        "sampling.max_new_tokens=$TOKENS" sampling.ignore_eos=true learner.weight_sync=tensor
        server.mem_fraction_static=0.3 learner.micro_batch_tokens=8192 learner.checkpoint_every=null)
for backend in ${ORDER//,/ }; do
  case "$backend" in
    local) extra=(server.gpus=[0] learner.gpus=[0]) ;;
    ray)   extra=(cluster.backend=ray cluster.colocate=true) ;;
    *) echo "unknown backend $backend (local | ray)"; exit 2 ;;
  esac
  run="$OUT/ray_cost_$backend"
  rm -rf "$run"
  t0=$(date +%s)
  timeout 590 python3 -m agentloop.cli "${common[@]}" --run-dir "$run" "${extra[@]}"
  echo "$backend: exit $?, $(( $(date +%s) - t0 )) s"
done

python3 - "$OUT" "$ORDER" <<'EOF'
import json, statistics, sys
from pathlib import Path
out, order = Path(sys.argv[1]), sys.argv[2].split(",")
rows, res = [], {}
for b in order:
    f = out / f"ray_cost_{b}" / "metrics.jsonl"
    steps = [json.loads(l) for l in f.read_text().splitlines()] if f.is_file() else []
    later = [r["time/step_s"] for r in steps if r.get("step", 0) >= 2]
    if not later:
        res[b] = None
        rows.append(f"| {b} | {len(steps)} | - | - | - |")
        continue
    mean = statistics.fmean(later)
    res[b] = 3600 / mean
    rows.append(f"| {b} | {len(steps)} | {mean:.2f} | {3600 / mean:.1f} | "
                f"{statistics.fmean(r['time/sync_s'] for r in steps if r.get('step', 0) >= 2):.2f} |")
cost = (res["local"] - res["ray"]) / res["local"] if res.get("local") and res.get("ray") else None
md = ["| backend | steps | step s (steps 2..) | steps/h | sync s |", "|---|---:|---:|---:|---:|", *rows, "",
      f"Ray costs {100 * cost:.2f}% of local's steps/h" if cost is not None else "no comparison (a run failed)"]
(out / "ray_cost.md").write_text("\n".join(md) + "\n")
(out / "ray_cost.json").write_text(json.dumps({"steps_per_h": res, "cost": cost}, indent=1))
print("\n".join(md))
EOF
