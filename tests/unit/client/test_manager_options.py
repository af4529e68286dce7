"""The ServerManager is configured through its constructor (and `set_resync`), never by attributes set from
outside: what a trainer used to poke (`on_event`, `cache_salt`, `resync`) are arguments, read-only after."""

from __future__ import annotations

import asyncio

import pytest

from agentloop.config import ManagerConfig
from agentloop.server_manager import ServerManager
from tests.fakes.fake_sglang import FakeSGLang

SP = {"max_new_tokens": 3, "temperature": 1.0}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def test_cache_salt_and_on_event_are_constructor_arguments():
    async def main():
        fake = await FakeSGLang().start()
        lines: list[str] = []
        try:
            cfg = ManagerConfig(health_interval_s=60, eject_after_failures=1)
            async with ServerManager([fake.url], cfg, initial_version=3, cache_salt=True,
                                     on_event=lines.append) as sm:
                await sm.generate("e", prompt_ids=[5, 6], sampling_params=SP)
                sm.expect_version(4)  # the server serves 3: kept out, said through on_event
                return fake.requests[-1].get("extra_key"), lines
        finally:
            await fake.stop()

    key, lines = run(main())
    assert key == "agentloop-v3"
    assert any("serves version 3, expected 4" in ln for ln in lines), lines


def test_the_options_cannot_be_set_from_outside():
    sm = ServerManager(["http://127.0.0.1:1"])
    for name, value in (("cache_salt", True), ("resync", None), ("on_event", print)):
        with pytest.raises(AttributeError):
            setattr(sm, name, value)
    assert sm.cache_salt is False and sm.resync is None


def test_a_resync_hook_set_after_construction_brings_a_stale_server_back():
    calls: list[str] = []

    async def main():
        fake = await FakeSGLang().start()
        try:
            cfg = ManagerConfig(health_interval_s=60, answered_grace_s=0)
            async with ServerManager([fake.url], cfg, initial_version=0) as sm:
                sm.expect_version(1)  # serves 0: stale, out

                async def resync(url: str) -> None:
                    calls.append(url)
                    await sm.update_weights_from_disk("/w1", weight_version=1, urls=[url])

                sm.set_resync(resync)
                await sm.probe_all()
                return sm.router.servers[0].healthy, fake.weight_version
        finally:
            await fake.stop()

    healthy, version = run(main())
    assert calls and healthy and version == "1"


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_a_follower_continues_the_calls_its_leaders_pause_cuts_short(mode):
    """A rollout worker's manager generates while the driver's makes the admin calls: told of each pause first,
    the follower's call cut short continues under the new weights, its tokens stamped with both versions; without
    a follower the same pause ends it as an abort."""
    sp = {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 5}

    async def main(follow: bool):
        fake = await FakeSGLang(token_delay_s=0.01).start()
        try:
            cfg = ManagerConfig(health_interval_s=60)
            async with ServerManager([fake.url], cfg, initial_version=0) as leader, \
                    ServerManager([fake.url], cfg) as follower:
                follower.follow(leader.follower_state())
                if follow:
                    async def tell(state):
                        follower.follow(state)

                    leader.add_follower(tell)
                call = asyncio.create_task(follower.generate("e", prompt_ids=[5, 6, 7], sampling_params=sp))
                await fake.started.wait()
                await leader.pause(mode)
                await leader.update_weights_from_disk("/w1", weight_version=1, flush_cache=mode == "abort")
                await leader.resume()
                leader.expect_version(1)
                return await call, follower.gauges()
        finally:
            await fake.stop()

    out, g = run(main(True))
    assert len(out.token_ids) == 40 and out.token_versions[0] == 0 and out.token_versions[-1] == 1
    if mode == "abort":
        assert g["server/interrupted_calls"] == 1 and g["server/continued_calls"] == 1
        cut, _ = run(main(False))
        assert cut.finish_reason == "abort" and len(cut.token_ids) < 40  # what the follower hook prevents
