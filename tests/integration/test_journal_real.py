"""The episode journal against the real CPU SGLang server: episodes journaled by a process that is SIGKILLed mid-way,
then continued by this one from the journal.

The child (journal_child.py) runs 3 groups x 2 episodes of a 3-turn loop, two episodes at a time, and is killed
once the journal holds at least 4 completed generate calls. Resumed here against the same server: every journaled
call is served from the journal (its tokens, logprobs and versions exactly as journaled), the server is asked only
for the calls the journal does not hold, and each resumed episode's next prompt is the journaled tokens (prompt +
the journaled output + the loop's environment tokens), never re-rendered text.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentloop.journal import Journal
from agentloop.journal.reader import read_journal
from agentloop.rollout.engine import RolloutEngine
from agentloop.server_manager import ServerManager
from tests.integration.journal_child import GROUPS, TURNS, N, ThreeTurns, config, header, samples

ROOT = Path(__file__).resolve().parents[2]


def _gens(directory: Path) -> int:
    state = read_journal(directory)
    return sum(len(e.replay()) for e in state.episodes.values())


@pytest.mark.sglang
@pytest.mark.timeout(600)
def test_a_killed_process_s_episodes_go_on_from_the_journal_without_asking_the_server_again(sglang_server, tmp_path):
    url, jdir = sglang_server.url, tmp_path / "journal"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "child.log"
    with log.open("wb") as fh:
        child = subprocess.Popen([sys.executable, "-m", "tests.integration.journal_child", url, str(jdir)], cwd=ROOT,
                                 env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (jdir.is_dir() and _gens(jdir) >= 4):
            assert child.poll() is None, f"the child ended before the kill:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the child journaled nothing in 300 s"
            time.sleep(0.05)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(30)
    at_kill = read_journal(jdir)
    journaled = {k: [e.out for e in ep.replay()] for k, ep in at_kill.episodes.items()}
    n_journaled = sum(len(v) for v in journaled.values())
    assert 4 <= n_journaled < GROUPS * N * TURNS, "the kill should find the episodes part done"

    cfg = config(url)

    async def resume():
        journal = Journal.open(jdir, cfg.journal, header(cfg))
        plan = journal.plan_resume(handed_out=lambda uid: True, floor_version=None)
        async with ServerManager([url], cfg.manager, initial_version=0) as sm:
            stream = RolloutEngine(cfg, sm, None, ThreeTurns, progress=False).stream(journal=journal)
            for s in samples():
                stream.submit(journal.resumed_sample(s), N)
            outs = [await stream.next() for _ in range(GROUPS)]
            asked = int(sm.gauges()["server/requests"])
        journal.close()
        return plan, outs, asked, dict(journal.counts)

    plan, outs, asked, counts = asyncio.run(asyncio.wait_for(resume(), 300))
    recs = {(r.uid, 0, r.repeat): r for o in outs for r in o.records}
    assert len(recs) == GROUPS * N and all(r.error is None and r.num_turns == TURNS for r in recs.values())
    finished = sum(1 for ep in at_kill.episodes.values() if ep.records() is not None)
    finished_calls = sum(len(journaled[k]) for k, ep in at_kill.episodes.items() if ep.records() is not None)
    # the server saw only the calls the journal did not hold
    assert asked == GROUPS * N * TURNS - n_journaled
    assert counts["calls_reused"] == n_journaled - finished_calls
    assert counts.get("episodes_reused_finished", 0) == finished
    assert counts["tokens_reused"] == plan.tokens == sum(len(o.token_ids) for v in journaled.values() for o in v)
    for key, outs_j in journaled.items():
        r, pos = recs[key], 0
        for o in outs_j:  # each journaled turn is in the record exactly: ids, logprobs, versions
            k = len(o.token_ids)
            assert r.response_ids[pos:pos + k] == o.token_ids and r.response_logprobs[pos:pos + k] == o.logprobs
            assert r.response_mask[pos:pos + k] == [1] * k and r.token_versions[pos:pos + k] == o.token_versions
            assert r.response_ids[pos + k:pos + k + 2] == [198, 13]  # then the loop's environment tokens
            pos += k + 2
    # every episode resumed part-way went on from the journaled tokens (its next prompt extended them)
    resumed = sum(1 for k, v in journaled.items() if v and at_kill.episodes[k].records() is None)
    assert counts.get("episodes_resumed", 0) == resumed
    assert counts.get("continuations_exact", 0) == sum(
        1 for k, v in journaled.items() if 0 < len(v) < TURNS and at_kill.episodes[k].records() is None)
