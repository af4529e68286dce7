"""Episodes/s of the code reward on this machine: the tool-demo code problems, reference solutions
(all tests pass) and a wrong variant of each (a test fails), scored concurrently as in a rollout.

    PYTHONPATH=. python benchmarks/code_reward_rate.py [--episodes 64] [--concurrency 4] [--backend auto]
                                                       [--python /usr/bin/python3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from agentloop.data.tool_demos import CODE_PROBLEMS
from agentloop.rewards.code import make_code_reward
from agentloop.rewards.config import CodeRewardConfig
from agentloop.tools.sandbox import SandboxLimits


async def main(episodes: int, concurrency: int, backend: str | None, python: str | None) -> None:
    cfg = CodeRewardConfig(max_concurrent=concurrency)
    extra = {"backend": backend} if backend else {}
    if python:
        extra["python"] = python
    limits = SandboxLimits(**extra)
    fn = make_code_reward(cfg, limits)
    jobs = []
    for i in range(episodes):
        p = CODE_PROBLEMS[i % len(CODE_PROBLEMS)]
        code = p.solution if i % 2 == 0 else p.solution.replace("return", "return None or", 1)
        jobs.append((f"```python\n{code}```", {"entry_point": p.entry_point, "tests": p.tests}))
    await fn("agentloop/code", jobs[0][0], jobs[0][1])  # warm-up (interpreter probe, caches)
    t0 = time.monotonic()
    results = await asyncio.gather(*(fn("agentloop/code", a, gt) for a, gt in jobs))
    dt = time.monotonic() - t0
    ok = sum(r["score"] == 1.0 for r in results[::2])
    reasons = sorted({r["sandbox"] for r in results})
    print(f"episodes={episodes} concurrency={concurrency} backend={backend or 'default'} python={python or 'default'} "
          f"cpus={os.cpu_count()} "
          f"wall={dt:.2f}s rate={episodes / dt:.2f} episodes/s reference_ok={ok}/{len(results[::2])} "
          f"reasons={reasons}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--backend", default=None, help="auto | builtin | bwrap (default: the config default)")
    ap.add_argument("--python", default=None, help="the sandbox's interpreter (default: the running one)")
    a = ap.parse_args()
    asyncio.run(main(a.episodes, a.concurrency, a.backend, a.python))
