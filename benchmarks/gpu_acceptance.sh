#!/bin/bash
# The GPU acceptance: every GPU path the README promises, through the CLI, PASS/FAIL rows with their figures
# (benchmarks/gpu_acceptance.py says what each row runs and checks). From the repo root on a machine with 2 GPUs:
#   bash benchmarks/gpu_acceptance.sh one      # the one-GPU paths (two streams, one per GPU), < 10 min
#   bash benchmarks/gpu_acceptance.sh two      # the two-GPU paths, < 10 min
# Results: $OUT/acceptance_<part>.{json,md} and acceptance_<part>_logs.tgz (OUT default ./bench_out); compose
# benchmarks/RESULTS_gpu.md with `python benchmarks/gpu_acceptance.py --compose OUT/acceptance_*.json`.
# Without a package index (this workplace's GPU machines), stage first: `bash benchmarks/gpu_stage.sh` here, and
# carry `.gpu-stage` with the call.
set -uo pipefail
PART=${1:?which part: one | two}
source benchmarks/gpu_env.sh "acceptance_$PART.log"
python3 benchmarks/gpu_acceptance.py "$PART"
