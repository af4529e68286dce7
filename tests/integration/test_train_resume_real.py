"""`agentloop train` killed hard mid-run, twice, and resumed: nothing lost, nothing repeated.

The whole command (orchestrator + its learner child) runs as a subprocess against the session's
real SGLang server, and its process group gets SIGKILL twice: (1) with step 2 checkpointed and
step 3's rollouts half written (a stalling reward holds the run there), (2) after resuming, once
step 4's batch is in the learner's mailbox. Each time the learner, which runs in a session of its
own, must die with the command. The same command (`train.resume=true`) then finishes the run.

"Nothing lost or repeated" means, in the final run directory:
- metrics.jsonl holds one line per step 1..4;
- rollouts/step-N.jsonl holds exactly that step's prompts_per_step x n_samples episodes: the
  partial file of a step in flight is replaced, not appended to; a step whose batch was already
  submitted keeps its rollouts, which are exactly the batch the learner trained;
- the prompts of every step are those an uninterrupted run takes (the DataCursor's order);
- the learner resumed from its checkpoints and its optimizer went on counting (AdamW's step
  counter in the last checkpoint is 4);
- the records of step N were sampled with the weights of step N-1 (a resumed run pushes the
  checkpointed weights before rolling out), and the server ends with the learner's final weights.

The server's original weights are restored afterwards, as in test_train_real. Whether the second
kill lands before or after the learner's step-4 checkpoint depends on timing (both are checked);
what a real run cannot hit on demand (a step updated but not logged, lines of steps after the
last checkpoint) is covered on files by test_step_log_resume_at.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agentloop.config import load_config
from agentloop.data import load_train_data
from agentloop.records import EpisodeRecord, read_records
from agentloop.report.steplog import StepLog
from agentloop.train.handle.mailbox import MailboxPaths, read_batch
from agentloop.train.orchestrator.cursor import DataCursor
from agentloop.train.orchestrator.learner_process import FileLearner
from agentloop.train.orchestrator.loop import recover_step_rows
from agentloop.train.trainer.checkpoint import list_checkpoints, read_meta
from tests.integration.test_train_real import (
    FIXED,
    _hf_logprobs,
    _load,
    _server_logprobs,
)

STEPS, PROMPTS, SAMPLES = 4, 2, 2


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_dead(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _lines(path: Path) -> list[str]:
    try:
        return [ln for ln in path.read_text().splitlines() if ln.strip()]
    except FileNotFoundError:
        return []


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return ""


def _optimizer_steps(ckpt: Path, tmp: Path) -> set[float]:
    """AdamW's per-parameter `step` counters stored in a (DCP) checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / "ckpt.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    state = torch.load(out, weights_only=False)["optim"]["state"]
    return {float(s["step"]) for s in state.values()}


def _stop_all(procs: list, learner_pids: list[int], url: str, model_path: Path) -> None:
    """Kill whatever a test started and give the shared server its original weights back."""
    for p in procs:
        _killpg(p.pid)
    for pid in learner_pids:
        _killpg(pid)
    asyncio.run(_load(url, str(model_path)))


def _run_to_end(cmd: list[str], env: dict[str, str], log_path: Path, procs: list, run_dir: Path,
                timeout: float) -> int:
    """Run `cmd` (the resumed run) in a session of its own to its end, which must be exit 0 within `timeout`;
    return its learner's pid (learner.json)."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    procs.append(proc)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"resumed run did not finish:\n{_tail(log_path)}")
    assert rc == 0, f"resumed run failed ({rc}):\n{_tail(log_path)}\n--- learner.log ---\n" \
                    f"{_tail(run_dir / 'learner.log')}"
    return int(json.loads((run_dir / "mailbox" / "learner.json").read_text())["pid"])


def _run_until(cmd: list[str], env: dict[str, str], log_path: Path, procs: list, until, what: str) -> int:
    """Start `cmd` in a session of its own; once `until()` holds, SIGKILL its process group and
    return the learner's pid (read from learner.json before the kill)."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    procs.append(proc)
    deadline = time.monotonic() + 300
    while not until():
        assert proc.poll() is None, f"run exited ({proc.returncode}) before {what}:\n{_tail(log_path)}"
        assert time.monotonic() < deadline, f"no {what} after 300 s:\n{_tail(log_path)}"
        time.sleep(0.02)
    pid = int(json.loads((log_path.parent / "run" / "mailbox" / "learner.json").read_text())["pid"])
    _killpg(proc.pid)
    proc.wait(timeout=30)
    # the learner runs in a session of its own; it must not outlive the command
    assert _wait_dead(pid, 120), f"the learner (pid {pid}) outlived the killed `agentloop train`"
    return pid


