"""Lent servers (agentloop.client.lending): a server put to sleep mid-episode loses nothing. Its calls are aborted
and continue at once on a server awake under the same weights (every token's version exact), it gets no request
while asleep, its memory is released only once its scheduler is idle (the scripted server dies otherwise, as
SGLang asserts), and after waking it takes requests again. Scripted servers (fault injection)."""

from __future__ import annotations

import asyncio

import pytest

from agentloop.config import ManagerConfig, SamplingParams
from agentloop.server_manager import ServerManager
from tests.fakes.fake_sglang import FakeSGLang

N, TOKENS = 24, 40


@pytest.mark.parametrize("saver", [True, False])
def test_sleeping_server_mid_episode_loses_nothing(saver):
    """saver: the lent server runs with SGLang's memory saver (its memory is released and resumed); without it
    (or on the CPU engine, which dies on a release) it only stops taking episodes."""
    async def main():
        a = await FakeSGLang(token_delay_s=0.01, weight_version="3").start()
        b = await FakeSGLang(token_delay_s=0.01, weight_version="3", memory_saver=saver).start()
        try:
            async with ServerManager([a.url, b.url], ManagerConfig(), initial_version=3) as sm:
                sp = SamplingParams(max_new_tokens=TOKENS, temperature=1.0, seed=1)
                tasks = [asyncio.create_task(sm.generate(f"e{i}", prompt_ids=[1, 2, i + 3], sampling_params=sp))
                         for i in range(N)]
                # mid-episode: both servers hold requests that have made tokens
                await b.wait_until(lambda f: f._active >= N // 2 - 2, timeout=30)
                await b.started.wait()
                on_b = b.inflight + b._active
                await sm.sleep_servers([b.url])
                seen_b = len(b.requests)
                asleep_gauge = sm.gauges()["server/asleep"]
                outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                after_sleep = len(b.requests)
                await sm.wake_servers([b.url])
                more = await asyncio.wait_for(asyncio.gather(*(
                    sm.generate(f"f{i}", prompt_ids=[9, 9, i + 3], sampling_params=sp) for i in range(8))), 60)
                return outs, more, on_b, seen_b, after_sleep, asleep_gauge, a, b
        finally:
            await a.stop()
            await b.stop()

    outs, more, on_b, seen_b, after_sleep, asleep_gauge, a, b = asyncio.run(main())
    assert on_b > 0
    assert len(outs) == N and all(len(o.token_ids) == TOKENS for o in outs)  # 0 episodes lost, none cut short
    assert all(o.finish_reason != "abort" for o in outs)
    moved = [o for o in outs if o.interrupted]
    assert moved and all(o.server == a.url for o in moved)  # continued on the server awake
    assert all(v == 3 for o in outs for v in o.token_versions)  # per-token versions exact
    assert after_sleep == seen_b  # no request reached the sleeping server
    assert asleep_gauge == 1.0
    assert not b.crashed  # released only once idle
    paths = [p for p, _ in b.admin]
    if saver:
        assert paths.index("/release_memory_occupation") > paths.index("/abort_request")
        assert paths[-2:] == ["/resume_memory_occupation", "/flush_cache"]
    else:
        assert "/release_memory_occupation" not in paths and "/resume_memory_occupation" not in paths
    assert len(more) == 8 and len(b.requests) > after_sleep  # awake again, it takes requests
