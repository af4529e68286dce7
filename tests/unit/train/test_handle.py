"""The learner handle's contract (agentloop.train.handle), the same tests for every carrier: the orchestrator's
side (LearnerHandle) against a scripted learner that speaks only the learner's side (LearnerInbox). Files: the
mailbox (FileLearner + LearnerMailbox); Ray: tests/integration/test_ray_cluster.py runs these against RayLearner.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agentloop.train.batch_plan import BatchLayout, prepare_batch
from agentloop.train.config import AlgoConfig
from agentloop.train.handle import (
    LearnerFailedError,
    LearnerHandle,
    LearnerInbox,
    LearnerTimeout,
    SyncRequest,
    UpdateResult,
)
from agentloop.train.learner_process import FileLearner
from agentloop.train.mailbox import LearnerMailbox
from agentloop.train.weight_sync import PushOrder
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
            _, batch, meta = msg
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
    """The file mailbox: FileLearner on the orchestrator's side, LearnerMailbox on the learner's."""

    def __init__(self, tmp_path: Path):
        self.run_dir = tmp_path

    def pair(self) -> tuple[LearnerHandle, LearnerInbox, Path]:
        return (FileLearner(self.run_dir, poll_s=0.01), LearnerMailbox(self.run_dir, heartbeat_s=0.05),
                self.run_dir / "weights")


@pytest.fixture(params=["files"])
def carrier(request, tmp_path):
    return FileCarrier(tmp_path)


def run_with(carrier, body, **learner_kw):
    handle, inbox, weights = carrier.pair()
    th = threading.Thread(target=scripted_learner, args=(inbox, weights), kwargs=learner_kw, daemon=True)

    async def main():
        await handle.start()
        th.start()
        try:
            return await asyncio.wait_for(body(handle), 30)
        finally:
            await handle.stop()
            th.join(10)
            await handle.close()

    return asyncio.run(main())


def batch(step: int):
    return prepare_batch(records(step), AlgoConfig(), LAYOUT, step)


def test_steps_go_in_and_updates_come_back_with_their_weights(carrier):
    seen: list[Any] = []

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
        assert h.finished_metrics(2) == {"episodes": 12.0} and h.finished_metrics(3) is None
        assert (await h.weights(2)).path == out[1].weights_dir and await h.weights(7) is None
        caught_up = await h.wait_caught_up(10)
        assert (caught_up.next_step, caught_up.data_position) == (3, {"next": 2})
        await h.stop(final=True)
        return out, await h.wait_final(10)

    (u1, u2), final = run_with(carrier, body, seen=seen)
    assert u1.weights_dir.endswith("step-000001") and u2.metrics == {"episodes": 12.0}
    assert seen == [(1, 12, {"next": 1}), (2, 12, {"next": 2})]
    assert final.step == 2 and final.weights_dir.endswith("step-000002") and final.checkpoint == "/ck/last"


def test_a_pushing_learner_asks_for_paused_servers_and_gets_the_order(carrier):
    seen: list[Any] = []

    async def body(h: LearnerHandle):
        await h.wait_ready(10)
        await h.submit(1, batch(1))
        ev = await h.wait_update_or_sync(1, 10)
        assert isinstance(ev, SyncRequest) and ev.step == 1 and ev.method == "tensor"
        await h.allow_sync(1, PushOrder(1, ("http://s0", "http://s1"), "retract"))
        return await h.wait_update(1, 10)

    upd = run_with(carrier, body, push=True, seen=seen)
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

    err = run_with(carrier, body, fail_at=1)
    assert err.step == 1 and "ValueError: boom in the step" in err.traceback
