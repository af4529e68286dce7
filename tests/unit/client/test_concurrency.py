"""Concurrency that follows the servers (agentloop.client.concurrency): the AIMD rule on each server's limit, from
the load it reports, as plain synchronous calls (no event loop); SGLang's /v1/loads parsed."""

from __future__ import annotations

import pytest

from agentloop.client.concurrency import ConcurrencyControl, LoadSignal, parse_loads
from agentloop.config import ConcurrencyConfig, ManagerConfig


def _cfg(**kw) -> ConcurrencyConfig:
    base = dict(adaptive=True, initial=16, min_limit=2, max_limit=64, kv_soft=0.8, kv_hard=0.95, increase=4,
                decrease=0.5, busy_frac=0.9, max_queued=0)
    return ConcurrencyConfig(**{**base, **kw})


def sig(kv=0.1, waiting=0, running=0, retracted=0, max_running=None) -> LoadSignal:
    return LoadSignal(running=running, waiting=waiting, kv_usage=kv, retracted=retracted, max_running=max_running)


def test_raised_while_the_server_has_room_and_the_limit_binds():
    c = ConcurrencyControl(1, _cfg())
    assert c.limit(0) == 16
    assert c.observe(0, sig(kv=0.2), inflight=16) == 20  # at the limit, room left: +increase
    assert c.observe(0, sig(kv=0.2), inflight=20) == 24
    # the limit is not what holds requests back (few in flight): no raise
    assert c.observe(0, sig(kv=0.2), inflight=5) == 24
    for _ in range(20):
        c.observe(0, sig(kv=0.2), inflight=c.limit(0))
    assert c.limit(0) == 64  # the hard cap
    assert c.increases == 12


def test_soft_cap_holds_the_limit_and_hard_cap_lowers_it():
    c = ConcurrencyControl(1, _cfg())
    assert c.observe(0, sig(kv=0.85), inflight=16) == 16  # between soft and hard: held
    assert c.observe(0, sig(kv=0.96), inflight=16) == 8  # at/above hard: x decrease
    assert c.decreases == 1


@pytest.mark.parametrize("overload", [dict(waiting=3), dict(retracted=1), dict(kv=0.99)])
def test_lowered_before_it_queues_or_preempts(overload):
    c = ConcurrencyControl(1, _cfg(initial=40))
    assert c.observe(0, sig(**overload), inflight=40) == 20


def test_one_decrease_until_inflight_drains_to_the_lowered_limit():
    c = ConcurrencyControl(1, _cfg(initial=40))
    assert c.observe(0, sig(waiting=5), inflight=40) == 20
    # the server still reports the queue the old limit made: no second halving on the same evidence
    assert c.observe(0, sig(waiting=5), inflight=35) == 20
    assert c.decreases == 1
    # drained to the new limit, still queueing: lowered again
    assert c.observe(0, sig(waiting=2), inflight=20) == 10
    assert c.decreases == 2


def test_never_below_min_and_never_above_what_the_server_runs():
    c = ConcurrencyControl(1, _cfg(initial=3))
    assert c.observe(0, sig(kv=0.99), inflight=3) == 2
    assert c.observe(0, sig(kv=0.99), inflight=2) == 2  # the floor
    c = ConcurrencyControl(1, _cfg(initial=16))
    assert c.observe(0, sig(max_running=18), inflight=16) == 18  # requests past its max would only queue
    assert c.observe(0, sig(max_running=18), inflight=18) == 18


def test_manager_cap_is_a_hard_cap_and_servers_are_independent():
    c = ConcurrencyControl(2, _cfg(initial=16), hard_cap=20)
    assert c.observe(0, sig(), inflight=16) == 20
    assert c.observe(0, sig(), inflight=20) == 20
    assert c.observe(1, sig(kv=0.99), inflight=16) == 8
    assert c.limit(0) == 20 and c.limit(1) == 8
    g = c.gauges()
    assert g["server/conc_limit"] == 28.0 and g["server/0/conc_limit"] == 20.0
    assert g["server/conc_kv_usage"] == 0.99 and g["server/1/kv_usage"] == 0.99


