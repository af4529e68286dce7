"""Episodes journaled by the engine and continued from the journal, against the scripted fake server (its tokens are
a function of the input ids and the seed, so an uninterrupted run is the reference a resumed one must equal).

A "kill" here is the run's groups cancelled mid-way (their calls held by the server) and the journal closed: what a
SIGKILL leaves once the writer thread has written what it was given (the tests of a real kill are in
tests/integration/test_journal_real.py and benchmarks/resume_bench.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from agentloop.config import Config, ManagerConfig, load_config
from agentloop.journal import Journal, journal_header
from agentloop.journal.reader import read_journal
from agentloop.loops.base import AgentLoopBase, TrajectoryBuilder
from agentloop.records import Sample
from agentloop.rollout.engine import RolloutEngine
from agentloop.server_manager import ServerManager
from tests.fakes.fake_sglang import FakeSGLang

TURNS = 3
CALLS: list[str] = []
"""Every tool call that really ran (not replayed)."""
GATE: dict[str, asyncio.Event] = {}
WAITERS: list[tuple[Any, asyncio.Event]] = []
"""(predicate on CALLS, event) pairs: `ran` sets an event once its predicate holds."""


def ran(call: str) -> None:
    CALLS.append(call)
    for pred, event in WAITERS:
        if pred(CALLS):
            event.set()


async def calls_until(pred) -> None:
    """Return once `pred(CALLS)` holds: checked now and after every tool call that runs."""
    if pred(CALLS):
        return
    entry = (pred, asyncio.Event())
    WAITERS.append(entry)
    try:
        await entry[1].wait()
    finally:
        WAITERS.remove(entry)


class Calc:
    name = "calc"
    idempotent = True
    stateful = False


class Mailer:
    """A tool with an effect outside: running it twice would send twice."""

    name = "mailer"
    idempotent = False
    stateful = False


class Turns(AgentLoopBase):
    """TURNS x (generate, then a tool call whose result becomes environment tokens)."""

    resumable = True
    tool: Any = Calc

    async def run(self, sample, sampling_params):
        traj = TrajectoryBuilder([1, 2, sample.index % 50 + 3])
        for turn in range(TURNS):
            out = await self.server_manager.generate(sample.episode_id, prompt_ids=traj.context(),
                                                     sampling_params=self.turn_params(sampling_params, turn))
            traj.add_model(out)
            args = {"x": out.token_ids[0], "turn": turn}

            async def call(args=args) -> dict:
                ran(f"{sample.episode_id}:{args['turn']}")
                gate = GATE.get(sample.episode_id)
                if gate is not None and args["turn"] == 1:
                    await gate.wait()
                return {"value": args["x"] % 97}

            res = await self.tool_call(self.tool, args, call)
            traj.add_env([5, 6, res["value"]])
        return traj.build(reward=1.0, finish_reason="stop")


class MailTurns(Turns):
    tool = Mailer


class NotResumable(Turns):
    resumable = False


SHIFT = {"n": 0}


class Drifting(Turns):
    """Claims to be resumable but its prompt depends on state outside its effects."""

    async def run(self, sample, sampling_params):
        traj = TrajectoryBuilder([1, 2, 3 + SHIFT["n"]])
        for turn in range(2):
            out = await self.generate(sample.episode_id, traj.context(), self.turn_params(sampling_params, turn))
            traj.add_model(out)
        return traj.build(reward=1.0)


def cfg(*over: str) -> Config:
    c = load_config(None, ['server.urls=["http://127.0.0.1:1"]', "sampling.max_new_tokens=4",
                           "journal.write_interval_ms=0", *over])
    c.manager = ManagerConfig(health_interval_s=60, retry_budget_s=5, all_down_grace_s=0.2, max_attempts=1,
                              eject_after_failures=1, retry_backoff_s=0.01)
    return c


def samples(n: int) -> list[Sample]:
    return [Sample(index=i, uid=20 + i, data_source="t", messages=[{"role": "user", "content": "x"}])
            for i in range(n)]


def tokens(outs) -> list[tuple]:
    return sorted((r.episode_id, r.prompt_ids, r.response_ids, r.response_mask, r.response_logprobs, r.token_versions,
                   r.error) for o in outs for r in o.records)


async def run_groups(c: Config, fake: FakeSGLang | list[FakeSGLang], loop_cls, groups: list[Sample], n: int,
                     journal: Journal | None, *, stop_after: int | None = None, tool_calls: int = 0):
    """Every group to the end, or (`stop_after` completed calls, then `tool_calls` tool calls run since CALLS was
    last cleared) cancelled mid-way with calls held: the kill."""
    fakes = fake if isinstance(fake, list) else [fake]
    async with ServerManager([f.url for f in fakes], c.manager, initial_version=2) as sm:
        eng = RolloutEngine(c, sm, None, loop_cls, progress=False)
        st = eng.stream(journal=journal)
        for s in groups:
            st.submit(journal.resumed_sample(s) if journal is not None else s, n)
        if stop_after is None:
            return [await st.next() for _ in groups]
        await fakes[0].wait_until(lambda f: len(f.completed) >= stop_after and f.inflight > 0)
        # the answered calls' tool calls have run, and so are journaled: a tool call's result is put in the
        # journal before its loop's next await
        await calls_until(lambda calls: len(calls) >= tool_calls)
        await st.cancel_all("killed")
        return []


def open_journal(c: Config, d: Path) -> Journal:
    return Journal.open(d, c.journal, journal_header(c, "m", "fp"))


def test_a_killed_episode_goes_on_from_its_last_journaled_token_without_calling_again(tmp_path):
    """Kill after 5 of 12 calls; resume on a fresh server: the records equal an uninterrupted run's token for token,
    the server is asked only for the 7 calls never answered, the journaled tokens are reused (counted), and no
    journaled tool call runs again."""
    c = cfg()
    CALLS.clear()

    async def main():
        ref_fake, f1, f2 = await FakeSGLang().start(), await FakeSGLang(hold_after=5).start(), \
            await FakeSGLang().start()
        try:
            ref = await run_groups(c, ref_fake, Turns, samples(2), 2, None)
            CALLS.clear()
            j = open_journal(c, tmp_path / "j")
            await run_groups(c, f1, Turns, samples(2), 2, j, stop_after=5, tool_calls=5)  # one after each call
            j.close()
            ran_before = list(CALLS)
            j = open_journal(c, tmp_path / "j")
            plan = j.plan_resume(handed_out=lambda u: True, floor_version=None)
            CALLS.clear()
            outs = await run_groups(c, f2, Turns, samples(2), 2, j)
            j.close()
            return ref, outs, plan, dict(j.counts), len(f2.requests), ran_before, list(CALLS)
        finally:
            for f in (ref_fake, f1, f2):
                await f.stop()

    ref, outs, plan, counts, asked, ran_before, ran_after = asyncio.run(asyncio.wait_for(main(), 60))
    assert tokens(outs) == tokens(ref) and all(o.cancelled is None for o in outs)
    assert asked == 4 * TURNS - 5  # only the calls the kill cut or never made
    assert counts["calls_reused"] == 5 and counts["tokens_reused"] == 5 * 4 == plan.tokens
    assert counts["episodes_resumed"] == plan.episodes >= 2
    assert counts["effects_reused"] == len(ran_before) and not set(ran_after) & set(ran_before)
    assert counts["continuations_exact"] == counts["episodes_resumed"]  # the next prompt is the journaled tokens


def test_finished_episodes_are_taken_from_the_journal_as_they_were(tmp_path):
    c = cfg()

    async def main():
        f1, f2 = await FakeSGLang().start(), await FakeSGLang().start()
        try:
            j = open_journal(c, tmp_path / "j")
            first = await run_groups(c, f1, Turns, samples(2), 2, j)
            j.close()
            j = open_journal(c, tmp_path / "j")
            plan = j.plan_resume(handed_out=lambda u: True, floor_version=None)
            again = await run_groups(c, f2, Turns, samples(2), 2, j)
            j.close()
            return first, again, plan, dict(j.counts), len(f2.requests)
        finally:
            await f1.stop()
            await f2.stop()

    first, again, plan, counts, asked = asyncio.run(asyncio.wait_for(main(), 60))
    assert asked == 0 and plan.finished_episodes == 4 and counts["episodes_reused_finished"] == 4
    assert counts["calls_reused"] == 4 * TURNS and counts.get("episodes_resumed", 0) == 0  # light: replayed whole
    assert [[r.model_dump() for r in o.records] for o in first] == [[r.model_dump() for r in o.records]
                                                                     for o in again]


def _killed_in_a_tool(c: Config, d: Path, loop_cls) -> None:
    """Kill while episode 20-0's second tool call runs (its EFFECT_START journaled, its result not)."""
    GATE.clear()
    GATE["20-0"] = asyncio.Event()

    async def main():
        fake = await FakeSGLang().start()
        try:
            j = open_journal(c, d)
            async with ServerManager([fake.url], c.manager, initial_version=2) as sm:
                st = RolloutEngine(c, sm, None, loop_cls, progress=False).stream(journal=j)
                st.submit(samples(1)[0], 1)
                await calls_until(lambda calls: "20-0:1" in calls)
                await st.cancel_all("killed")
            j.close()
        finally:
            await fake.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
    GATE.clear()


