"""Pacing episode steps on the event loop (agentloop.util.pacing): the rule as a plain state machine, the gate
letting every step through exactly once in arrival order (cancelled waiters included), a burst spread over
iterations so timers run between its steps, and the engine under a tight slice: every episode exactly once."""

from __future__ import annotations

import asyncio
import time

from agentloop.config import load_config
from agentloop.loops.base import AgentLoopBase, TrajectoryBuilder
from agentloop.records import Sample
from agentloop.rollout.engine import RolloutEngine
from agentloop.server_manager import ServerManager
from agentloop.util.pacing import SliceBudget, StepGate, step_gate
from tests.fakes.fake_sglang import FakeSGLang


def test_slice_budget_rule():
    b = SliceBudget(slice_s=0.010, min_wake=2, max_wake=100)
    assert b.admit(0.000, queued=False) and b.admit(0.005, queued=False)
    assert not b.admit(0.010, queued=False)  # slice spent
    assert not b.admit(0.001, queued=True)  # earlier arrivals wait: they go first
    assert b.deferred == 2
    b.new_iteration()
    assert b.fit == 2 and b.to_wake(50) == 3 and b.to_wake(1) == 1
    assert b.admit_woken(1.0) and b.t0 == 1.0
    b.new_iteration()
    b.new_iteration()  # an iteration in which nothing passed keeps the last fit
    assert b.fit == 2


def _busy(seconds: float) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pass


def test_gate_passes_every_step_once_in_arrival_order_and_spreads_a_burst():
    async def main():
        gate = StepGate(slice_s=0.003)
        passed: list[int] = []
        seen_by_timer: list[int] = []

        async def step(i: int) -> None:
            await gate.enter()
            passed.append(i)
            _busy(0.001)  # a step of CPU work (template, parse, ...)

        tasks = [asyncio.create_task(step(i)) for i in range(300)]
        # runs after the first iteration of the burst: without the gate every step would have run before it
        asyncio.get_running_loop().call_soon(lambda: seen_by_timer.append(len(passed)))
        await asyncio.gather(*tasks)
        return passed, seen_by_timer, gate.budget.deferred

    passed, seen, deferred = asyncio.run(asyncio.wait_for(main(), 60))
    assert passed == list(range(300))  # exactly once each, first come first served
    assert seen and seen[0] < 20, seen  # the burst ran over many iterations: the loop saw other work between
    assert deferred > 250


def test_gate_cancelled_waiters_never_pass_and_never_hold_up_the_rest():
    async def main():
        gate = StepGate(slice_s=0.002)
        passed: list[int] = []

        async def step(i: int) -> None:
            await gate.enter()
            passed.append(i)
            _busy(0.001)

        tasks = [asyncio.create_task(step(i)) for i in range(200)]
        await asyncio.sleep(0)  # every task has entered; most wait
        cancelled = set(range(50, 200, 3))
        for i in cancelled:
            tasks[i].cancel()
        res = await asyncio.gather(*tasks, return_exceptions=True)
        return passed, cancelled, res, gate.waiting

    passed, cancelled, res, waiting = asyncio.run(asyncio.wait_for(main(), 60))
    assert waiting == 0
    assert passed == [i for i in range(200) if i not in cancelled]
    assert all(isinstance(res[i], asyncio.CancelledError) for i in cancelled)


def test_step_gate_is_one_per_loop():
    async def get():
        return step_gate()

    async def both():
        return step_gate() is step_gate()

    assert asyncio.run(both())
    assert asyncio.run(get()) is not asyncio.run(get())


class TwoCalls(AgentLoopBase):
    """Two server calls per episode, an environment token between: both continuations are paced."""

    async def run(self, sample, sampling_params):
        traj = TrajectoryBuilder([1, 2, sample.index % 50 + 3])
        for _ in range(2):
            out = await self.server_manager.generate(sample.episode_id, prompt_ids=traj.context(),
                                                     sampling_params=sampling_params)
            traj.add_model(out)
            await self.pace()
            traj.add_env([7])
        return traj.build(reward=1.0, finish_reason=out.finish_reason)


def test_engine_under_a_tight_slice_gives_every_episode_exactly_once():
    n, group = 400, 3

    async def main():
        fake = await FakeSGLang(token_delay_s=0.0).start()
        try:
            cfg = load_config(None, [f'server.urls=["{fake.url}"]', "sampling.max_new_tokens=4",
                                     f"rollout.max_concurrency={n * group}", "rollout.step_slice_ms=0.05",
                                     "manager.max_inflight_per_server=100000"])
            async with ServerManager([fake.url], cfg.manager) as sm:
                eng = RolloutEngine(cfg, sm, None, TwoCalls, progress=False)
                samples = [Sample(index=i, uid=i, data_source="t", messages=[{"role": "user", "content": "x"}])
                           for i in range(n)]
                res = await eng.run(samples, n_samples=group)
                return res, eng.gate.budget.deferred
        finally:
            await fake.stop()

    res, deferred = asyncio.run(asyncio.wait_for(main(), 240))
    ids = [r.episode_id for r in res.records]
    assert sorted(ids) == sorted(f"{i}-{k}" for i in range(n) for k in range(group))  # each exactly once
    assert all(r.error is None and r.num_turns == 2 and len(r.response_ids) == 10 for r in res.records)
    assert deferred > 0  # the slice was tight enough that pacing deferred steps: it is what was tested
