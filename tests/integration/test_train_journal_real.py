"""`agentloop train` (asynchronous, η = 1, the episode journal on by default) SIGKILLed with episodes in flight, and
resumed with the README's command: the journaled episodes go on from their journaled tokens instead of being rolled
out again.

A reward plugin holds every episode after step 1's in its scoring while a `stall` file exists: the kill then finds
step 1 trained (or its batch submitted) and the next groups' episodes generated, journaled and waiting for their
score. The resumed run (stall removed) must: say what its journal holds, reuse every journaled token of the groups
it continues (journal/tokens_reused in its rows), train those episodes with exactly the journaled tokens, and
train every data position once (none skipped, none twice).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from agentloop.journal.reader import read_journal
from agentloop.records import read_records
from agentloop.train.handle.mailbox import read_batch
from agentloop.train.trainer.checkpoint import list_checkpoints, read_meta
from tests.integration.test_train_resume_real import _alive, _killpg, _lines, _load, _run_to_end, _tail

STEPS, PROMPTS, SAMPLES = 4, 2, 2


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_async_run_goes_on_from_its_journal(sglang_server, tiny_model_path, tmp_path):
    import asyncio

    url = sglang_server.url
    run_dir, plugin, stall, counter = tmp_path / "run", tmp_path / "reward.py", tmp_path / "stall", tmp_path / "calls"
    # the first PROMPTS groups to be scored (both samples of each, in whatever order the scorer takes them) pass;
    # every other episode waits while `stall` exists: step 1 trains, the groups after it stay journaled in scoring
    plugin.write_text(
        "import fcntl, json, os, time\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    key = str((extra_info or {}).get('index'))\n"
        f"    with open({str(counter)!r}, 'a+') as fh:\n"
        "        fcntl.flock(fh, fcntl.LOCK_EX)\n"
        "        fh.seek(0)\n"
        "        passed = json.loads(fh.read() or '[]')\n"
        f"        through = key in passed or len(passed) < {PROMPTS}\n"
        "        if through and key not in passed:\n"
        "            passed.append(key)\n"
        "            fh.seek(0)\n"
        "            fh.truncate()\n"
        "            fh.write(json.dumps(passed))\n"
        f"    while not through and os.path.exists({str(stall)!r}):\n"
        "        time.sleep(0.1)\n"
        "    return float(len(solution_str) > 0 and ord(solution_str[0]) % 2 == 0)\n")
    stall.touch()
    cmd = [sys.executable, "-m", "agentloop.cli", "train", "--quiet", "--server-url", url,
           "--model", str(tiny_model_path), "--loop", "single_turn_agent_loop", "--run-dir", str(run_dir),
           f"train.steps={STEPS}", f"train.prompts_per_step={PROMPTS}", f"rollout.n_samples={SAMPLES}",
           "train.val_every=0", "sampling.max_new_tokens=6", "learner.lr=0.001", "train.tensorboard=false",
           "reward.custom=" + json.dumps(f"{plugin}:compute_score"), "reward.timeout_s=600",
           # a thread for every episode in flight: with reward.workers' default 4, stalled groups could take them
           # all while a passing group's second sample queued behind them (a deadlock CI met under load)
           "reward.executor=thread", "reward.workers=64", "learner.checkpoint_every=1",
           "journal.write_interval_ms=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / "run1.log", tmp_path / "run2.log"]
    procs: list[subprocess.Popen] = []
    learner_pids: list[int] = []

    def journaled_waiting() -> int:
        """Episodes whose generate call is journaled and whose records are not (held in their scoring)."""
        jdir = run_dir / "journal"
        if not jdir.is_dir():
            return 0
        st = read_journal(jdir)
        return sum(1 for e in st.episodes.values() if e.replay() and e.records() is None)

    try:
        with logs[0].open("wb") as log:
            first = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        procs.append(first)
        deadline = time.monotonic() + 400
        while not (_lines(run_dir / "metrics.jsonl") and journaled_waiting() >= PROMPTS * SAMPLES):
            assert first.poll() is None, f"the run ended before the kill:\n{_tail(logs[0])}"
            assert time.monotonic() < deadline, f"nothing journaled in flight after 400 s:\n{_tail(logs[0])}"
            time.sleep(0.1)
        learner_pids.append(int(json.loads((run_dir / "mailbox" / "learner.json").read_text())["pid"]))
        _killpg(first.pid)
        first.wait(30)
        at_kill = read_journal(run_dir / "journal")
        stall.unlink()
        learner_pids.append(_run_to_end(cmd, env, logs[1], procs, run_dir, 500))
    finally:
        stall.unlink(missing_ok=True)
        for p in procs:
            _killpg(p.pid)
            p.wait(30)
        for pid in learner_pids:
            _killpg(pid)
        asyncio.run(_load(url, str(tiny_model_path)))
    out = logs[1].read_text()
    plan = [ln for ln in out.splitlines() if "agentloop train: journal:" in ln]
    assert len(plan) == 1 and " 0 damaged record(s)" in plan[0], out[-3000:]
    planned = int(plan[0].split(" model tokens reused")[0].rsplit("(", 1)[1].split(", ")[-1])
    resumed_at = int(out.split("resumed at step ", 1)[1].split()[0]) if "resumed at step " in out else 1
    rows = [json.loads(ln) for ln in _lines(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [float(s) for s in range(1, STEPS + 1)]
    reused = sum(r.get("journal/tokens_reused", 0) for r in rows if r["step"] >= resumed_at)
    assert planned > 0 and reused == planned, (planned, reused)
    assert sum(r.get("journal/episodes_restarted", 0) for r in rows) == 0

    # the journaled episodes were trained with exactly their journaled tokens
    by_episode = {}
    for s in range(1, STEPS + 1):
        for r in read_records(run_dir / "rollouts" / f"step-{s:06d}.jsonl"):
            by_episode[(r.uid, r.repeat, r.episode_id)] = r
    matched = 0
    for (uid, attempt, repeat), ep in at_kill.episodes.items():
        calls = ep.replay()
        rec = next((r for (u, rp, eid), r in by_episode.items() if u == uid and rp == repeat
                    and eid == f"{uid}{f'.{attempt}' if attempt else ''}-{repeat}"), None)
        if not calls or rec is None or ep.records() is not None:
            continue
        assert rec.response_ids == calls[0].out.token_ids and rec.response_logprobs == calls[0].out.logprobs
        matched += 1
    assert matched >= PROMPTS * SAMPLES

    # every data position trained once
    trained: dict[int, int] = {}
    for step in range(1, STEPS + 1):
        uids = set(read_batch(run_dir, step).uid.tolist())
        assert len(uids) == PROMPTS
        for u in uids:
            assert u not in trained, f"position {u} trained at steps {trained[u]} and {step}"
            trained[u] = step
    pos = read_meta(list_checkpoints(run_dir / "checkpoints")[-1]).data_position
    assert set(range(pos["next"])) - set(trained) - set(pos["requeue"]) == set(), "a position was skipped"
    assert not any(_alive(pid) for pid in learner_pids)