def _resume(c: Config, d: Path, loop_cls):
    async def main():
        fake = await FakeSGLang().start()
        try:
            j = open_journal(c, d)
            j.plan_resume(handed_out=lambda u: True, floor_version=None)
            outs = await run_groups(c, fake, loop_cls, samples(1), 1, j)
            j.close()
            return outs, dict(j.counts), len(fake.requests)
        finally:
            await fake.stop()

    return asyncio.run(asyncio.wait_for(main(), 60))


def test_a_tool_call_cut_by_the_kill_runs_again_only_when_idempotent(tmp_path):
    c = cfg()
    CALLS.clear()
    _killed_in_a_tool(c, tmp_path / "a", Turns)
    CALLS.clear()
    outs, counts, asked = _resume(c, tmp_path / "a", Turns)
    rec = outs[0].records[0]
    assert rec.error is None and counts["effects_rerun"] == 1 and counts["effects_reused"] == 1
    assert CALLS == ["20-0:1", "20-0:2"] and asked == 1  # the cut call ran again, then the last turn live

    CALLS.clear()
    _killed_in_a_tool(c, tmp_path / "b", MailTurns)
    CALLS.clear()
    outs, counts, asked = _resume(c, tmp_path / "b", MailTurns)
    rec = outs[0].records[0]
    assert rec.error.startswith("EffectNotReplayable: tool 'tool:mailer' was running when the run stopped and is "
                                "not idempotent")
    assert CALLS == [] and asked == 0 and counts["episodes_failed_unreplayable"] == 1


