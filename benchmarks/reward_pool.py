"""What running rewards off the event loop costs per episode: the built-in reward of the CPU default
(`agentloop/calculator`, gsm8k's `####` rule) scored inline on the loop (before) vs through the
engine's Scorer (the reward pool's worker processes, and the thread executor), one call at a time
(latency) and `--concurrency` calls at once (throughput, what a wave of finishing episodes sees).

    PYTHONPATH=. .venv/bin/python benchmarks/reward_pool.py
    PYTHONPATH=. .venv/bin/python benchmarks/reward_pool.py --calls 4000 --concurrency 256 --workers 4
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from agentloop.config import load_config
from agentloop.records import Sample
from agentloop.rewards import get_reward, score_episode
from agentloop.rollout.scorer import Scorer

ANSWER = "<tool_call>...</tool_call> The result is 893.\n#### 893"


def sample(i: int) -> Sample:
    return Sample(index=i, data_source="agentloop/calculator", messages=[{"role": "user", "content": "q"}],
                  ground_truth="893")


def inline(calls: int) -> tuple[float, float]:
    fn = get_reward("agentloop/calculator")
    t = []
    for i in range(calls):
        t0 = time.perf_counter()
        score_episode(fn, "agentloop/calculator", ANSWER, "893", {})
        t.append(time.perf_counter() - t0)
    return statistics.median(t), sum(t)


async def pooled(executor: str, workers: int, calls: int, concurrency: int) -> tuple[float, float, float]:
    cfg = load_config(None, [f"reward.executor={executor}", f"reward.workers={workers}"])
    scorer = Scorer(cfg)
    try:
        await scorer.score(sample(0), ANSWER)  # start-up: workers import agentloop.rewards once
        lat = []
        for i in range(calls):
            t0 = time.perf_counter()
            score, _ = await scorer.score(sample(i), ANSWER)
            lat.append(time.perf_counter() - t0)
            assert score == 1.0
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with gate:
                await scorer.score(sample(i), ANSWER)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(calls)))
        return statistics.median(lat), sum(lat), time.perf_counter() - t0
    finally:
        await scorer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--workers", type=int, default=4)
    a = ap.parse_args()
    med, total = inline(a.calls)
    print(f"inline on the loop       median {1000 * med:.3f} ms/call   {a.calls} calls one by one {total:.2f} s")
    for ex in ("process", "thread"):
        med, total, wave = asyncio.run(pooled(ex, a.workers, a.calls, a.concurrency))
        print(f"{ex:<7} x{a.workers} (Scorer)   median {1000 * med:.3f} ms/call   {a.calls} calls one by one "
              f"{total:.2f} s   {a.calls} at {a.concurrency} concurrent {wave:.2f} s "
              f"({1000 * wave / a.calls:.3f} ms/call)")


if __name__ == "__main__":
    main()
