"""GroupStream: every submitted GRPO group comes out exactly once, complete or cancelled; a cancelled
group's requests are aborted on the server; every server down cancels what is left; aborted episodes
are kept unscored. Scripted server (timing), a token-only loop."""

from __future__ import annotations

import asyncio

from agentloop.config import Config, ManagerConfig, load_config
from agentloop.loops.base import AgentLoopBase, TrajectoryBuilder
from agentloop.records import Sample
from agentloop.rollout.engine import RolloutEngine
from agentloop.server_manager import ServerManager
from tests.fakes.fake_sglang import FakeSGLang


class OneCall(AgentLoopBase):
    async def run(self, sample, sampling_params):
        traj = TrajectoryBuilder([1, 2, sample.index % 50 + 3])
        out = await self.server_manager.generate(sample.episode_id, prompt_ids=traj.all_ids,
                                                 sampling_params=sampling_params)
        traj.add_model(out)
        return traj.build(reward=None if out.finish_reason == "abort" else 1.0, finish_reason=out.finish_reason)


def cfg(tokens: int = 8) -> Config:
    c = load_config(None, ["server.urls=[\"http://127.0.0.1:1\"]", f"sampling.max_new_tokens={tokens}"])
    c.manager = ManagerConfig(health_interval_s=60, retry_budget_s=2, all_down_grace_s=0.2, max_attempts=2,
                              eject_after_failures=1, retry_backoff_s=0.01)
    return c


def samples(n: int) -> list[Sample]:
    return [Sample(index=i, uid=100 + i, data_source="t", messages=[{"role": "user", "content": "x"}])
            for i in range(n)]


def test_groups_come_out_once_complete_or_cancelled():
    async def main():
        fake = await FakeSGLang(token_delay_s=0.02).start()
        try:
            async with ServerManager([fake.url], cfg().manager, initial_version=3) as sm:
                eng = RolloutEngine(cfg(40), sm, None, OneCall, progress=False)
                st = eng.stream()
                for s in samples(4):
                    st.submit(s, 3)
                await fake.started.wait()
                assert st.cancel(101, "stale: test") and not st.cancel(999, "unknown")
                outs = [await st.next() for _ in range(4)]
                left = await st.cancel_all("end")
                aborts = [b["rid"] for p, b in fake.admin if p == "/abort_request"]
                return outs, left, st.counts, aborts, st.started_version(100)
        finally:
            await fake.stop()

    outs, left, counts, aborts, started = asyncio.run(asyncio.wait_for(main(), 60))
    by_uid = {o.sample.group_uid: o for o in outs}
    assert sorted(by_uid) == [100, 101, 102, 103] and left == []
    assert by_uid[101].cancelled == "stale: test" and by_uid[101].records == []
    for uid in (100, 102, 103):
        o = by_uid[uid]
        assert o.cancelled is None and [r.repeat for r in o.records] == [0, 1, 2]
        assert all(r.uid == uid and r.episode_id == f"{uid}-{r.repeat}" for r in o.records)
        assert o.oldest_version == 3 and all(set(r.token_versions) == {3} for r in o.records)
    assert counts == {"submitted": 4, "completed": 3, "cancelled": 1, "episodes_cancelled": 3}
    assert 1 <= len(aborts) <= 3  # the cancelled group's running requests were aborted on the server
    assert started is None  # forgotten once out


def test_every_server_down_cancels_the_rest():
    async def main():
        fake = await FakeSGLang(mode="error500").start()
        try:
            async with ServerManager([fake.url], cfg().manager) as sm:
                eng = RolloutEngine(cfg(), sm, None, OneCall, progress=False)
                st = eng.stream()
                for s in samples(3):
                    st.submit(s, 2)
                outs = [await st.next() for _ in range(3)]
                return outs, st.stopped
        finally:
            await fake.stop()

    outs, stopped = asyncio.run(asyncio.wait_for(main(), 60))
    assert stopped and "down" in stopped
    assert len(outs) == 3 and all(o.cancelled is not None for o in outs)


def test_aborted_episode_is_kept_unscored():
    async def main():
        fake = await FakeSGLang(token_delay_s=0.01).start()
        try:
            async with ServerManager([fake.url], cfg().manager) as sm:
                eng = RolloutEngine(cfg(40), sm, None, OneCall, progress=False)
                st = eng.stream()
                st.submit(samples(1)[0], 1)
                await fake.started.wait()
                fake.paused, fake.pause_mode = True, "abort"  # the server aborts it, no weight update
                return await st.next()
        finally:
            await fake.stop()

    out = asyncio.run(asyncio.wait_for(main(), 60))
    (rec,) = out.records
    assert out.cancelled is None and rec.finish_reason == "abort" and rec.reward is None and rec.error is None
