"""A lent server put to sleep mid-episode on the real CPU SGLang server: its calls are aborted and it takes nothing
while asleep, then it is woken; with the only server asleep the calls wait for it and continue there, so nothing is
lost and every episode gets its whole budget. Its memory is not released: SGLang 0.5.23's CPU engine dies on
/release_memory_occupation (it calls torch.cuda.synchronize; seen in the placements smoke), so the manager releases
only servers whose /server_info says they run with the memory saver on a GPU, and this server says neither."""

from __future__ import annotations

import asyncio

import pytest

from agentloop.config import ManagerConfig, SamplingParams
from agentloop.server_manager import ServerManager

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_real_server_sleeps_mid_episode_and_wakes(sglang_server):
    url = sglang_server.url

    async def main():
        async with ServerManager([url], ManagerConfig(health_timeout_s=30)) as sm:
            sp = SamplingParams(max_new_tokens=48, temperature=1.0, seed=3, ignore_eos=True)
            tasks = [asyncio.create_task(sm.generate(f"e{i}", prompt_ids=[5, 6, i + 7], sampling_params=sp))
                     for i in range(8)]
            for _ in range(10_000):  # loop iterations, not time: until every call holds the server
                if sm.router.servers[0].inflight == 8:
                    break
                await asyncio.sleep(0)
            await sm.sleep_servers([url])
            asleep = sm.router.servers[0].asleep and sm.router.servers[0].inflight == 0
            await sm.wake_servers([url])
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 300)
            return asleep, outs, sm.gauges()

    asleep, outs, g = asyncio.run(main())
    assert asleep  # nothing ran on it while asleep
    assert len(outs) == 8 and all(len(o.token_ids) == 48 and o.finish_reason == "length" for o in outs)
    assert g["server/sleeps"] == 1 and g["server/wakes"] == 1 and g["server/healthy"] == 1  # alive: not released