def test_parse_sglang_v1_loads():
    body = {"loads": [
        {"dp_rank": 0, "num_running_reqs": 10, "num_waiting_reqs": 2, "token_usage": 0.4, "max_running_requests": 48,
         "queues": {"waiting": 2, "retracted": 1}},
        {"dp_rank": 1, "num_running_reqs": 5, "num_waiting_reqs": 0, "token_usage": 0.7, "max_running_requests": 48}]}
    s = parse_loads(body)
    assert s == LoadSignal(running=15, waiting=2, kv_usage=0.7, retracted=1, max_running=96)
    for bad in (None, True, {}, {"loads": []}, {"loads": [{"num_running_reqs": 1}]},
                {"loads": [{"num_running_reqs": 1, "num_waiting_reqs": 0, "token_usage": "x"}]}):
        assert parse_loads(bad) is None


def test_config_refuses_crossed_marks():
    with pytest.raises(ValueError, match="kv_soft"):
        ConcurrencyConfig(kv_soft=0.9, kv_hard=0.5)
    with pytest.raises(ValueError, match="min_limit"):
        ConcurrencyConfig(min_limit=10, max_limit=5)
    assert ManagerConfig().concurrency.adaptive is False


def test_manager_limits_follow_the_fake_servers_load():
    """Wired: each poll (driven here, not by the clock) sets the router's cap from /v1/loads; a burst of 200
    episodes against a server whose KV holds 40 is raised from 8 to the soft mark and never queues there."""
    import asyncio

    from agentloop.config import SamplingParams
    from agentloop.server_manager import ServerManager
    from tests.fakes.fake_sglang import FakeSGLang

    async def main():
        fake = await FakeSGLang(load_capacity=40).start()
        fake.hold()
        cfg = ManagerConfig(concurrency=_cfg(initial=8, increase=8, kv_soft=0.85, kv_hard=0.95, kv_settle=1.0,
                                               poll_s=3600))
        try:
            async with ServerManager([fake.url], cfg) as sm:
                sp = SamplingParams(max_new_tokens=2, temperature=1.0, seed=1)
                tasks = [asyncio.create_task(sm.generate(f"e{i}", prompt_ids=[1, 2, i % 100 + 3], sampling_params=sp))
                         for i in range(200)]
                limits = [sm.router.capacity(0)]
                for _ in range(8):
                    want = sm.router.capacity(0)
                    await fake.wait_until(lambda f, w=want: f.inflight >= w, timeout=60)
                    await sm.capacity.poll_once()
                    limits.append(sm.router.capacity(0))
                g = sm.gauges()
                fake.release()
                outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                return limits, fake.peak_inflight, len(outs), g
        finally:
            await fake.stop()

    limits, peak, done, g = asyncio.run(main())
    assert limits[:5] == [8, 16, 24, 32, 40], limits  # +8 while under the soft mark (32/40 = 0.8 < 0.85)
    # 40/40 running is past the hard mark: x0.5; the 40 held requests have not drained to 20, so no second cut
    assert limits[5:] == [20, 20, 20, 20], limits
    assert peak <= 40  # never past what the server runs: nothing waited in its queue
    assert done == 200
    assert g["server/conc_limit"] == float(limits[-1]) and g["server/0/kv_usage"] > 0


def test_a_server_without_v1_loads_falls_back_to_its_reported_capacity():
    """An SGLang without /v1/loads (the fake without load_capacity: 404) must not stay at the initial limit."""
    import asyncio

    from agentloop.client.capacity import SILENT_POLLS
    from agentloop.server_manager import ServerManager
    from tests.fakes.fake_sglang import FakeSGLang

    async def main():
        fake = await FakeSGLang(max_running_requests=300).start()
        try:
            async with ServerManager([fake.url], ManagerConfig(concurrency=_cfg(initial=8, poll_s=3600))) as sm:
                for _ in range(SILENT_POLLS + 2):
                    await sm.capacity.poll_once()
                await asyncio.wait_for(asyncio.gather(*sm.state.background), 10)
                return sm.router.capacity(0)
        finally:
            await fake.stop()

    assert asyncio.run(main()) == 64  # min(300 reported, max_limit 64 of _cfg)


def test_no_growth_while_kv_usage_is_still_rising():
    c = ConcurrencyControl(1, _cfg(kv_settle=0.05))
    assert c.observe(0, sig(kv=0.10), inflight=16) == 20
    assert c.observe(0, sig(kv=0.30), inflight=20) == 20  # +0.20 since the last poll: the KV admitted still grows
    assert c.observe(0, sig(kv=0.32), inflight=20) == 24  # settled
