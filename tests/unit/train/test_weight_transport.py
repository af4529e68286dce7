"""The weight transport's server halves (agentloop.train.weights.servers) against scripted servers, with a
scripted learner handle: each path gets the weights into the servers in the interrupt mode it was given, and the
mode travels to the learner with the push."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentloop.config import ManagerConfig
from agentloop.interrupt import interrupt_policy
from agentloop.server_manager import ServerManager
from agentloop.train.handle.protocol import LearnerHandle, PushOrder, SyncRequest, UpdateResult, WeightsOnDisk
from agentloop.train.weights.servers import HALVES, DiskHalf, PushHalf, TransportError
from agentloop.train.weights.sync import SYNCS
from tests.fakes.fake_sglang import FakeSGLang


class ScriptedLearner(LearnerHandle):
    """Only what a server half asks of a learner: the push order in, the update out."""

    def __init__(self):
        self.orders: list[PushOrder] = []

    async def allow_sync(self, step: int, order: Any) -> None:
        self.orders.append(order)

    async def wait_update(self, step: int, timeout_s: float) -> UpdateResult:
        return UpdateResult(step=step, weights=None, metrics={"sync/total_s": 0.1}, pushed=True)

    def __getattr__(self, name):  # the rest of the protocol is not a server half's business
        raise AssertionError(f"a server half called {name}")

    start = wait_ready = wait_caught_up = submitted = submit = wait_update_or_sync = finished_metrics = None
    weights = stop = wait_final = failure_context = where = close = None


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_every_path_has_both_halves():
    assert set(HALVES) == set(SYNCS) == {"disk", "tensor", "nccl"}


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_disk_half_loads_each_servers_own_copy_in_the_mode_given(mode):
    async def main():
        a, b = await FakeSGLang().start(), await FakeSGLang().start()
        try:
            async with ServerManager([a.url, b.url], ManagerConfig(health_interval_s=60), initial_version=0) as sm:
                async def stage(w: WeightsOnDisk):  # a pool that copied the directory to each server's node
                    return {a.url: f"/node-a/{w.path}", b.url: f"/node-b/{w.path}"}

                half = DiskHalf(sm, interrupt_policy(mode), ScriptedLearner(), stage=stage)
                upd = UpdateResult(step=1, weights=WeightsOnDisk("w1", host="learner-node"), metrics={})
                got, secs = await half.deliver(1, upd, 10)
                return got, secs, a, b, sm.expected_version, half.current
        finally:
            await a.stop(), await b.stop()

    got, secs, a, b, version, current = run(main())
    assert got.step == 1 and secs >= 0 and version == 1 and current.path == "w1"
    for fake, node in ((a, "/node-a/w1"), (b, "/node-b/w1")):
        bodies = [body for p, body in fake.admin if p == "/update_weights_from_disk"]
        assert bodies == [{"model_path": node, "flush_cache": interrupt_policy(mode).flush_in_update,
                           "weight_version": "1"}]
        assert ("/pause_generation", {"mode": mode}) in fake.admin and fake.weight_version == "1"


def test_push_half_orders_the_push_with_the_mode_and_resumes():
    async def main():
        fake = await FakeSGLang().start()
        learner = ScriptedLearner()
        try:
            async with ServerManager([fake.url], ManagerConfig(health_interval_s=60), initial_version=0) as sm:
                half = PushHalf(sm, interrupt_policy("retract"), learner)
                upd, _ = await half.deliver(1, SyncRequest(step=1, method="nccl"), 10)
                with pytest.raises(TransportError, match="stays out until the next push"):
                    await half.resync(fake.url)  # the servers hold weights no directory has
                return upd, learner.orders, fake, sm.server_versions()
        finally:
            await fake.stop()

    upd, orders, fake, versions = run(main())
    assert upd.pushed and orders == [PushOrder(1, (fake.url,), "retract")] and orders[0].flush_cache is False
    paths = [p for p, _ in fake.admin]
    assert paths.index("/pause_generation") < paths.index("/flush_cache") < paths.index("/continue_generation")
    assert versions == {fake.url: 1}


def test_a_half_refuses_the_other_paths_answer():
    async def main():
        async with ServerManager(["http://127.0.0.1:1"], ManagerConfig(health_interval_s=60)) as sm:
            disk, push = DiskHalf(sm, interrupt_policy("abort"), ScriptedLearner()), \
                PushHalf(sm, interrupt_policy("abort"), ScriptedLearner())
            with pytest.raises(TransportError, match="expects the learner's weights on disk"):
                await disk.deliver(1, SyncRequest(step=1, method="tensor"), 1)
            with pytest.raises(TransportError, match="without asking for paused servers"):
                await push.deliver(1, UpdateResult(step=1, weights=WeightsOnDisk("w"), metrics={}), 1)
            with pytest.raises(TransportError, match="on the learner's node"):
                await disk.load(WeightsOnDisk("w", host="elsewhere"), 1)  # nothing to ship it with

    run(main())
