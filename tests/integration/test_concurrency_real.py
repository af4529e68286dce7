"""manager.concurrency.adaptive against the real CPU SGLang server: its /v1/loads answer is read (the signal is in
the gauges), and a burst that holds the limit at its start raises it while the server has room."""

from __future__ import annotations

import asyncio

import pytest

from agentloop.config import ConcurrencyConfig, ManagerConfig, SamplingParams
from agentloop.server_manager import ServerManager

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_real_server_load_raises_the_limit(sglang_server):
    url = sglang_server.url

    async def main():
        cfg = ManagerConfig(health_timeout_s=30, concurrency=ConcurrencyConfig(
            adaptive=True, initial=4, min_limit=2, increase=4, poll_s=0.05))
        async with ServerManager([url], cfg) as sm:
            assert sm.router.capacity(0) == 4
            sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1, ignore_eos=True)
            seen: list[int] = []
            done = asyncio.Event()

            async def watch():  # the cap the router holds requests to, each loop iteration
                while not done.is_set():
                    seen.append(sm.router.capacity(0))
                    await asyncio.sleep(0)

            w = asyncio.create_task(watch())
            outs = await asyncio.wait_for(asyncio.gather(*(
                sm.generate(f"e{i}", prompt_ids=[5, 6, i % 200 + 7], sampling_params=sp) for i in range(200))), 600)
            done.set()
            await w
            return seen, sm.gauges(), outs

    seen, g, outs = asyncio.run(main())
    assert len(outs) == 200 and all(len(o.token_ids) == 16 for o in outs)
    assert max(seen) > 4, "the limit never rose although the server had room"
    assert g["server/conc_increases"] >= 1
    assert "server/0/kv_usage" in g  # the server's /v1/loads answer was understood
    assert g["server/conc_retracted"] == 0