def test_a_loop_that_is_not_resumable_restarts_and_says_why(tmp_path):
    c = cfg()
    CALLS.clear()
    _killed_in_a_tool(c, tmp_path / "j", NotResumable)
    CALLS.clear()
    outs, counts, asked = _resume(c, tmp_path / "j", NotResumable)
    assert outs[0].records[0].error is None and counts["episodes_restarted"] == 1
    assert asked == TURNS and len(CALLS) == TURNS  # everything again


def test_a_loop_that_diverges_from_its_journal_restarts_counted_and_named(tmp_path):
    c = cfg()

    async def main():
        f1, f2 = await FakeSGLang(hold_after=1).start(), await FakeSGLang().start()
        try:
            SHIFT["n"] = 0
            j = open_journal(c, tmp_path / "j")
            await run_groups(c, f1, Drifting, samples(1), 1, j, stop_after=1)
            j.close()
            SHIFT["n"] = 1  # the loop now builds another prompt: its journaled call is not what it asks
            j = open_journal(c, tmp_path / "j")
            j.plan_resume(handed_out=lambda u: True, floor_version=None)
            outs = await run_groups(c, f2, Drifting, samples(1), 1, j)
            j.close()
            return outs, dict(j.counts), dict(j.restart_reasons), len(f2.requests)
        finally:
            await f1.stop()
            await f2.stop()

    outs, counts, reasons, asked = asyncio.run(asyncio.wait_for(main(), 60))
    assert outs[0].records[0].error is None and outs[0].records[0].prompt_ids == [1, 2, 4]
    assert counts["episodes_restarted"] == 1 and counts.get("tokens_reused", 0) == 0 and asked == 2
    assert list(reasons) == ["diverged from its journal"]


