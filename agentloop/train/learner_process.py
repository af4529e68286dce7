"""LearnerProcess: the learner ranks as one child process group of `agentloop train` (torchrun for
nproc > 1), its output in run_dir/learner.log, a bounded shutdown, and death with the orchestrator.

learner.log opens with the command line (written here), then holds the learner's own lines (rank 0's
progress, every rank's warnings and errors: see agentloop.train.learner) and anything its libraries print.

The orchestrator never imports the learner (torch, FSDP): it starts it by command line and talks to it
through the mailbox; `learner_command` is that command line.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from agentloop.config import Config
from agentloop.errors import ConfigError


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM the learner when the orchestrator dies, even by SIGKILL (Linux; best effort).

    The learner runs in a session of its own (a Ctrl-C must not reach it before STOP does), so a
    kill of the orchestrator's process group would otherwise leave it training, and a resumed run
    would start a second learner on the same run dir. SIGTERM rather than SIGKILL so that torchrun
    (nproc > 1) still stops its ranks, which it starts in sessions of their own.
    """
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass



class LearnerProcess:
    """The learner ranks as one child process group, with its output in run_dir/learner.log."""

    def __init__(self, cfg: Config, run_dir: Path, model_path: Path):
        self.cmd = learner_command(run_dir, model_path, nproc=cfg.learner.nproc, config=run_dir / "config.yaml",
                                   resume=cfg.train.resume)
        self.log_path = run_dir / "learner.log"
        self.weight_sync = cfg.learner.weight_sync
        self.gpus = cfg.learner.gpus
        if self.gpus is not None and len(self.gpus) < cfg.learner.nproc:
            raise ConfigError(f"learner.gpus={self.gpus} has fewer GPUs than learner.nproc={cfg.learner.nproc} ranks")
        self.proc: subprocess.Popen | None = None

    def start(self) -> subprocess.Popen:
        env = dict(os.environ)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # don't spin on cores the servers need
        env["PYTHONUNBUFFERED"] = "1"
        if self.weight_sync == "nccl":
            env.setdefault("NCCL_CUMEM_ENABLE", "0")  # see launcher.LocalServer.environment
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpus)
        log = self.log_path.open("ab")
        # Our own first line: a learner that dies before it logs anything still leaves its command here.
        log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} agentloop train: starting the learner: "
                  f"{shlex.join(self.cmd)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        log.close()
        return self.proc

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                return self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.poll()


def learner_command(
    run_dir: str | Path,
    model_path: str | Path,
    *,
    nproc: int = 1,
    config: str | Path | None = None,
    overrides: list[str] | None = None,
    resume: bool = True,
    python: str = sys.executable,
) -> list[str]:
    """argv that launches the mailbox learner: torchrun for nproc > 1, plain python otherwise."""
    if nproc > 1:
        cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "agentloop.train.learner"]
    else:
        cmd = [python, "-m", "agentloop.train.learner"]
    cmd += ["--run-dir", str(run_dir), "--model", str(model_path)]
    if config is not None:
        cmd += ["--config", str(config)]
    for ov in overrides or []:
        cmd += ["--set", ov]
    if not resume:
        cmd.append("--no-resume")
    return cmd
