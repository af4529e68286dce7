"""The asynchronous schedule's per-step numbers reach metrics.jsonl: the async counters (cancelled,
continued), the groups left out for an infrastructure failure, and the event-loop lag. The real Trainer,
StepLog and mailbox against scripted servers and a scripted learner (it answers each batch at once)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest

from agentloop.config import load_config
from agentloop.loops.base import AgentLoopBase, TrajectoryBuilder
from agentloop.records import Sample
from agentloop.report.steplog import StepLog
from agentloop.rollout.engine import RolloutEngine
from agentloop.server_manager import ServerManager
from agentloop.train.handle.mailbox import LearnerMailbox, read_batch
from agentloop.train.orchestrator.cursor import DataCursor
from agentloop.train.orchestrator.learner_process import FileLearner
from agentloop.train.orchestrator.loop import Trainer
from tests.fakes.fake_sglang import FakeSGLang


class FailsOnce(AgentLoopBase):
    """One call; the first dispatch of prompt 1 fails as a dead server would (an infrastructure failure)."""

    async def run(self, sample, sampling_params):
        if sample.uid == 1 and sample.attempt == 0 and sample.repeat == 0:
            raise ConnectionResetError("the server went away")
        traj = TrajectoryBuilder([1, 2, 3])
        out = await self.server_manager.generate(sample.episode_id, prompt_ids=traj.all_ids,
                                                 sampling_params=sampling_params)
        traj.add_model(out)
        return traj.build(reward=float(sample.repeat), finish_reason=out.finish_reason)


def scripted_learner(run_dir: Path, steps: int, done: threading.Event) -> None:
    """The learner's side of the mailbox: each batch is 'trained' at once and weights/step-N written."""
    box = LearnerMailbox(run_dir, heartbeat_s=1.0)
    box.start_heartbeat()
    box.update_info(status="ready", next_step=1)
    step = 1
    while step <= steps and not done.is_set():
        if box.batch_ready(step):  # the mailbox protocol polls, as the real learner does
            batch, _ = box.read_batch(step)
            w = box.paths.weights(step)
            w.mkdir(parents=True, exist_ok=True)
            box.write_done(step, w, {"loss": 0.0, "episodes": float(batch.num_episodes)})
            step += 1
        else:
            time.sleep(0.01)
    box.close()


@pytest.mark.timeout(120)
def test_async_step_rows_hold_the_counters_and_the_loop_lag(tmp_path):
    steps = 3
    cfg = load_config(None, ["server.urls=[\"http://127.0.0.1:1\"]", "train.schedule=async",
                             "train.max_staleness=1", f"train.steps={steps}", "train.prompts_per_step=2",
                             "rollout.n_samples=2", "train.val_every=0", "train.tensorboard=false",
                             "sampling.max_new_tokens=4", "manager.health_interval_s=60"])
    samples = [Sample(index=i, data_source="t", messages=[{"role": "user", "content": "x"}]) for i in range(8)]
    done = threading.Event()
    learner = threading.Thread(target=scripted_learner, args=(tmp_path, steps, done), daemon=True)
    learner.start()

    async def main():
        fake = await FakeSGLang().start()
        log = StepLog(cfg, tmp_path)
        try:
            async with ServerManager([fake.url], cfg.manager, initial_version=0) as sm:
                sm.expect_version(0)
                engine = RolloutEngine(cfg, sm, None, FailsOnce, progress=False)
                trainer = Trainer(cfg, tmp_path, sm, engine, FileLearner(tmp_path), log, DataCursor(samples, 0), [])
                await trainer.run_async_schedule(1)
                return trainer.final
        finally:
            log.close()
            await fake.stop()

    try:
        final = asyncio.run(asyncio.wait_for(main(), 100))
    finally:
        done.set()
        learner.join(10)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0]
    for r in rows:
        for k in ("async/groups_cancelled", "async/episodes_cancelled", "async/episodes_continued",
                  "train/groups_dropped_infra", "train/episodes_policy_failed",
                  "loop/lag_p50_ms", "loop/lag_p99_ms", "loop/lag_max_ms"):
            assert k in r, k
    # the prompt whose first dispatch failed was given out again and trained; its failure is in a row
    assert sum(r["train/groups_dropped_infra"] for r in rows) == 1 == final["async"]["groups_dropped_infra"]
    assert sum(r["async/groups_cancelled"] for r in rows) == final["async"].get("groups_cancelled", 0)
    trained = [u for step in range(1, steps + 1) for u in read_batch(tmp_path, step).uid.tolist()]
    # the retried group was trained whole (two episodes), never the partial one (its one episode besides)
    assert trained.count(1) == 2 and all(trained.count(u) == 2 for u in trained)
