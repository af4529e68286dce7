"""algo.proximal=interpolate vs recompute on this CPU: time per learner step, and how far AReaL's interpolated
proximal logprobs are from the recomputed ones, on stale records as asynchronous rollouts make them.

Records (the bench's synthetic GRPO groups on the project's tiny model) carry token versions lagging 0..LAG
behind each step's starting weights, and behaviour logprobs that really are those versions' (the learner
computes each batch's logprobs ahead, at every version it passes through). Two learners train the same
batches with `learner.mini_batches` > 1 (so the proximal logprobs need a forward pass of their own):
recompute (which also reports `mismatch/interpolate_abs_err`, the interpolation's distance from the
recomputed values, beside `mismatch/logprob_abs_diff_mean`, the behaviour logprobs' distance) and interpolate.

Usage: python benchmarks/cpu_proximal.py [STEPS] [LAG] [MINI_BATCHES]   (wrap in flock on shared machines)
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    lag = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    minis = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    from agentloop.bench.train import TrainBenchConfig, synthetic_records
    from agentloop.models.modelzoo import ensure_tiny_model
    from agentloop.train.config import AlgoConfig, LearnerConfig
    from agentloop.train.trainer.learner import Learner

    model = ensure_tiny_model()
    bench = TrainBenchConfig(sequences=64, group_size=8, prompt_tokens=128, response_tokens=128, max_lag=lag)
    cfg = LearnerConfig(device="cpu", lr=3e-4, mini_batches=minis, micro_batch_tokens=8192, entropy_metric=False)
    results = {}
    history: dict[tuple[int, int], list[list[float]]] = {}  # (batch step, version) -> logprobs
    batches: dict[int, list] = {}
    for mode in ("recompute", "interpolate"):
        learner = Learner(model, AlgoConfig(proximal=mode), cfg)
        vocab = learner.hf_config.vocab_size
        times, interp_err, behav_err = [], [], []
        try:
            for s in range(1, steps + 1):
                if mode == "recompute":
                    # logprobs of this and the next `lag` batches under the current weights (version s - 1)
                    for t in range(s, s + lag + 1):
                        batches.setdefault(t, synthetic_records(bench, vocab, step=t))
                        history[(t, s - 1)] = learner.compute_logprobs(batches[t])
                recs = []
                for i, r in enumerate(batches[s]):
                    lps = [history[(s, v)][i][k] if v is not None else 0.0 for k, v in enumerate(r.token_versions)]
                    recs.append(r.model_copy(update={"response_logprobs": lps}))
                t0 = time.perf_counter()
                m = learner.train_step(recs, s)
                times.append(time.perf_counter() - t0)
                if "mismatch/interpolate_abs_err" in m:
                    interp_err.append(m["mismatch/interpolate_abs_err"])
                    behav_err.append(m["mismatch/logprob_abs_diff_mean"])
        finally:
            learner.close()
        later = times[1:] or times
        results[mode] = (sum(later) / len(later), interp_err, behav_err)
    rows = ["| proximal | step s (mean of steps 2..) | abs(interpolated - recomputed) | abs(behaviour - recomputed) |",
            "|---|---:|---:|---:|"]
    def cell(v: list[float]) -> str:
        return f"{sum(v) / len(v):.4f}" if v else "-"

    for mode, (t, ie, be) in results.items():
        rows.append(f"| {mode} | {t:.3f} | {cell(ie)} | {cell(be)} |")
    ratio = results["recompute"][0] / results["interpolate"][0]
    print(f"tiny model, 64 x (128 + 128), lags 0..{lag}, {minis} mini-batches, {steps} steps, CPU")
    print("\n".join(rows))
    print(f"interpolate is {ratio:.2f}x the speed of recompute per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
