"""The learner handle's contract (agentloop.train.handle.protocol), the same tests for every carrier: the orchestrator's
side (LearnerHandle) against a scripted learner that speaks only the learner's side (LearnerInbox). Files: the
mailbox (FileLearner + LearnerMailbox, the learner in a thread); Ray: RayLearner with a scripted rank actor
(RayInbox) on a local Ray instance (marker `ray`; the real learner on Ray: tests/integration/test_ray_cluster.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agentloop.train.batch.format import BatchLayout, RankBatch
from agentloop.train.batch.prepare import prepare_batch
from agentloop.train.config import AlgoConfig
from agentloop.train.handle.mailbox import LearnerMailbox
from agentloop.train.handle.protocol import (
    LearnerFailedError,
    LearnerHandle,
    LearnerInbox,
    LearnerTimeout,
    PushOrder,
    SyncRequest,
    UpdateResult,
)
from agentloop.train.orchestrator.learner_process import FileLearner
from tests.unit.train.test_batch_plan import records

LAYOUT = BatchLayout(world=1, budget=64)


def scripted_learner(inbox: LearnerInbox, weights_root: Path, *, push: bool = False, fail_at: int | None = None,
                     seen: list[Any] | None = None) -> None:
    """A learner in a few lines, through the inbox only: 'trains' each batch at once, saves or pushes, stops."""
    inbox.start()
    inbox.report(status="ready", next_step=1, resumed_step=None, data_position=None, world_size=1,
                 layout=LAYOUT.to_json())
    step = 1
    try:
        while True:
            msg = inbox.poll(step)
            if msg is None:
                time.sleep(0.01)
                continue
            if msg[0] == "stop":
                if msg[1]:
                    inbox.final(step - 1, str(weights_root / f"step-{step - 1:06d}"), "/ck/last")
                return
            _, source, meta = msg
            batch = RankBatch.read(source, 0)  # the batch's file or bytes: each rank reads its own share
            if seen is not None:
                seen.append((batch.step, batch.num_episodes, meta.get("data_position")))
            if step == fail_at:
                try:
                    raise ValueError("boom in the step")
                except ValueError as e:
                    inbox.failed(step, e)
                    inbox.report(status="failed", error="ValueError: boom in the step")
                return
            if push:
                order = inbox.ask_push(step, "tensor", 10)
                if seen is not None:
                    seen.append(order)
                inbox.done(step, None, {"episodes": float(batch.num_episodes)}, pushed=True)
            else:
                w = weights_root / f"step-{step:06d}"
                w.mkdir(parents=True, exist_ok=True)
                inbox.done(step, str(w), {"episodes": float(batch.num_episodes)}, pushed=False)
            inbox.report(status="ready", next_step=step + 1, last_step=step, data_position=meta.get("data_position"))
            step += 1
    finally:
        inbox.close()


class FileCarrier:
    """The file mailbox: FileLearner on the orchestrator's side, LearnerMailbox on the learner's (in a thread)."""

    def __init__(self, tmp_path: Path):
        self.run_dir = tmp_path

    def run(self, body, **learner_kw) -> tuple[Any, list[Any]]:
        handle, inbox = FileLearner(self.run_dir, poll_s=0.01), LearnerMailbox(self.run_dir, heartbeat_s=0.05)
        seen: list[Any] = []
        th = threading.Thread(target=scripted_learner, args=(inbox, self.run_dir / "weights"),
                              kwargs={**learner_kw, "seen": seen}, daemon=True)

        async def main():
            await handle.start()
            th.start()
            try:
                return await asyncio.wait_for(body(handle), 30)
            finally:
                await handle.stop()
                th.join(10)
                await handle.close()

        return asyncio.run(main()), seen


def scripted_rank():
    """A rank actor class running the scripted learner on its RayInbox, where LearnerRank runs the real loop (a
    LearnerRank otherwise: the orchestrator's calls are answered as in a run)."""
    from agentloop.cluster.ray_learner import LearnerRank

    class ScriptedRank(LearnerRank):
        def __init__(self, run: str, rank: int, hold: bool = False, **learner_kw: Any):
            super().__init__(run, rank)
            self.kw, self.seen_ = learner_kw, []
            self.hold = threading.Semaphore(0) if hold else None
            """`hold`: rank 0 answers a finished step's metrics and its log's tail only once `release` was called
            (after the question), as a learner whose node is slow to answer."""

        def finished(self, learner_dir: str, step: int) -> dict[str, float] | None:
            if self.hold is None:
                return super().finished(learner_dir, step)
            return {"held": float(step)} if self.hold.acquire(timeout=60) else None

        def log_tail(self, n: int = 30) -> str:
            if self.hold is None:
                return super().log_tail(n)
            return "the held tail" if self.hold.acquire(timeout=60) else ""

        def release(self) -> None:
            assert self.hold is not None
            self.hold.release()

        def address(self) -> tuple[str, int]:
            return "127.0.0.1", 0

        def run_loop(self, world, master, learner_dir, model_path, config_yaml, resume, max_len) -> int:
            scripted_learner(self.inbox, Path(learner_dir) / "weights", **self.kw, seen=self.seen_)
            return 0

        def seen(self) -> list[Any]:
            return self.seen_

    return ScriptedRank


class RayCarrier:
    """RayLearner with scripted rank actors on a local Ray instance."""

    def __init__(self, tmp_path: Path):
        self.run_dir = tmp_path

    def run(self, body, **learner_kw) -> tuple[Any, list[Any]]:
        from agentloop.cluster.ray_learner import RayLearner
        from agentloop.config import dump_config, load_config

        cfg = load_config(None, ["cluster.backend=ray"])
        (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        handle = RayLearner(cfg, self.run_dir, Path("/unused"), run=f"t-{self.run_dir.name}", gpus=0, poll_s=0.02,
                            rank_cls=scripted_rank(), rank_kwargs=learner_kw)

        async def main():
            await handle.start()
            try:
                out = await asyncio.wait_for(body(handle), 60)
                return out, await handle.ranks[0].seen.remote()
            finally:
                await handle.close()

        return asyncio.run(main())


@pytest.fixture(scope="module")
def local_ray(ray_nodes):
    """The session's local Ray cluster (tests/conftest.py), connected to for this module's tests."""
    import ray

    ray.init(address=ray_nodes.address, log_to_driver=False, namespace="agentloop-tests")
    yield
    ray.shutdown()


@pytest.fixture(params=["files", pytest.param("ray", marks=pytest.mark.ray)])
def carrier(request, tmp_path):
    if request.param == "ray":
        request.getfixturevalue("local_ray")
        return RayCarrier(tmp_path)
    return FileCarrier(tmp_path)


def run_with(carrier, body, **learner_kw):
    return carrier.run(body, **learner_kw)


def batch(step: int):
    return prepare_batch(records(step), AlgoConfig(), LAYOUT, step)


def test_steps_go_in_and_updates_come_back_with_their_weights(carrier):
    async def body(h: LearnerHandle):
        info = await h.wait_ready(10)
        assert (info.next_step, info.resumed_step, info.world_size) == (1, None, 1)
        assert BatchLayout.from_json(info.layout) == LAYOUT
        out = []
        for step in (1, 2):
            assert not h.submitted(step)
            await h.submit(step, batch(step), data_position={"next": step})
            assert h.submitted(step)
            ev = await h.wait_update_or_sync(step, 10)
            assert isinstance(ev, UpdateResult) and not ev.pushed
            out.append(ev)
        assert await h.finished_metrics(2) == {"episodes": 12.0} and await h.finished_metrics(3) is None
        assert (await h.weights(2)).path == out[1].weights_dir and await h.weights(7) is None
        caught_up = await h.wait_caught_up(10)
        assert (caught_up.next_step, caught_up.data_position) == (3, {"next": 2})
        await h.stop(final=True)
        return out, await h.wait_final(10)

    ((u1, u2), final), seen = run_with(carrier, body)
    assert u1.weights_dir.endswith("step-000001") and u2.metrics == {"episodes": 12.0}
    assert seen == [(1, 12, {"next": 1}), (2, 12, {"next": 2})]
    assert final.step == 2 and final.weights_dir.endswith("step-000002") and final.checkpoint == "/ck/last"


def test_a_pushing_learner_asks_for_paused_servers_and_gets_the_order(carrier):
    async def body(h: LearnerHandle):
        await h.wait_ready(10)
        await h.submit(1, batch(1))
        ev = await h.wait_update_or_sync(1, 10)
        assert isinstance(ev, SyncRequest) and ev.step == 1 and ev.method == "tensor"
        await h.allow_sync(1, PushOrder(1, ("http://s0", "http://s1"), "retract"))
        return await h.wait_update(1, 10)

    upd, seen = run_with(carrier, body, push=True)
    assert upd.pushed and upd.weights is None
    assert seen[1] == PushOrder(1, ("http://s0", "http://s1"), "retract")


def test_a_failed_step_and_a_silent_learner_are_errors_not_hangs(carrier):
    async def body(h: LearnerHandle):
        await h.wait_ready(10)
        with pytest.raises(LearnerTimeout):
            await h.wait_update(1, 0.2)  # nothing submitted: nothing comes
        await h.submit(1, batch(1))
        with pytest.raises(LearnerFailedError, match="boom in the step") as ei:
            await h.wait_update_or_sync(1, 10)
        return ei.value

    err, _ = run_with(carrier, body, fail_at=1)
    assert err.step == 1 and "ValueError: boom in the step" in err.traceback


@pytest.mark.ray
def test_the_ray_handle_waits_for_rank_0_on_the_event_loop(tmp_path, local_ray):
    """The handle's questions to rank 0 outside its waits (a finished step's metrics, the log's tail) are awaited,
    not `ray.get`: while rank 0 holds its answer until the orchestrator's next call releases it, that call gets
    out and the answer comes back. A blocking get would hold the event loop until its bound (the release never
    sent) and answer "nothing known"."""

    async def body(h: LearnerHandle):
        await h.wait_ready(10)
        h.query_timeout_s = 20  # the bound a blocking get would wait out
        answers = []
        for ask in (lambda: h.finished_metrics(5), h.failure_context):
            task = asyncio.create_task(ask())
            await asyncio.sleep(0)  # the task asks rank 0 (and, if it blocked, would hold the loop here)
            await h.ranks[0].release.remote()
            answers.append(await task)
        return answers

    (metrics, context), _ = RayCarrier(tmp_path).run(body, hold=True)
    assert metrics == {"held": 5.0}
    assert context.endswith("the held tail")
