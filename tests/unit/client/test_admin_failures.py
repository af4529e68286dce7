"""Admin calls that fail on some servers: the failing server is ejected and the rest go on (re-admitted,
after a continue, once it answers); a pause that fails everywhere leaves nothing paused; servers paused
when the run dies are sent a continue, so `--server-url` servers are never left paused. Scripted servers
(fault injection)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentloop.config import ManagerConfig, load_config
from agentloop.errors import ServerError
from agentloop.server_manager import ServerManager
from agentloop.train.handle.protocol import WeightsOnDisk
from agentloop.train.orchestrator.loop import Trainer
from tests.fakes.fake_sglang import FakeSGLang

SP = {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 5}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def paths(fake: FakeSGLang) -> list[str]:
    return [p for p, _ in fake.admin]


def test_a_server_that_fails_the_pause_is_ejected_and_the_other_pauses_and_resumes():
    async def main():
        a, b = await FakeSGLang().start(), await FakeSGLang().start()
        b.refuse = {"/pause_generation"}
        try:
            async with ServerManager([a.url, b.url], ManagerConfig(health_interval_s=60)) as sm:
                await sm.pause("in_place")
                paused = (a.paused, b.paused, sm.gauges()["server/healthy"])
                await sm.resume()
                out = await sm.generate("e-0", prompt_ids=[1, 2, 3], sampling_params=SP)  # the run goes on
                b.refuse = set()
                await sm.probe_all()  # the health loop's round: b answers again
                return paused, out.server == a.url, a.paused, sm.gauges(), paths(b)
        finally:
            await a.stop()
            await b.stop()

    paused, on_a, a_paused, g, b_admin = run(main())
    assert paused == (True, False, 1.0)
    assert not a_paused and on_a
    assert g["server/ejections"] == 1 and g["server/admin_failures"] == 1
    assert g["server/readmissions"] == 1 and g["server/healthy"] == 2
    # b was sent a continue before its re-admission probe (a paused SGLang parks probes)
    assert "/continue_generation" in b_admin


def test_a_pause_that_fails_everywhere_leaves_no_server_paused():
    async def main():
        a, b = await FakeSGLang().start(), await FakeSGLang().start()
        a.refuse = b.refuse = {"/pause_generation"}
        try:
            async with ServerManager([a.url, b.url], ManagerConfig(health_interval_s=60)) as sm:
                with pytest.raises(ServerError, match="/pause_generation failed on 2/2 server"):
                    await sm.pause("retract")
                out = await sm.generate("e-0", prompt_ids=[1, 2, 3], sampling_params=SP)  # not left paused
                return out, paths(a), paths(b), sm.gauges()["server/healthy"]
        finally:
            await a.stop()
            await b.stop()

    out, a_admin, b_admin, healthy = run(main())
    assert len(out.token_ids) == 4 and healthy == 2
    assert a_admin[-1] == b_admin[-1] == "/continue_generation"


@pytest.mark.parametrize("how", ["exception", "cancelled"])
def test_servers_paused_when_the_run_dies_are_continued(how):
    async def main():
        fake = await FakeSGLang().start()
        try:
            async def the_run():
                async with ServerManager([fake.url], ManagerConfig(health_interval_s=60)) as sm:
                    await sm.pause("in_place")
                    if how == "exception":
                        raise RuntimeError("the learner died")
                    await asyncio.Event().wait()  # Ctrl-C: the run's task is cancelled here

            task = asyncio.create_task(the_run())
            await fake.wait_until(lambda f: f.paused)
            if how == "cancelled":
                task.cancel()
            with pytest.raises((RuntimeError, asyncio.CancelledError)):
                await task
            return fake.paused, paths(fake)
        finally:
            await fake.stop()

    paused, admin = run(main())
    assert not paused and admin[-1] == "/continue_generation"


def test_a_weight_push_goes_on_when_one_server_fails_the_pause(tmp_path: Path):
    """The weight transport's disk load with a server refusing the pause: both get the weights, the other is
    resumed."""
    async def main():
        a, b = await FakeSGLang().start(), await FakeSGLang().start()
        b.refuse = {"/pause_generation"}
        cfg = load_config(None, ["train.interrupt=retract"])
        try:
            async with ServerManager([a.url, b.url], ManagerConfig(health_interval_s=60), initial_version=0) as sm:
                t = Trainer(cfg, tmp_path, sm, None, None, None, None, [])
                await t.weights.load(WeightsOnDisk(str(tmp_path / "weights")), 1)
                return a.paused, b.paused, a.weight_version, b.weight_version, paths(a)
        finally:
            await a.stop()
            await b.stop()

    a_paused, b_paused, va, vb, a_admin = run(main())
    assert not a_paused and not b_paused and va == vb == "1"
    # retract: no flush inside the update, /flush_cache right after it (agentloop.interrupt)
    assert a_admin[-4:] == ["/pause_generation", "/update_weights_from_disk", "/flush_cache", "/continue_generation"]
