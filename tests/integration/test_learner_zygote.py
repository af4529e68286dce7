"""The zygote that forks one-rank learners (agentloop.train.trainer.zygote), with the real learner: a learner the
orchestrator's LearnerProcess starts is forked, trains a step, logs to learner.log and exits 0 through the zygote; it
dies with the process that asked for it; a learner whose environment differs, or one torchrun starts, is spawned.

Each test starts a zygote of its own (the session's, tests/conftest.py, serves the other tests' learners)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentloop.config import dump_config, load_config
from agentloop.train.config import AlgoConfig
from agentloop.train.handle.launch import ZYGOTE_ENV, learner_environment
from agentloop.train.handle.mailbox import MailboxClient
from agentloop.train.orchestrator.learner_process import LearnerProcess
from agentloop.train.trainer import zygote
from agentloop.util.forked import ForkedProcess, _alive
from tests.unit.train.test_learner import make_records

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

GUARD_S = 120.0
"""A hang guard for a process to appear or go, not a verdict on the machine's speed."""


def _wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not cond():
        assert time.monotonic() < deadline, f"no {what} after {GUARD_S} s"
        time.sleep(0.05)


@pytest.fixture
def own_zygote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, subprocess.Popen]]:
    sock = tmp_path / "z" / "zygote.sock"
    proc = zygote.start(sock, tmp_path / "zygote.log")
    monkeypatch.setenv(ZYGOTE_ENV, str(sock))
    try:
        yield sock, proc
    finally:
        proc.kill()
        proc.wait()


def _run_dir(tmp_path: Path, name: str, overrides: list[str]) -> tuple[Path, object]:
    run = tmp_path / name
    run.mkdir()
    cfg = load_config(None, ["learner.device=cpu", "learner.poll_s=0.05", "learner.lr=0.01", *overrides])
    (run / "config.yaml").write_text(dump_config(cfg))
    return run, cfg


def test_a_forked_learner_trains_logs_and_exits_through_the_zygote(own_zygote, tiny_model_path, tmp_path):
    _, zproc = own_zygote
    run, cfg = _run_dir(tmp_path, "run", [])
    lp = LearnerProcess(cfg, run, tiny_model_path)
    proc = lp.start()
    try:
        assert isinstance(proc, ForkedProcess)
        client = MailboxClient(run, process=proc, poll_s=0.05)
        client.wait_ready(GUARD_S)
        client.submit_records(1, make_records(1), AlgoConfig())
        assert client.wait_update(1, GUARD_S).weights_dir == str(run / "weights" / "step-000001")
        # `ps` shows a learner's command line, not the zygote's
        assert "-m agentloop.train.trainer --run-dir" in Path(f"/proc/{proc.pid}/cmdline").read_text()
        client.stop()
        assert lp.stop(grace_s=GUARD_S) == 0  # the learner's own exit code, through the zygote
    finally:
        lp.stop(grace_s=0)
    log = lp.log_path.read_text()
    assert "agentloop train: starting the learner: " in log.splitlines()[0]
    assert f"forked by the zygote {zproc.pid}" in log
    assert "learner[0] INFO step 1 done: loss " in log and "exiting with code 0" in log


def test_a_forked_learner_dies_with_the_process_that_asked_for_it(own_zygote, tiny_model_path, tmp_path):
    """What PR_SET_PDEATHSIG does for a spawned learner: the orchestrator SIGKILLed, its learner goes too."""
    run, _ = _run_dir(tmp_path, "run", [])
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from agentloop.config import load_config
        from agentloop.train.orchestrator.learner_process import LearnerProcess
        cfg = load_config({str(run / "config.yaml")!r}, [])
        proc = LearnerProcess(cfg, Path({str(run)!r}), Path({str(tiny_model_path)!r})).start()
        print(type(proc).__name__, proc.pid, flush=True)
        time.sleep(600)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        kind, pid = owner.stdout.readline().split()
        assert kind == "ForkedProcess"
        _wait_until(lambda: "ready for step 1" in (run / "learner.log").read_text(), "ready learner")
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        _wait_until(lambda: not _alive(int(pid)), "end of the learner whose orchestrator was killed")
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()


def test_a_learner_the_zygote_cannot_serve_is_spawned(own_zygote, tiny_model_path, tmp_path, monkeypatch):
    """A variable read at start (OpenMP's wait policy) that differs from the zygote's: refused, spawned, and the log
    says why. torchrun's ranks are never asked for."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    run, cfg = _run_dir(tmp_path, "run", [])
    lp = LearnerProcess(cfg, run, tiny_model_path)
    proc = lp.start()
    try:
        assert isinstance(proc, subprocess.Popen)
        MailboxClient(run, process=proc, poll_s=0.05).wait_ready(GUARD_S)
    finally:
        lp.stop(grace_s=0)
    log = lp.log_path.read_text()
    assert "forked by the zygote" not in log
    assert "# agentloop: spawned, not forked: the zygote at" in log and "'OMP_WAIT_POLICY': ('ACTIVE', 'PASSIVE')" in log
    two, cfg2 = _run_dir(tmp_path, "two", ["learner.ranks=2"])
    assert LearnerProcess(cfg2, two, tiny_model_path)._forked(learner_environment(os.environ)) == ""
