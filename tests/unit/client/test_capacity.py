"""manager.max_inflight_per_server, when not set, comes from each server's reported capacity (SGLang's
max_running_requests in /server_info): a 500-request burst to a server that runs 600 at once goes out in one
wave, not two of 256; set, it holds as given. Scripted server (what it reports and how many it holds)."""

from __future__ import annotations

import asyncio

from agentloop.config import ManagerConfig, SamplingParams
from agentloop.server_manager import ServerManager, reported_capacity
from tests.fakes.fake_sglang import FakeSGLang


def test_reported_capacity_reads_sglang_server_info():
    assert reported_capacity({"internal_states": [{"effective_max_running_requests_per_dp": 300},
                                                  {"effective_max_running_requests_per_dp": 200}],
                              "max_running_requests": 999}) == 500  # summed over data-parallel ranks
    assert reported_capacity({"internal_states": [{"max_running_requests": 64}]}) == 64
    assert reported_capacity({"max_running_requests": 48}) == 48  # older servers: the launch argument
    for bad in (None, [], {}, {"max_running_requests": None}, {"max_running_requests": 0},
                {"max_running_requests": True}, {"internal_states": [{"x": 1}]}):
        assert reported_capacity(bad) is None


def _burst(fake_kwargs: dict, cfg: ManagerConfig, n: int):
    async def main():
        fake = await FakeSGLang(**fake_kwargs).start()
        fake.hold()
        try:
            async with ServerManager([fake.url], cfg) as sm:
                sp = SamplingParams(max_new_tokens=2, temperature=1.0, seed=1)
                tasks = [asyncio.create_task(sm.generate(f"e{i}", prompt_ids=[1, 2, i % 100 + 3], sampling_params=sp))
                         for i in range(n)]
                want = min(n, fake_kwargs.get("max_running_requests") or cfg.max_inflight_per_server or 256)
                if cfg.max_inflight_per_server is not None:
                    want = min(n, cfg.max_inflight_per_server)
                await fake.wait_until(lambda f: f.inflight >= want, timeout=60)
                await asyncio.sleep(0.2)  # not synchronisation: requests beyond the cap, if sent, arrive now
                peak = fake.inflight
                fake.release()
                outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                asked = sum(p == "/server_info" for p, _ in fake.admin)
                return peak, len(outs), sm.router.capacity(0), asked
        finally:
            await fake.stop()

    return asyncio.run(main())


def test_unset_cap_is_sized_from_the_servers_report():
    peak, done, cap, asked = _burst({"max_running_requests": 600}, ManagerConfig(), 500)
    assert (peak, done, cap) == (500, 500, 600)  # one wave: the default 256 would have held 244 back
    assert asked >= 1


def test_set_cap_holds_and_the_server_is_not_asked():
    peak, done, cap, asked = _burst({"max_running_requests": 600}, ManagerConfig(max_inflight_per_server=256), 500)
    assert (peak, done, cap, asked) == (256, 500, 256, 0)


def test_server_that_does_not_say_keeps_the_default():
    peak, done, cap, asked = _burst({}, ManagerConfig(), 300)
    assert (peak, done, cap) == (256, 300, 256) and asked >= 1


def test_a_saved_config_still_sizes_from_the_servers(tmp_path):
    """config.yaml holds every field: a resumed run (or a copied config) must size as the fresh run did, not
    read the fallback 256 back as a number the user set."""
    from agentloop.config import dump_config, load_config

    (tmp_path / "config.yaml").write_text(dump_config(load_config(None, [])))
    saved = load_config(tmp_path / "config.yaml", []).manager
    peak, done, cap, asked = _burst({"max_running_requests": 600}, saved, 500)
    assert (peak, done, cap) == (500, 500, 600) and asked >= 1
