"""The plugin guide's journal example (docs/plugins.md; examples/journaled_env_loop.py: a loop with a Room of its own, rebuilt by `restore`,
and a stateful idempotent tool, through `effect` and `tool_call`) killed mid-episode and resumed, against the
scripted fake server (its tokens are a function of the input ids, so the Room's and the tool's text steer every
later token): the resumed episodes equal uninterrupted ones token for token, no journaled Room step runs again, and
the tool's journaled calls run again only to rebuild its instance (Tally.stateful)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from agentloop.config import Config, ManagerConfig, load_config
from agentloop.journal import Journal, journal_header
from agentloop.records import Sample
from agentloop.rollout.engine import RolloutEngine
from agentloop.server_manager import ServerManager
from tests.fakes.fake_sglang import FakeSGLang

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "journaled_env_loop.py"
GROUPS, N, TURNS = 2, 2, 3


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("journaled_env_loop_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    except ValueError as e:  # registered already (the module imported once before in this process)
        pytest.fail(f"{EXAMPLE} could not be imported: {e}")
    return mod


@pytest.fixture(scope="module")
def tokenizer():
    from agentloop.models.modelzoo import ensure_tiny_model, load_tokenizer

    return load_tokenizer(ensure_tiny_model())


class Counted:
    """Room steps and Tally calls that really ran, and an event once `target` Tally calls have."""

    def __init__(self, example, monkeypatch):
        self.steps, self.tallies = 0, 0
        self.target, self.reached = None, None
        room_step, tally_execute = example.Room.step, example.Tally.execute

        def step(room, action):
            self.steps += 1
            return room_step(room, action)

        async def execute(tool, instance, arguments):
            self.tallies += 1
            if self.target is not None and self.tallies >= self.target:
                self.reached.set()
            return await tally_execute(tool, instance, arguments)

        monkeypatch.setattr(example.Room, "step", step)
        monkeypatch.setattr(example.Tally, "execute", execute)

    async def tallies_reach(self, n: int) -> None:
        self.target, self.reached = n, asyncio.Event()
        if self.tallies < n:
            await self.reached.wait()


def cfg() -> Config:
    c = load_config(None, ['server.urls=["http://127.0.0.1:1"]', "sampling.max_new_tokens=4",
                           "journal.write_interval_ms=0"])
    c.manager = ManagerConfig(health_interval_s=60, retry_budget_s=5, all_down_grace_s=0.2, max_attempts=1,
                              eject_after_failures=1, retry_backoff_s=0.01)
    return c


def samples() -> list[Sample]:
    return [Sample(index=i, uid=40 + i, data_source="agentloop/arithmetic", ground_truth="7",
                   messages=[{"role": "user", "content": f"room {i}"}])
            for i in range(GROUPS)]


def tokens(outs) -> list[tuple]:
    return sorted((r.episode_id, r.prompt_ids, r.response_ids, r.response_mask, r.response_logprobs, r.error)
                  for o in outs for r in o.records)


async def run_groups(c, fake, loop_cls, tok, journal, counted=None, stop_after=None):
    """Every group to the end; or, with `stop_after`, killed once that many calls were answered and their Room
    steps and tool calls ran (journaled: a result is put before the loop's next await), other calls held."""
    async with ServerManager([fake.url], c.manager, initial_version=2) as sm:
        st = RolloutEngine(c, sm, tok, loop_cls, progress=False).stream(journal=journal)
        for s in samples():
            st.submit(journal.resumed_sample(s) if journal is not None else s, N)
        if stop_after is None:
            return [await st.next() for _ in range(GROUPS)]
        await fake.wait_until(lambda f: len(f.completed) >= stop_after and f.inflight > 0)
        await counted.tallies_reach(stop_after)
        await st.cancel_all("killed")
        return []


def test_the_readme_example_resumes_token_for_token_without_running_a_journaled_step_again(
        example, tokenizer, monkeypatch, tmp_path):
    c, counted = cfg(), Counted(example, monkeypatch)
    header = journal_header(c, "m", "fp")

    async def main():
        ref_fake, f1, f2 = (await FakeSGLang().start(), await FakeSGLang(hold_after=5).start(),
                            await FakeSGLang().start())
        try:
            ref = await run_groups(c, ref_fake, example.RoomLoop, tokenizer, None)
            counted.steps = counted.tallies = 0
            j = Journal.open(tmp_path / "j", c.journal, header)
            await run_groups(c, f1, example.RoomLoop, tokenizer, j, counted, stop_after=5)
            j.close()
            before = (counted.steps, counted.tallies)
            counted.steps = counted.tallies = 0
            counted.target = None
            j = Journal.open(tmp_path / "j", c.journal, header)
            plan = j.plan_resume(handed_out=lambda u: True, floor_version=None)
            outs = await run_groups(c, f2, example.RoomLoop, tokenizer, j)
            j.close()
            return ref, outs, plan, dict(j.counts), len(f2.requests), before, (counted.steps, counted.tallies)
        finally:
            for f in (ref_fake, f1, f2):
                await f.stop()

    ref, outs, plan, counts, asked, before, after = asyncio.run(asyncio.wait_for(main(), 120))
    total = GROUPS * N * TURNS
    assert all(r.error is None for o in ref for r in o.records)
    # the Room rebuilt by restore and the tally by re-running its journaled calls: the same tokens as uninterrupted
    assert tokens(outs) == tokens(ref)
    assert before == (5, 5) and asked == total - 5 and counts["calls_reused"] == 5 and plan.episodes >= 2
    assert after[0] == total - 5  # no journaled Room step ran again
    assert counts["effects_rerun_for_state"] == 5 and after[1] == total  # journaled Tally calls rebuilt it
    assert counts["effects_reused"] == 10 and counts["episodes_resumed"] == plan.episodes
    assert counts.get("episodes_restarted", 0) == 0


def test_the_readme_shows_the_example_s_code():
    code = EXAMPLE.read_text()
    code = code[code.index("from agentloop import"):]
    assert f"```python\n{code}```" in (ROOT / "docs" / "plugins.md").read_text()
