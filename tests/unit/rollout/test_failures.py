"""Failures never hang and never lose: an episode whose output cannot be a record (a plugin's non-JSON
`extra`) becomes an error record naming the key; a record sink that fails (a full disk) stops the run
with a message naming the file, and `run()` / `close()` return; an episode cut by its timeout keeps
the turns it finished. Scripted server (fault injection), token-only loops."""

from __future__ import annotations

import asyncio
import errno
import json

import pytest

from agentloop.config import Config, ManagerConfig, load_config
from agentloop.loops.base import AgentLoopBase, TrajectoryBuilder
from agentloop.records import Sample, read_records
from agentloop.rollout.engine import RolloutEngine
from agentloop.server_manager import ServerManager
from agentloop.util.rundir import RecordWriter
from tests.fakes.fake_sglang import FakeSGLang


class _Opaque:
    """Not JSON data."""


class BadExtra(AgentLoopBase):
    """Repeat 1 puts an object in `extra` when building; repeat 2 puts a set in it after building."""

    async def run(self, sample, sampling_params):
        traj = TrajectoryBuilder([1, 2, 3])
        out = await self.server_manager.generate(sample.episode_id, prompt_ids=traj.all_ids,
                                                 sampling_params=sampling_params)
        traj.add_model(out)
        extra = {"solution_str": "x", "state": _Opaque()} if sample.repeat == 1 else {"solution_str": "x"}
        built = traj.build(reward=1.0, extra=extra)
        if sample.repeat == 2:
            built.extra["seen"] = {1, 2}
        return built


class OneCall(AgentLoopBase):
    async def run(self, sample, sampling_params):
        traj = TrajectoryBuilder([1, 2, 3])
        out = await self.server_manager.generate(sample.episode_id, prompt_ids=traj.all_ids,
                                                 sampling_params=sampling_params)
        traj.add_model(out)
        return traj.build(reward=1.0)


class StallsAfterOneTurn(AgentLoopBase):
    """One generate call and an environment token, then waits forever (a tool that never answers)."""

    async def run(self, sample, sampling_params):
        traj = TrajectoryBuilder([1, 2, 3])
        out = await self.server_manager.generate(sample.episode_id, prompt_ids=traj.all_ids,
                                                 sampling_params=sampling_params)
        traj.add_model(out)
        traj.add_env([7])
        await asyncio.Event().wait()
        return traj.build()


def cfg(*over: str) -> Config:
    c = load_config(None, ["server.urls=[\"http://127.0.0.1:1\"]", "sampling.max_new_tokens=4", *over])
    c.manager = ManagerConfig(health_interval_s=60, retry_budget_s=5, max_attempts=2, retry_backoff_s=0.01)
    return c


def samples(n: int) -> list[Sample]:
    return [Sample(index=i, uid=10 + i, data_source="t", messages=[{"role": "user", "content": "x"}])
            for i in range(n)]


class _FullDisk:
    """A file handle that takes `room` lines, then fails as a full disk does."""

    def __init__(self, fh, room: int):
        self.fh, self.room = fh, room

    def write(self, line: str) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= 1
        return self.fh.write(line)

    def flush(self) -> None:
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


@pytest.mark.timeout(60, method="thread")  # a regression hangs asyncio.run itself: end the process
def test_non_json_extra_becomes_an_error_record_naming_the_key(tmp_path):
    async def main():
        fake = await FakeSGLang().start()
        try:
            async with ServerManager([fake.url], cfg().manager) as sm:
                eng = RolloutEngine(cfg(), sm, None, BadExtra, progress=False)
                with RecordWriter(tmp_path / "records.jsonl") as writer:
                    return await eng.run(samples(2), n_samples=3, on_record=writer)
        finally:
            await fake.stop()

    res = asyncio.run(main())
    assert res.stopped is None and len(res.records) == 6 and res.summary["errors"] == 4
    by_repeat = {(r.index, r.repeat): r for r in res.records}
    for i in range(2):
        assert by_repeat[(i, 0)].error is None and by_repeat[(i, 0)].reward == 1.0
        assert "extra['state'] is a _Opaque, not JSON data" in by_repeat[(i, 1)].error
        assert "extra['seen'] is a set, not JSON data" in by_repeat[(i, 2)].error
    on_disk = list(read_records(tmp_path / "records.jsonl"))  # every record was written, and reads back
    assert len(on_disk) == 6


