#!/bin/bash
# sync and async η=2 + adaptive concurrency, alternating, one run at a time, the same seeds (issue 29 item 3)
cd /tmp/snaprw
export PYTHONPATH=/tmp/snaprw
for s in 1 2 3; do
  for spec in "sync train.schedule=sync" "async2conc train.schedule=async train.max_staleness=2 manager.concurrency.adaptive=true"; do
    set -- $spec; name=$1; shift
    timeout 900 /work/main/.venv/bin/python benchmarks/cpu_train_seeds.py /tmp/rw29b/$name "$@" train.steps=10 --seeds $s >> /tmp/rw29b/$name.out 2>&1
    echo "$(date +%T) $name seed $s rc $?" >> /tmp/rw29b/progress.txt
  done
done
