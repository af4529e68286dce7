"""GroupStream: every submitted GRPO group comes out exactly once, complete or cancelled; a cancelled
group's requests are aborted on the server; every server down cancels what is left; aborted episodes
are kept unscored. Scripted server (timing), a token-only loop."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

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


def _members() -> list[str]:
    from agentloop.rollout.stream import GroupStreamProtocol

    return sorted(n for n in vars(GroupStreamProtocol) if not n.startswith("_")) + ["stopped"]


def test_the_engine_s_and_the_ray_workers_streams_offer_the_protocol_with_its_signatures():
    """What the async schedule drives (agentloop.rollout.stream): every member, each method with the protocol's
    parameters (names, kinds, defaults) and the same sync/async kind, on both streams."""
    import inspect

    pytest.importorskip("ray", reason="WorkerStream needs `pip install 'agentloop[ray]'`")
    from agentloop.cluster.ray_rollout import WorkerStream
    from agentloop.rollout.engine import GroupStream
    from agentloop.rollout.stream import GroupStreamProtocol

    streams = [GroupStream(SimpleNamespace()), WorkerStream(SimpleNamespace(workers=[]), SimpleNamespace())]
    members = _members()
    assert {"submit", "next", "cancel", "cancel_all", "running", "running_versions", "busy_fraction"} <= set(members)
    for st in streams:
        assert isinstance(st, GroupStreamProtocol), type(st).__name__
        for name in members:
            want, got = inspect.getattr_static(GroupStreamProtocol, name, None), inspect.getattr_static(st, name)
            if not callable(want):
                continue  # an attribute or a property: present (isinstance above)
            assert [(p.name, p.kind, p.default) for p in inspect.signature(got).parameters.values()] == \
                   [(p.name, p.kind, p.default) for p in inspect.signature(want).parameters.values()], \
                   f"{type(st).__name__}.{name}"
            assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), f"{type(st).__name__}.{name}"


class _Worker:
    """A rollout worker actor's handle as WorkerStream uses it: `run_group.remote(...)` answers the group complete,
    once the test releases it."""

    def __init__(self):
        self.calls: list[tuple[int, int | None]] = []
        self.release = asyncio.Event()
        self.run_group = SimpleNamespace(remote=self._run_group)
        self.cancel = SimpleNamespace(remote=lambda uid, reason: None)

    async def _run_group(self, sample, n, state, journal, load, key):
        from agentloop.rollout.engine import GroupOutcome

        self.calls.append((sample.group_uid, key))
        await self.release.wait()
        return GroupOutcome(sample=sample, n=n, key=key)


def test_the_workers_stream_keys_groups_as_the_engine_s_does():
    """`submit(..., key=)`: the same prompt twice under two keys is two groups, each outcome naming its key, on
    the workers' stream as on the engine's; a key in flight is refused."""
    pytest.importorskip("ray", reason="WorkerStream needs `pip install 'agentloop[ray]'`")
    from agentloop.cluster.ray_rollout import WorkerStream

    async def main():
        worker = _Worker()
        sm = SimpleNamespace(expected_version=2, follower_state=lambda: {})
        st = WorkerStream(SimpleNamespace(workers=[worker]), sm)
        s = samples(1)[0]
        st.submit(s, 2, key=0)
        st.submit(s, 2, key=1)
        with pytest.raises(ValueError, match="already in this stream"):
            st.submit(s, 2, key=1)
        assert sorted(st.running_uids()) == [0, 1]
        await asyncio.sleep(0)
        worker.release.set()
        return sorted([(await st.next()).key for _ in range(2)]), worker.calls

    keys, calls = asyncio.run(asyncio.wait_for(main(), 30))
    assert keys == [0, 1] and sorted(calls) == [(100, 0), (100, 1)]


def test_the_engine_s_stream_names_each_outcome_s_key():
    async def main():
        fake = await FakeSGLang().start()
        try:
            async with ServerManager([fake.url], cfg().manager) as sm:
                st = RolloutEngine(cfg(), sm, None, OneCall, progress=False).stream()
                s = samples(2)
                st.submit(s[0], 1)
                st.submit(s[0], 1, key=7)
                st.submit(s[1], 1, key=8)
                return sorted([(o.key, o.sample.group_uid, o.cancelled) for o in [await st.next() for _ in range(3)]])
        finally:
            await fake.stop()

    assert asyncio.run(asyncio.wait_for(main(), 60)) == [(7, 100, None), (8, 101, None), (100, 100, None)]
