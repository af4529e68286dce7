"""The real CPU SGLang server's reported capacity sizes manager.max_inflight_per_server when it is not set:
a burst of 300 requests goes out at once instead of 256 first and the rest as those finish."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from agentloop.config import ManagerConfig, SamplingParams
from agentloop.server_manager import ServerManager

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_real_server_capacity_sizes_the_cap(sglang_server):
    url = sglang_server.url

    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/server_info", timeout=aiohttp.ClientTimeout(total=30)) as r:
                info = await r.json()
        reported = info["internal_states"][0]["effective_max_running_requests_per_dp"]
        async with ServerManager([url], ManagerConfig(health_timeout_s=30)) as sm:
            sp = SamplingParams(max_new_tokens=2, temperature=1.0, seed=1)
            peak = 0
            done = asyncio.Event()

            async def watch():  # the client's own count of requests in flight to the server, every iteration
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, sm.router.servers[0].inflight)
                    await asyncio.sleep(0)

            w = asyncio.create_task(watch())
            outs = await asyncio.wait_for(asyncio.gather(*(
                sm.generate(f"e{i}", prompt_ids=[5, 6, i % 200 + 7], sampling_params=sp) for i in range(300))), 600)
            done.set()
            await w
            return reported, sm.router.capacity(0), peak, outs

    reported, cap, peak, outs = asyncio.run(main())
    assert isinstance(reported, int) and reported > 256, reported  # the tiny model's KV cache holds far more
    assert cap == reported
    assert peak > 256  # the burst was not cut at the default 256
    assert len(outs) == 300 and all(len(o.token_ids) == 2 for o in outs)