@pytest.mark.timeout(60, method="thread")
def test_a_record_sink_that_fails_stops_the_run_naming_the_file(tmp_path):
    path = tmp_path / "records.jsonl"

    async def main():
        fake = await FakeSGLang().start()
        try:
            async with ServerManager([fake.url], cfg().manager) as sm:
                eng = RolloutEngine(cfg("rollout.max_concurrency=2"), sm, None, OneCall, progress=False)
                with RecordWriter(path) as writer:
                    writer._fh = _FullDisk(writer._fh, room=3)
                    res = await eng.run(samples(6), n_samples=2, on_record=writer)
                # a stream whose sink fails closes too (the train schedules use streams)
                st = eng.stream()
                st.on_episode = _raise_oserror
                for s in samples(3):
                    st.submit(s, 2)
                first = await st.next()
                await st.close()
                return res, first, st.stopped
        finally:
            await fake.stop()

    res, first, stopped = asyncio.run(main())
    assert res.stopped and "the record sink failed" in res.stopped
    assert f"cannot write records to {path}: No space left on device" in res.stopped
    assert len(path.read_text().splitlines()) == 3
    assert res.summary["not_started"] > 0 and len(res.records) >= 4  # kept in memory, counted
    assert first.cancelled is not None and "lost mount" in stopped


async def _raise_oserror(rec) -> None:
    raise OSError(errno.EIO, "lost mount")


@pytest.mark.timeout(60)
def test_an_episode_cut_by_its_timeout_keeps_its_finished_turns():
    async def main():
        fake = await FakeSGLang().start()
        try:
            async with ServerManager([fake.url], cfg().manager) as sm:
                eng = RolloutEngine(cfg("rollout.episode_timeout_s=0.5"), sm, None, StallsAfterOneTurn, progress=False)
                return await eng.run(samples(1), n_samples=2)
        finally:
            await fake.stop()

    res = asyncio.run(main())
    assert len(res.records) == 2
    for r in res.records:
        assert r.error == "EpisodeTimeout: episode exceeded rollout.episode_timeout_s=0.5"
        assert r.finish_reason == "timeout" and r.reward is None
        assert r.prompt_ids == [1, 2, 3] and r.response_mask == [1, 1, 1, 1, 0] and r.num_turns == 1
        json.loads(r.model_dump_json())


class EnvironmentTimesOut(AgentLoopBase):
    """One turn, then its environment's HTTP client times out (aiohttp raises a TimeoutError subclass)."""

    async def run(self, sample, sampling_params):
        traj = TrajectoryBuilder([1, 2, 3])
        traj.add_model(await self.server_manager.generate(sample.episode_id, prompt_ids=traj.all_ids,
                                                          sampling_params=sampling_params))
        await asyncio.wait_for(asyncio.Event().wait(), 0.01)  # the environment's own deadline, not the episode's
        return traj.build()


@pytest.mark.timeout(60)
def test_an_environments_timeout_is_not_the_episodes():
    """Only rollout.episode_timeout_s makes an EpisodeTimeout (the policy's failure); a TimeoutError raised inside
    the loop is the environment's failure: an infra error record, its group left out."""
    from agentloop.errors import failure_kind

    async def main():
        fake = await FakeSGLang().start()
        try:
            async with ServerManager([fake.url], cfg().manager) as sm:
                eng = RolloutEngine(cfg("rollout.episode_timeout_s=30"), sm, None, EnvironmentTimesOut, progress=False)
                return await eng.run(samples(1), n_samples=2)
        finally:
            await fake.stop()

    res = asyncio.run(main())
    assert len(res.records) == 2
    for r in res.records:
        assert r.error.startswith("TimeoutError") and r.finish_reason == "error"
        assert failure_kind(r.error, r.finish_reason) == "infra"


class CleanupHangs(AgentLoopBase):
    """One turn, then waits; cancelled, its clean-up hangs (a tool release or an agent that never returns)."""

    async def run(self, sample, sampling_params):
        traj = TrajectoryBuilder([1, 2, 3])
        traj.add_model(await self.server_manager.generate(sample.episode_id, prompt_ids=traj.all_ids,
                                                          sampling_params=sampling_params))
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.Event().wait()
        return traj.build()


@pytest.mark.timeout(60)
def test_cancelling_groups_whose_clean_up_hangs_meets_its_deadline():
    async def main():
        fake = await FakeSGLang().start()
        try:
            async with ServerManager([fake.url], cfg().manager) as sm:
                eng = RolloutEngine(cfg("rollout.cancel_timeout_s=0.5"), sm, None, CleanupHangs, progress=False)
                stream = eng.stream()
                stream.submit(samples(1)[0], 2)
                await fake.wait_until(lambda f: len(f.completed) >= 2)
                return await asyncio.wait_for(stream.cancel_all("the run ended"), 10), stream
        finally:
            await fake.stop()

    outs, stream = asyncio.run(main())
    assert len(outs) == 1 and "did not stop within rollout.cancel_timeout_s=0.5: abandoned" in outs[0].cancelled
    assert stream.running == 0 and stream.counts["cancelled"] == 1
