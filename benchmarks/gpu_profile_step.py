"""Profile one learner step on the GPU: where the time goes (kernels by CUDA time, host time, syncs).

Runs `Learner.train_step` on synthetic GRPO records of the bench (agentloop.bench.train.synthetic_records),
warms up, then records one step with torch.profiler. Works with any agentloop on PYTHONPATH that has
`Learner(model, algo, cfg).train_step(records, step)` (so an older checkout profiles the same way).
Prints the step's wall time, the GPU's busy time (sum of kernel times), host<->device syncs, the top
kernels by CUDA time and the top ops by host time; writes the tables to $OUT/profile_<label>.txt.

Usage: python3 benchmarks/gpu_profile_step.py LABEL SEQS PROMPT RESPONSE [learner.key=value algo.key=value ...]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main() -> int:
    label, seqs, prompt, response, *overrides = sys.argv[1:]
    import torch
    from torch.profiler import ProfilerActivity, profile

    from agentloop.bench.train import TrainBenchConfig, synthetic_records
    from agentloop.config import load_config
    from agentloop.models.modelzoo import resolve_named_model
    from agentloop.train.trainer.learner import Learner

    cfg = load_config(None, ["learner.dtype=bfloat16", *overrides])
    model = resolve_named_model("qwen2.5-0.5b-shape")
    bench = TrainBenchConfig(model="qwen2.5-0.5b-shape", sequences=int(seqs), group_size=8, prompt_tokens=int(prompt),
                             response_tokens=int(response))
    learner = Learner(model, cfg.algo, cfg.learner)
    try:
        vocab = learner.hf_config.vocab_size
        for step in (1, 2):
            learner.train_step(synthetic_records(bench, vocab, step=step), step)
        recs = synthetic_records(bench, vocab, step=3)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            m = learner.train_step(recs, 3)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    finally:
        learner.close()
    events = prof.key_averages()
    dev_attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    busy = sum(getattr(e, dev_attr) for e in events) / 1e6
    syncs = {e.key: e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                         "cudaMemcpyAsync", "aten::item", "aten::_local_scalar_dense")}
    sort_dev = "self_device_time_total" if dev_attr == "self_device_time_total" else "self_cuda_time_total"
    head = (f"[{label}] one step of {seqs} x ({prompt} + {response}): wall {wall:.2f} s, GPU busy {busy:.2f} s "
            f"({100 * busy / wall:.0f}%), micro-batches {m.get('actor/micro_batches')}, syncs/reads {syncs}")
    text = "\n".join([head, events.table(sort_by=sort_dev, row_limit=25),
                      events.table(sort_by="self_cpu_time_total", row_limit=15)])
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_{label}.txt").write_text(text + "\n")
    print(head, flush=True)
    print(events.table(sort_by=sort_dev, row_limit=12), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
