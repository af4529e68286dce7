"""What an abort-mode pause costs with requests in flight, on a real SGLang server: SGLang's own
/pause_generation {mode: abort} alone (what the manager sent before) vs `ServerManager.pause("abort")`,
which aborts in-flight requests and waits for their answers first. Alternating rounds, one server.

    python benchmarks/pause_cost.py                 # CPU: the tiny model, SGLANG_USE_CPU_ENGINE
    python benchmarks/pause_cost.py --url http://gpu-host:30000 --rounds 10
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from agentloop.config import ManagerConfig, SamplingParams
from agentloop.server_manager import ServerManager


async def one_round(sm: ServerManager, inflight: int, new: bool) -> float:
    sp = SamplingParams(max_new_tokens=2048, temperature=1.0, ignore_eos=True, seed=1)
    calls = [asyncio.create_task(sm.generate(f"p{i}-{time.monotonic_ns()}", prompt_ids=[5, 6, 7, i + 8],
                                             sampling_params=sp)) for i in range(inflight)]
    deadline = time.monotonic() + 60
    while sum(s.inflight for s in sm.router.servers) < inflight:  # every call is on the server
        done = [c for c in calls if c.done()]
        if done and done[0].exception() is not None:
            raise RuntimeError(f"a call failed: {done[0].exception()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {sum(s.inflight for s in sm.router.servers)} of {inflight} calls in flight")
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.5)  # and generating
    t0 = time.monotonic()
    if new:
        await sm.pause("abort")
    else:  # the old path: SGLang's abort-mode pause alone
        sm.state.unpaused.clear()
        sm.state.pause_mode = "abort"
        sm.state.pauses += 1
        sm.state.interrupts += 1
        await sm.control.broadcast("/pause_generation", {"mode": "abort"})
    dt = time.monotonic() - t0
    await sm.abort_all()
    for c in calls:
        c.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    await sm.resume()
    return dt


async def main(url: str, rounds: int, inflight: int) -> None:
    async with ServerManager([url], ManagerConfig(health_interval_s=3600)) as sm:
        res: dict[str, list[float]] = {"sglang pause alone": [], "abort, drain, then pause": []}
        for r in range(rounds):
            for new in ((False, True) if r % 2 == 0 else (True, False)):
                key = "abort, drain, then pause" if new else "sglang pause alone"
                res[key].append(await one_round(sm, inflight, new))
        for k, v in res.items():
            print(f"{k:26s} median {statistics.median(v):.3f} s  (min {min(v):.3f}, max {max(v):.3f}, n {len(v)})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=None, help="a running server (default: launch the tiny model on the CPU)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--inflight", type=int, default=16)
    a = ap.parse_args()
    if a.url:
        asyncio.run(main(a.url, a.rounds, a.inflight))
    else:
        from agentloop.inference.launcher import LocalServer
        from agentloop.models.modelzoo import ensure_tiny_model

        srv = LocalServer(ensure_tiny_model(), device="cpu", startup_timeout_s=300).start()
        try:
            asyncio.run(srv.wait_ready())
            asyncio.run(main(srv.url, a.rounds, a.inflight))
        finally:
            srv.stop()
