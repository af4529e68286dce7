"""A /flush_cache that SGLang refuses for a moment (its scheduler is not fully idle right after its last request
ended: "Cache not flushed because there are pending requests. #queue-req: 0, #running-req: 0") is retried with
back-off, on every path that flushes (a bench's flush, the flush after a retract-mode weight update, a resync),
and never fails the run nor ejects the server. Scripted servers (fault injection)."""

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


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def flushes(fake: FakeSGLang) -> int:
    return sum(p == "/flush_cache" for p, _ in fake.admin)


def test_a_benchs_flush_outlasts_transient_refusals_without_ejecting():
    async def main():
        fake = await FakeSGLang().start()
        fake.refuse_flushes = 3
        try:
            async with ServerManager([fake.url], ManagerConfig(health_interval_s=60)) as sm:
                kept = await sm.flush_cache()
                out = await sm.generate("e-0", prompt_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
                return kept, sm.gauges(), flushes(fake), out.server
        finally:
            await fake.stop()

    kept, g, n, server = run(main())
    assert kept == [] and n == 4  # three refusals, then the flush
    assert g["server/flushes_refused"] == 3 and g["server/ejections"] == 0 and g["server/healthy"] == 1
    assert server is not None


def test_a_flush_refused_past_its_deadline_keeps_the_cache_and_the_server():
    events = []

    async def main():
        fake = await FakeSGLang().start()
        fake.refuse_flushes = 10_000
        try:
            async with ServerManager([fake.url], ManagerConfig(health_interval_s=60, flush_timeout_s=0.3),
                                     on_event=events.append) as sm:
                return await sm.flush_cache(), sm.gauges()
        finally:
            await fake.stop()

    kept, g = run(main())
    assert len(kept) == 1 and g["server/healthy"] == 1 and g["server/ejections"] == 0
    assert g["server/flushes_refused"] >= 2
    assert any("refused /flush_cache" in e and "kept" in e for e in events)


def test_a_server_that_is_down_still_fails_the_flush():
    async def main():
        fake = await FakeSGLang().start()
        url = fake.url
        await fake.stop()
        async with ServerManager([url], ManagerConfig(health_interval_s=60, admin_timeout_s=2)) as sm:
            with pytest.raises(ServerError, match="/flush_cache failed on 1/1"):
                await sm.flush_cache()

    run(main())


@pytest.mark.parametrize("path", ["update", "resync"])
def test_the_flush_after_a_retract_update_and_a_resync_outlasts_transient_refusals(tmp_path: Path, path: str):
    """retract: /flush_cache right after the update (and after a resync's reload); refused twice, it is retried,
    and the server stays admitted, serving the new version."""
    async def main():
        a, b = await FakeSGLang().start(), await FakeSGLang().start()
        cfg = load_config(None, ["train.interrupt=retract"])
        try:
            async with ServerManager([a.url, b.url], ManagerConfig(health_interval_s=60), initial_version=0) as sm:
                t = Trainer(cfg, tmp_path, sm, None, None, None, None, [])
                b.refuse_flushes = 2 if path == "update" else 0
                await t.weights.load(WeightsOnDisk(str(tmp_path / "weights")), 1)
                if path == "resync":
                    b.refuse_flushes = 2
                    await t.weights.resync(b.url)
                return sm.gauges(), b.weight_version, flushes(b)
        finally:
            await a.stop()
            await b.stop()

    g, vb, n = run(main())
    assert vb == "1" and g["server/healthy"] == 2 and g["server/ejections"] == 0
    assert g["server/flushes_refused"] == 2
    assert n == (3 if path == "update" else 4)