@pytest.mark.sglang
@pytest.mark.timeout(900)
def test_train_killed_and_resumed_loses_and_repeats_nothing(sglang_server, tiny_model_path, tmp_path):
    url = sglang_server.url
    run_dir = tmp_path / "run"
    plugin, stall = tmp_path / "reward.py", tmp_path / "stall"
    # A reward with variance on a random model, so GRPO advantages (and weight changes) are non-zero.
    # While `stall` exists it blocks the orchestrator from its (2 * PROMPTS * SAMPLES + 2)th call on,
    # i.e. after step 3's first record: the first kill then finds step 3's rollouts half written.
    # The count lives in a file under a lock: rewards run in a pool of worker processes (reward.workers).
    counter = tmp_path / "calls"
    plugin.write_text(
        "import fcntl, os, time\n\n"
        "def _count():\n"
        f"    with open({str(counter)!r}, 'a+') as fh:\n"
        "        fcntl.flock(fh, fcntl.LOCK_EX)\n"
        "        fh.seek(0)\n"
        "        n = int(fh.read() or 0) + 1\n"
        "        fh.seek(0)\n"
        "        fh.truncate()\n"
        "        fh.write(str(n))\n"
        "        return n\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    if _count() > {2 * PROMPTS * SAMPLES + 1} and os.path.exists({str(stall)!r}):\n"
        "        time.sleep(120)\n"
        "    return float(len(solution_str) > 0 and ord(solution_str[0]) % 2 == 0)\n")
    stall.touch()
    overrides = [f"train.steps={STEPS}", f"train.prompts_per_step={PROMPTS}", f"rollout.n_samples={SAMPLES}",
                 "train.val_every=0", "sampling.max_new_tokens=6", "learner.lr=0.001",
                 "reward.custom=" + json.dumps(f"{plugin}:compute_score"),
                 "learner.checkpoint_every=1", "learner.keep_checkpoints=2", "train.tensorboard=false",
                 "train.update_timeout_s=300", "train.learner_ready_timeout_s=300", "train.schedule=sync",
                 "reward.timeout_s=600"]
    cmd = [sys.executable, "-m", "agentloop.cli", "train", "--quiet", "--server-url", url,
           "--model", str(tiny_model_path), "--loop", "single_turn_agent_loop", "--run-dir", str(run_dir),
           *overrides]
    resume_cmd = cmd + ["train.resume=true"]
    ckpts, rollouts, mailbox = run_dir / "checkpoints", run_dir / "rollouts", run_dir / "mailbox"
    logs = [tmp_path / f"run{i}.log" for i in (1, 2, 3)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    learner_pids: list[int] = []
    procs: list[subprocess.Popen] = []
    before = asyncio.run(_server_logprobs(url, FIXED))
    t0 = time.monotonic()
    try:
        # 1. killed with step 2 checkpointed and step 3's rollouts half written
        learner_pids.append(_run_until(cmd, env, logs[0], procs, lambda: (
            (ckpts / "step-000002" / "meta.json").is_file() and _lines(rollouts / "step-000003.jsonl")),
            "step 3's first record"))
        t_kill1 = time.monotonic() - t0
        stall.unlink()
        assert [p.name for p in list_checkpoints(ckpts)] == ["step-000001", "step-000002"]
        assert len(_lines(rollouts / "step-000003.jsonl")) == 1 and not mailbox.joinpath("step-000003").exists()
        assert [json.loads(ln)["step"] for ln in _lines(run_dir / "metrics.jsonl")] == [1.0, 2.0]

        # 2. resumed, killed again once step 4's batch is submitted (the learner is on it)
        learner_pids.append(_run_until(resume_cmd, env, logs[1], procs,
                                       lambda: (mailbox / "step-000004" / "batch.ready").exists(),
                                       "step 4's batch"))
        t_kill2 = time.monotonic() - t0
        assert "resumed at step 3 (data position 4)" in logs[1].read_text()
        at_kill2 = {"checkpoints": [p.name for p in list_checkpoints(ckpts)],
                    "step4_done": (mailbox / "step-000004" / "update.done").exists(),
                    "metrics_steps": [json.loads(ln)["step"] for ln in _lines(run_dir / "metrics.jsonl")]}
        print(f"kill 1 at {t_kill1:.1f}s (step 3 half rolled out); kill 2 at {t_kill2:.1f}s: {at_kill2}")

        # 3. resumed again, to the end
        with logs[2].open("wb") as log:
            third = subprocess.Popen(resume_cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        procs.append(third)
        try:
            rc = third.wait(timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail(f"resumed run did not finish:\n{_tail(logs[2])}")
        assert rc == 0, f"resumed run failed ({rc}):\n{_tail(logs[2])}\n--- learner.log ---\n" \
                        f"{_tail(run_dir / 'learner.log')}"
        info = json.loads((mailbox / "learner.json").read_text())
        learner_pids.append(int(info["pid"]))
        after = asyncio.run(_server_logprobs(url, FIXED))
        learner_lp = _hf_logprobs(run_dir / "weights" / f"step-{STEPS:06d}", FIXED)
    finally:
        _stop_all(procs, learner_pids, url, tiny_model_path)
    print(f"total {time.monotonic() - t0:.1f}s")
    restored = asyncio.run(_server_logprobs(url, FIXED))
    assert max(abs(a - b) for a, b in zip(before, restored)) < 1e-4

    # the last resume: where it started, and that the learner continued its own state
    resumed_step = info["resumed_step"]
    assert resumed_step in (3, 4) and info["status"] == "stopped" and info.get("last_step") == STEPS
    assert f"resumed at step {STEPS + 1} " in logs[2].read_text()
    if resumed_step < STEPS:  # killed before step 4's checkpoint: the learner trains the submitted batch as is
        assert f"from checkpoint {resumed_step} and trained the 1 batch(es) submitted" in logs[2].read_text()
    assert [read_meta(p).step for p in list_checkpoints(ckpts)] == [STEPS - 1, STEPS]
    last = read_meta(list_checkpoints(ckpts)[-1])
    cfg = load_config(run_dir / "config.yaml")  # the run's own config: the embedded preset's rows
    cursor = DataCursor(load_train_data(cfg.data, validate=False).train, cfg.rollout.seed)
    assert last.data_position == {"next": STEPS * PROMPTS, "requeue": [], "rows": len(cursor.samples),
                                  "fingerprint": cursor.fingerprint}  # the rows the positions index
    assert _optimizer_steps(last.path, tmp_path) == {float(STEPS)}  # 4 AdamW steps: state continued

    # metrics: each step exactly once
    rows = [json.loads(ln) for ln in _lines(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [float(s) for s in range(1, STEPS + 1)]
    assert all(r["learner/actor/optimizer_steps"] == 1.0 for r in rows)

    # rollouts: every step complete, once, with the prompts of an uninterrupted run
    for step in range(1, STEPS + 1):
        recs = list(read_records(rollouts / f"step-{step:06d}.jsonl"))
        want = sorted(s.index for s in cursor.take(PROMPTS) for _ in range(SAMPLES))
        assert sorted(r.index for r in recs) == want, f"step {step}: prompts differ from an uninterrupted run"
        assert len({r.episode_id for r in recs}) == PROMPTS * SAMPLES
        assert all(r.step == step and r.error is None for r in recs)
        if step > 1:  # sampled with the previous step's weights (after the resume too)
            assert {v for r in recs for v in r.weight_versions} == {str(step - 1)}, f"step {step}"
        batch = read_batch(run_dir, step)  # what the learner trained: each episode's group and tokens
        assert sorted((u, batch.response_ids(i)) for i, u in enumerate(batch.uid.tolist())) == \
            sorted((r.uid, r.response_ids) for r in recs), f"step {step}: trained != logged"

    # the server ended with the learner's final weights
    assert max(abs(a - b) for a, b in zip(before, after)) > 1e-3, "server weights did not change"
    assert max(abs(a - b) for a, b in zip(after, learner_lp)) < 2e-3, "server != learner's final weights"

    # nothing left running
    assert all(p.poll() is not None for p in procs)
    assert not any(_alive(pid) for pid in learner_pids), "a learner process is still running"


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_at_step_9_resumes_from_checkpoint_5_with_the_readme_command(sglang_server, tiny_model_path, tmp_path):
    """The defaults a user gets (async, η = 1; `learner.keep_weights=3`), checkpoints every 5 steps: SIGKILL
    once step 9's batch is submitted (steps 6-8 trained past checkpoint 5), then the README's resume,
    `agentloop train --run-dir X` with the same overrides. The weights of checkpoint 5 are still there
    (pruned before the fix: the resume failed on them); the learner resumes at step 6 from checkpoint 5
    and trains the submitted batches 6-9 as they are, then the run goes on at step 10 with the servers on
    weights/step-9; metrics.jsonl ends with one row per step, every data position is trained once (or was
    in flight at the end), and the summary names the final HF weights and checkpoint, which transformers
    loads."""
    url, steps, B = sglang_server.url, 10, 2
    run_dir = tmp_path / "run"
    plugin = tmp_path / "reward.py"
    plugin.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) > 0 and ord(solution_str[0]) % 2 == 0)\n")
    overrides = [f"train.steps={steps}", f"train.prompts_per_step={B}", "rollout.n_samples=2", "train.val_every=0",
                 "sampling.max_new_tokens=6", "learner.lr=0.001",
                 "reward.custom=" + json.dumps(f"{plugin}:compute_score"),
                 "learner.checkpoint_every=5", "train.tensorboard=false"]
    cmd = [sys.executable, "-m", "agentloop.cli", "train", "--server-url", url, "--model", str(tiny_model_path),
           "--loop", "single_turn_agent_loop", "--run-dir", str(run_dir), *overrides]
    mailbox, logs = run_dir / "mailbox", [tmp_path / "run1.log", tmp_path / "run2.log"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen] = []
    learner_pids: list[int] = []
    t0 = time.monotonic()
    try:
        learner_pids.append(_run_until(cmd, env, logs[0], procs,
                                       lambda: (mailbox / "step-000009" / "batch.ready").exists(), "step 9's batch"))
        t_kill = time.monotonic() - t0
        assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step-000005"]
        assert (run_dir / "weights" / "step-000005").is_dir(), "the newest checkpoint's weights were pruned"
        learner_pids.append(_run_to_end(cmd, env, logs[1], procs, run_dir, 500))
    finally:
        _stop_all(procs, learner_pids, url, tiny_model_path)
    print(f"killed at {t_kill:.1f}s, total {time.monotonic() - t0:.1f}s")
    out = logs[1].read_text()
    assert "resumed at step 10 (data position" in out and f"servers loaded {run_dir / 'weights' / 'step-000009'}" in out
    assert "the learner resumed from checkpoint 5 and trained the 4 batch(es) submitted before the stop" in out
    assert f"ready for step 6 (resumed from checkpoint {run_dir / 'checkpoints' / 'step-000005'})" in \
        (run_dir / "learner.log").read_text()

    rows = [json.loads(ln) for ln in _lines(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [float(s) for s in range(1, steps + 1)]
    trained: dict[int, int] = {}
    for step in range(1, steps + 1):
        uids = read_batch(run_dir, step).uid.tolist()
        assert len(set(uids)) == B, (step, uids)
        for u in set(uids):
            assert u not in trained, f"position {u} trained at steps {trained[u]} and {step}"
            trained[u] = step
    summary = json.loads((run_dir / "train_summary.json").read_text())
    missing = set(range(max(trained) + 1)) - set(trained)  # only positions in flight when the run ended
    assert len(missing) <= summary["async"]["groups_left_at_end"], (sorted(trained), summary["async"])

    # the final model: both directories printed, the HF one complete
    weights, ckpt = run_dir / "weights" / f"step-{steps:06d}", run_dir / "checkpoints" / f"step-{steps:06d}"
    assert f"checkpoint:   {ckpt}" in out and f"weights:      {weights}" in out
    assert read_meta(ckpt).step == steps
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(str(weights))
    assert max(abs(a - b) for a, b in zip(_hf_logprobs(weights, FIXED), _hf_logprobs(tiny_model_path, FIXED))) > 1e-4
    assert AutoModelForCausalLM.from_pretrained(str(weights)).config.vocab_size > 0
    assert not any(_alive(pid) for pid in learner_pids)


def _rec(index: int, repeat: int, reward: float) -> EpisodeRecord:
    return EpisodeRecord(prompt_ids=[1, 2], response_ids=[3], response_mask=[1], response_logprobs=[-0.5],
                         reward=reward, episode_id=f"{index}-{repeat}", index=index, repeat=repeat,
                         data_source="x", loop="single_turn_agent_loop", seed=0, step=3)


def test_step_log_resume_at(tmp_path):
    cfg = load_config(None, ['server.urls=["http://127.0.0.1:1"]', "train.tensorboard=false"])
    paths = MailboxPaths(tmp_path)
    metrics = tmp_path / "metrics.jsonl"

    def write_rows(steps):
        metrics.write_text("".join(json.dumps({"step": float(s), "train/reward": s / 10}) + "\n" for s in steps))

    # checkpoint_every=2, killed after step 5 was logged, resumed from checkpoint 2: steps 3..5 are redone
    write_rows([0, 1, 2, 3, 4, 5])
    log = StepLog(cfg, tmp_path)
    asyncio.run(recover_step_rows(log, 3, FileLearner(tmp_path), tmp_path))
    assert [r["step"] for r in log.rows] == [0, 1, 2]
    assert [json.loads(ln)["step"] for ln in _lines(metrics)] == [0, 1, 2]

    # killed after the learner's update.done of step 3 (and checkpoint 3) but before its line
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "step-000003.jsonl").write_text(
        "".join(_rec(7, r, float(r)).model_dump_json() + "\n" for r in range(2)))
    paths.step_dir(3).mkdir(parents=True)
    (paths.done(3)).write_text(json.dumps({"step": 3, "metrics": {"actor/grad_norm": 0.25, "note": "x"}}))
    log = StepLog(cfg, tmp_path)
    asyncio.run(recover_step_rows(log, 4, FileLearner(tmp_path), tmp_path))
    rows = [json.loads(ln) for ln in _lines(metrics)]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows == log.rows
    assert rows[-1]["learner/actor/grad_norm"] == 0.25 and rows[-1]["train/reward"] == 0.5
    assert rows[-1]["train/episodes"] == 2.0 and "learner/note" not in rows[-1]
    asyncio.run(recover_step_rows(log, 4, FileLearner(tmp_path), tmp_path))  # idempotent
    assert [json.loads(ln)["step"] for ln in _lines(metrics)] == [0, 1, 2, 3]

    # nothing survives a restart from scratch (the step-0 validation line is written again)
    asyncio.run(recover_step_rows(log, 1, FileLearner(tmp_path), tmp_path))
    assert log.rows == [] and _lines(metrics) == []


@pytest.mark.sglang
@pytest.mark.timeout(600)
def test_ctrl_c_stops_cleanly_and_the_run_resumes(sglang_server, tiny_model_path, tmp_path):
    """SIGINT to the command's process group (a terminal's Ctrl-C) mid-run: exit 130 (the interrupt handled, not
    a deadline run out: the wait below ends before train.update_timeout_s could), the learner gone, the server
    serving (not left paused), and the last checkpoint resumes."""
    url = sglang_server.url
    run_dir = tmp_path / "run"
    # The Ctrl-C must land mid-run, not after it: a run of 3 steps this small can end before the test is scheduled
    # again on a loaded box (it did: exit 0, and with a 15 s cap on the hold, once more in a loaded suite). So every
    # reward scored once checkpoint 1 exists waits while `hold` exists, which the test removes only once the SIGINT
    # is sent (a Ctrl-C waits for a reward already running; the 100 s cap is a hang guard below reward.timeout_s).
    # Step 1's rewards all come before its checkpoint, which the learner writes before it pushes step 1's weights;
    # step 3's episodes (eta = 1) need those weights, so the run cannot end before the SIGINT. The gate names the
    # checkpoint, not a count of calls: asynchronously a step-2 episode can be scored among the first four, and a
    # count of four then held step 1 itself. The resumed run finds `hold` gone.
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "hold").touch()
    reward = tmp_path / "gated_reward.py"
    reward.write_text(
        "import os, time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    gate, ckpt = os.environ['AGENTLOOP_TEST_GATE'], os.environ['AGENTLOOP_TEST_CHECKPOINT']\n"
        "    until = time.monotonic() + 100\n"
        "    while os.path.exists(ckpt) and os.path.exists(os.path.join(gate, 'hold')) and time.monotonic() < until:\n"
        "        time.sleep(0.05)\n"
        "    return 0.0\n")
    overrides = ["train.steps=3", "train.prompts_per_step=2", "rollout.n_samples=2", "train.val_every=0",
                 "sampling.max_new_tokens=6", "learner.checkpoint_every=1", "train.tensorboard=false",
                 "train.update_timeout_s=300", "train.learner_ready_timeout_s=300",
                 f"reward.custom={reward}:compute_score", "reward.timeout_s=120"]
    cmd = [sys.executable, "-m", "agentloop.cli", "train", "--quiet", "--server-url", url,
           "--model", str(tiny_model_path), "--loop", "single_turn_agent_loop", "--run-dir", str(run_dir),
           *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AGENTLOOP_TEST_GATE": str(gate),
           "AGENTLOOP_TEST_CHECKPOINT": str(run_dir / "checkpoints" / "step-000001" / "meta.json")}
    log_path, log2_path = tmp_path / "run1.log", tmp_path / "run2.log"
    procs: list[subprocess.Popen] = []
    learner_pids: list[int] = []
    try:
        with log_path.open("wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        procs.append(proc)
        deadline = time.monotonic() + 300
        while not (run_dir / "checkpoints" / "step-000001" / "meta.json").is_file():
            assert proc.poll() is None, f"run exited ({proc.returncode}) early:\n{_tail(log_path)}"
            assert time.monotonic() < deadline, f"no checkpoint 1 after 300 s:\n{_tail(log_path)}"
            time.sleep(0.02)
        learner_pids.append(int(json.loads((run_dir / "mailbox" / "learner.json").read_text())["pid"]))
        os.killpg(proc.pid, signal.SIGINT)
        (gate / "hold").unlink()
        rc = proc.wait(timeout=240)  # a hang guard, shorter than the run's 300 s deadlines
        assert rc == 130, f"exit {rc}:\n{_tail(log_path)}"
        assert _wait_dead(learner_pids[0], 120), "the learner outlived Ctrl-C"
        # the server was resumed if the interrupt hit a paused weight push: it still generates
        assert len(asyncio.run(_server_logprobs(url, FIXED))) == len(FIXED) - 1

        with log2_path.open("wb") as log:
            second = subprocess.Popen(cmd + ["train.resume=true"], stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
        procs.append(second)
        rc2 = second.wait(timeout=300)
        assert rc2 == 0, f"resumed run failed ({rc2}):\n{_tail(log2_path)}"
        learner_pids.append(int(json.loads((run_dir / "mailbox" / "learner.json").read_text())["pid"]))
    finally:
        _stop_all(procs, learner_pids, url, tiny_model_path)
    assert "resumed at step" in log2_path.read_text()
    rows = [json.loads(ln) for ln in _lines(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0]
    assert [read_meta(p).step for p in list_checkpoints(run_dir / "checkpoints")][-1] == 3
    assert not any(_alive(pid) for pid in learner_pids)