def test_an_episode_whose_server_dies_goes_on_from_its_journal_on_another_server(tmp_path):
    """Server A answers one call, then dies with the next one in flight (retries spent at once,
    manager.max_attempts=1): the episode on it goes on from its journaled first turn on server B, no error record,
    the records those of an uninterrupted run."""
    c = cfg()

    async def main():
        ref_fake = await FakeSGLang().start()
        a, b = await FakeSGLang(hold_after=1).start(), await FakeSGLang().start()
        try:
            ref = await run_groups(c, ref_fake, Turns, samples(1), 2, None)
            j = open_journal(c, tmp_path / "j")
            async with ServerManager([a.url, b.url], c.manager, initial_version=2) as sm:
                eng = RolloutEngine(c, sm, None, Turns, progress=False)
                st = eng.stream(journal=j)
                st.submit(samples(1)[0], 2)
                await a.wait_until(lambda f: len(f.completed) >= 1 and f.inflight > 0)
                await a.stop()  # the process dies: its connections reset
                outs = [await st.next()]
            j.close()
            return ref, outs, dict(j.counts), len(a.completed), len(b.requests)
        finally:
            for f in (ref_fake, b):
                await f.stop()

    ref, outs, counts, a_done, b_asked = asyncio.run(asyncio.wait_for(main(), 60))
    assert all(r.error is None for r in outs[0].records) and tokens(outs) == tokens(ref)
    assert counts["episodes_continued_after_failure"] == 1 and counts["calls_reused"] == a_done == 1
    assert b_asked == 2 * TURNS - a_done  # B made only what A had not


def test_finished_episodes_of_a_loop_that_cannot_replay_are_journaled_whole_and_reused(tmp_path):
    """A finished episode is journaled light (its score; its tokens are in its journaled calls) when replaying
    rebuilds it, whole (token arrays and text) when not: both come back unchanged, with no server call."""
    c = cfg()

    async def main():
        f1, f2 = await FakeSGLang().start(), await FakeSGLang().start()
        try:
            j = open_journal(c, tmp_path / "j")
            first = await run_groups(c, f1, NotResumable, samples(2), 2, j)
            j.close()
            light = sum(len(e.light) for e in read_journal(tmp_path / "j").episodes.values())
            j = open_journal(c, tmp_path / "j")
            j.plan_resume(handed_out=lambda u: True, floor_version=None)
            again = await run_groups(c, f2, NotResumable, samples(2), 2, j)
            j.close()
            return first, again, dict(j.counts), len(f2.requests), light
        finally:
            await f1.stop()
            await f2.stop()

    first, again, counts, asked, light = asyncio.run(asyncio.wait_for(main(), 60))
    assert asked == 0 and light == 0 and counts["episodes_reused_finished"] == 4
    assert [[r.model_dump() for r in o.records] for o in first] == [[r.model_dump() for r in o.records]
                                                                     for o in again]
