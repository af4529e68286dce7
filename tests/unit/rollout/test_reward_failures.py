"""Rewards run off the event loop under `reward.timeout_s`: a reward that sleeps, raises or loops scores
`reward.failure_score`, counted, while the other episodes go on; a looping worker process is killed.
Scripted server, a token-only loop whose solution text is the ground truth (it picks the behaviour)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from agentloop.config import Config, ManagerConfig, load_config
from agentloop.loops.base import AgentLoopBase, TrajectoryBuilder
from agentloop.records import Sample
from agentloop.rewards.pool import RewardPool, reward_ref
from agentloop.rewards.registry import get_reward, load_custom_reward
from agentloop.rollout.engine import RolloutEngine
from agentloop.rollout.scorer import Scorer
from agentloop.server_manager import ServerManager
from tests.fakes.fake_sglang import FakeSGLang

REWARD = '''
import os, time
from pathlib import Path

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "sleep":
        time.sleep(60)
    if solution_str == "loop":
        Path(extra_info["pid_file"]).write_text(str(os.getpid()))
        while True:
            pass
    if solution_str == "raise":
        raise ValueError("cannot parse the answer")
    if solution_str == "none":
        return None
    return 1.0
'''


class SaysGroundTruth(AgentLoopBase):
    async def run(self, sample, sampling_params):
        traj = TrajectoryBuilder([1, 2, 3])
        out = await self.server_manager.generate(sample.episode_id, prompt_ids=traj.all_ids,
                                                 sampling_params=sampling_params)
        traj.add_model(out)
        return traj.build(extra={"solution_str": sample.ground_truth})


def cfg(*over: str) -> Config:
    c = load_config(None, ["server.urls=[\"http://127.0.0.1:1\"]", "sampling.max_new_tokens=4", *over])
    c.manager = ManagerConfig(health_interval_s=60, retry_budget_s=5, max_attempts=2, retry_backoff_s=0.01)
    return c


def run_episodes(c: Config, truths: list[str], pid_file: Path) -> tuple:
    samples = [Sample(index=i, uid=i, data_source="t", messages=[{"role": "user", "content": "x"}],
                      ground_truth=g, extra_info={"pid_file": str(pid_file)}) for i, g in enumerate(truths)]

    async def main():
        fake = await FakeSGLang().start()
        scorer = Scorer(c)
        try:
            async with ServerManager([fake.url], c.manager) as sm:
                eng = RolloutEngine(c, sm, None, SaysGroundTruth, scorer=scorer, progress=False)
                res = await eng.run(samples, n_samples=1)
                return res, scorer.pool.killed
        finally:
            await scorer.close()
            await fake.stop()

    return asyncio.run(main())


@pytest.mark.timeout(90)
def test_slow_raising_and_looping_rewards_score_the_minimum_and_the_rest_goes_on(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(REWARD)
    pid_file = tmp_path / "looping.pid"
    c = cfg(f"reward.custom={f}:compute_score", "reward.timeout_s=3", "reward.workers=3",
            "reward.failure_score=-1")
    truths = ["sleep", "ok", "raise", "loop", "none", "ok", "ok"]
    res, killed = run_episodes(c, truths, pid_file)
    by = {r.index: r for r in res.records}
    assert len(by) == 7 and res.summary["errors"] == 0  # a reward failure is a score, not an error record
    for i in (1, 5, 6):
        assert by[i].reward == 1.0 and "reward_errors" not in by[i].metrics
    for i in (0, 3):  # the sleeping and the looping reward: past the deadline, killed
        assert by[i].reward == -1.0 and by[i].metrics["reward_timeouts"] == 1.0
        assert "ran past reward.timeout_s=3s; its worker was killed" in by[i].reward_info["reward_error"]
    assert by[2].reward == -1.0 and by[2].metrics["reward_errors"] == 1.0
    assert "raised ValueError: cannot parse the answer" in by[2].reward_info["reward_error"]
    assert by[4].reward == -1.0 and by[4].metrics["reward_errors"] == 1.0  # None is not a score
    assert res.summary["reward_timeouts"] == 2 and res.summary["reward_errors"] == 2
    # the others finished while the slow ones were still being scored, and the event loop never froze
    order = [r.index for r in res.records]
    assert {order[-1], order[-2]} == {0, 3}
    # inline, the sleeping reward alone froze it 60 s: a third of that tells the two apart on any machine, however
    # loaded (a lag bound of a few seconds would be a verdict on the box's speed)
    assert res.summary["loop/lag_max_ms"] < 20_000
    assert killed == 2
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # the looping worker is gone (killed and reaped)
        os.kill(pid, 0)


@pytest.mark.timeout(60)
def test_a_reward_no_process_can_import_runs_on_a_thread_under_the_deadline():
    def closure(data_source, solution_str, ground_truth, extra_info=None):
        raise KeyError("target")

    notes: list[str] = []

    async def main():
        pool = RewardPool(workers=2, timeout_s=5, on_note=notes.append)
        try:
            with pytest.raises(Exception, match="raised KeyError: 'target'"):
                await pool.score(closure, {"data_source": "d", "solution_str": "s", "ground_truth": 1,
                                           "extra_info": None})
            return pool.gauges()
        finally:
            await pool.close()

    gauges = asyncio.run(main())
    assert gauges["reward/workers"] == 0  # no process was started for it
    assert len(notes) == 1 and "runs on a thread" in notes[0]


def test_rewards_are_sent_to_workers_by_reference(tmp_path):
    f = tmp_path / "r.py"
    f.write_text(REWARD)
    assert reward_ref(get_reward("openai/gsm8k")) == ("agentloop.rewards.verl_gsm8k", None, "compute_score")
    mod, path, qual = reward_ref(load_custom_reward(f"{f}:compute_score"))
    assert path == str(f) and qual == "compute_score"  # a file loaded by path travels as its path
    assert reward_ref(lambda *a: 0) is None


@pytest.mark.timeout(60)
def test_an_async_reward_that_hangs_times_out():
    c = cfg("reward.timeout_s=0.5")
    scorer = Scorer(c)

    async def hangs(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.Event().wait()

    scorer.custom = hangs
    s = Sample(index=0, data_source="t", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(Exception, match="ran past reward.timeout_s=0.5s"):
        asyncio.run(scorer.score(s, "text"))


@pytest.mark.timeout(60)
def test_a_reward_a_worker_cannot_import_after_all_is_scored_on_a_thread(tmp_path):
    """The custom reward file is gone by the time a worker looks for it: the call is not failed (that
    would score every episode the minimum), it runs on a thread, said once."""
    f = tmp_path / "gone.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n")
    fn = load_custom_reward(f"{f}:compute_score")
    f.unlink()
    notes: list[str] = []

    async def main():
        pool = RewardPool(workers=1, timeout_s=20, on_note=notes.append)
        try:
            args = {"data_source": "d", "solution_str": "s", "ground_truth": 1, "extra_info": None}
            return [(await pool.score(fn, args)).score for _ in range(2)]
        finally:
            await pool.close()

    assert asyncio.run(main()) == [0.5, 0.5]
    assert len(notes) == 1 and "cannot import compute_score" in notes[0] and "runs on a thread" in notes[0]
