"""The learner on this host: LearnerProcess, the learner ranks as one child process group of `agentloop
train` (torchrun for nproc > 1), its output in run_dir/learner.log, a bounded shutdown, and death with the
orchestrator; FileLearner, the learner handle (agentloop.train.handle.protocol) over that process and the file mailbox.

learner.log opens with the command line (written here), then holds the learner's own lines (rank 0's
progress, every rank's warnings and errors: see agentloop.train.trainer.serve) and anything its libraries print.

The orchestrator never imports the learner (FSDP, the model): it starts it by command line and talks to it
through the mailbox; `learner_command` is that command line. Spanning hosts without Ray: `learner.nnodes` > 1
runs torchrun's own rendezvous (`learner.rdzv_endpoint`), one `agentloop learner-node` per further host, all
on a run dir every host sees (docs/cluster.md, "Beyond one machine").
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agentloop.config import Config
from agentloop.errors import ConfigError
from agentloop.train.handle.launch import ZYGOTE_ENV, learner_environment
from agentloop.train.handle.mailbox import MailboxClient, MailboxPaths
from agentloop.train.handle.protocol import FinalResult, LearnerHandle, LearnerInfo, LearnerTimeout, WeightsOnDisk
from agentloop.util.forked import ForkedProcess
from agentloop.util.forked import spawn as forked_spawn
from agentloop.util.rundir import write_json
from agentloop.util.zygote import die_with_parent

_die_with_parent = functools.partial(die_with_parent, signal.SIGTERM)
"""preexec_fn: SIGTERM the learner when the orchestrator dies, even by SIGKILL (Linux; best effort).

The learner runs in a session of its own (a Ctrl-C must not reach it before STOP does), so a kill of the
orchestrator's process group would otherwise leave it training, and a resumed run would start a second learner on the
same run dir. SIGTERM rather than SIGKILL so that torchrun (nproc > 1) still stops its ranks, which it starts in
sessions of their own."""


class LearnerProcess:
    """The learner ranks as one child process group, with its output in run_dir/learner.log."""

    def __init__(self, cfg: Config, run_dir: Path, model_path: Path):
        self.node_args = {"run_dir": str(run_dir), "model_path": str(model_path), "nproc": cfg.learner.ranks_per_node,
                          "nnodes": cfg.learner.nnodes, "rdzv_endpoint": cfg.learner.rdzv_endpoint,
                          "rdzv_id": rdzv_id(run_dir),
                          # outlasts the run's own wait for the learner, whose timeout names the missing nodes
                          "rdzv_join_timeout_s": cfg.train.learner_ready_timeout_s + 60,
                          "config": str(run_dir / "config.yaml"),
                          "resume": cfg.train.resume}
        """learner_command's arguments: every node of a multi-node learner runs the same (`node_command`)."""
        self.cmd = learner_command(**self.node_args)
        self.log_path = run_dir / "learner.log"
        self.weight_sync = cfg.learner.weight_sync
        self.gpus = cfg.learner.gpus
        if self.gpus is not None and len(self.gpus) < cfg.learner.ranks_per_node:
            raise ConfigError(f"learner.gpus={self.gpus} has fewer GPUs than the {cfg.learner.ranks_per_node} ranks "
                              f"of this host (learner.ranks={cfg.learner.world_size}, "
                              f"learner.nnodes={cfg.learner.nnodes})")
        self.proc: subprocess.Popen | ForkedProcess | None = None
        """The learner: spawned, or forked by a zygote (agentloop.train.handle.launch)."""

    def start(self) -> subprocess.Popen | ForkedProcess:
        if self.node_args["nnodes"] > 1:
            # what `agentloop learner-node --run-dir RUN_DIR` starts on each other node
            write_json(Path(self.node_args["run_dir"]) / NODE_FILE, self.node_args)
        env = learner_environment(os.environ, weight_sync=self.weight_sync, gpus=self.gpus)
        log = self.log_path.open("ab")
        # Our own first line: a learner that dies before it logs anything still leaves its command here.
        log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} agentloop train: starting the learner: "
                  f"{shlex.join(self.cmd)}\n".encode())
        log.flush()
        forked = self._forked(env)
        if isinstance(forked, str) and forked:  # a zygote is named: say why it did not fork this one
            log.write(f"# agentloop: spawned, not forked: {forked}\n".encode())
            log.flush()
        if not isinstance(forked, str):
            self.proc = forked
        else:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True,
                                         preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        log.close()
        return self.proc

    def _forked(self, env: dict[str, str]) -> ForkedProcess | str:
        """A one-rank learner forked by the zygote named in the environment (agentloop.train.handle.launch), or why
        not ('' when none is named, or for torchrun's ranks, which are always spawned)."""
        if self.cmd[1:3] != ["-m", "agentloop.train.trainer"]:
            return ""
        return forked_spawn(ZYGOTE_ENV, self.cmd[3:], env, self.log_path, python=self.cmd[0])

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


NODE_FILE = "learner_node.json"
"""In the run dir of a learner spanning hosts (learner.nnodes > 1): learner_command's arguments, read by
`agentloop learner-node` on the other hosts."""


def rdzv_id(run_dir: str | Path) -> str:
    """torchrun's rendezvous id of a run's learner: the same on every node, new for every run dir."""
    import hashlib

    return "agentloop-" + hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def learner_command(
    run_dir: str | Path,
    model_path: str | Path,
    *,
    nproc: int = 1,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    rdzv_join_timeout_s: float | None = None,
    config: str | Path | None = None,
    overrides: list[str] | None = None,
    resume: bool = True,
    python: str = sys.executable,
) -> list[str]:
    """argv that launches the mailbox learner: torchrun for nproc > 1 (one host) or nnodes > 1 (this host's share,
    joining torchrun's c10d rendezvous at `rdzv_endpoint`, waiting `rdzv_join_timeout_s` for the other nodes (None:
    torchrun's 600 s); every node runs the same command), plain python otherwise."""
    if nnodes > 1:
        if not rdzv_endpoint:
            raise ConfigError(f"a learner over {nnodes} nodes needs learner.rdzv_endpoint=HOST:PORT")
        cmd = [python, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id or 'agentloop'}",
               "--max-restarts=0"]
        if rdzv_join_timeout_s is not None:
            cmd.append(f"--rdzv-conf=join_timeout={int(rdzv_join_timeout_s)}")
        cmd += ["-m", "agentloop.train.trainer"]
    elif nproc > 1:
        cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "agentloop.train.trainer"]
    else:
        cmd = [python, "-m", "agentloop.train.trainer"]
    cmd += ["--run-dir", str(run_dir), "--model", str(model_path)]
    if config is not None:
        cmd += ["--config", str(config)]
    for ov in overrides or []:
        cmd += ["--set", ov]
    if not resume:
        cmd.append("--no-resume")
    return cmd


def _info(d: dict[str, Any]) -> LearnerInfo:
    return LearnerInfo(next_step=int(d.get("next_step") or 1), resumed_step=d.get("resumed_step"),
                       data_position=d.get("data_position"), world_size=int(d.get("world_size") or 1),
                       layout=dict(d.get("layout") or {}), probe=d.get("probe"))


class FileLearner(LearnerHandle):
    """The learner handle of one host (or a shared filesystem): a learner process (LearnerProcess, or none when
    someone else runs it: liveness by heartbeat then) and the file mailbox in the run dir. Blocking mailbox
    waits run in threads, off the event loop."""

    def __init__(self, run_dir: Path, *, process: LearnerProcess | None = None, poll_s: float = 0.2,
                 heartbeat_timeout_s: float = 120.0):
        self.run_dir = Path(run_dir)
        self.process = process
        self.client = MailboxClient(run_dir, poll_s=poll_s, heartbeat_timeout_s=heartbeat_timeout_s)
        self.paths = MailboxPaths(self.run_dir)
        self._started: float | None = None

    @classmethod
    def for_run(cls, cfg: Config, run_dir: Path, model_path: Path) -> FileLearner:
        return cls(run_dir, process=LearnerProcess(cfg, run_dir, model_path))

    async def start(self) -> None:
        self._started = time.time()
        if self.process is not None:
            self.client.process = self.process.start()

    async def wait_ready(self, timeout_s: float) -> LearnerInfo:
        since = None if self._started is None or self.process is None else self._started - 1
        try:
            return _info(await asyncio.to_thread(self.client.wait_ready, timeout_s, since=since))
        except LearnerTimeout as e:
            n = 1 if self.process is None else self.process.node_args["nnodes"]
            if n == 1:
                raise
            # the usual cause: this node's ranks wait in the rendezvous for nodes nobody started
            raise LearnerTimeout(
                f"{e}; the learner spans {n} hosts and its ranks wait in torchrun's rendezvous at "
                f"{self.process.node_args['rdzv_endpoint']} for all of them: run `agentloop learner-node --run-dir "
                f"{self.run_dir}` on each of the other {n - 1} (the run dir on a filesystem they share)") from e

    async def wait_caught_up(self, step_timeout_s: float) -> LearnerInfo:
        return _info(await asyncio.to_thread(self.client.wait_caught_up, step_timeout_s))

    def submitted(self, step: int) -> bool:
        return self.client.submitted(step)

    async def submit(self, step: int, batch: Any, *, data_position: Any = None) -> None:
        await asyncio.to_thread(self.client.submit, step, batch, data_position=data_position)

    async def wait_update_or_sync(self, step: int, timeout_s: float) -> Any:
        return await asyncio.to_thread(self.client.wait_update_or_sync, step, timeout_s)

    async def allow_sync(self, step: int, order: Any) -> None:
        await asyncio.to_thread(self.client.allow_sync, order)

    async def wait_update(self, step: int, timeout_s: float) -> Any:
        return await asyncio.to_thread(self.client.wait_update, step, timeout_s)

    async def finished_metrics(self, step: int) -> dict[str, float] | None:
        return await asyncio.to_thread(self.client.finished_metrics, step)

    async def weights(self, step: int) -> WeightsOnDisk | None:
        d = self.paths.weights(step)
        return WeightsOnDisk(str(d)) if d.is_dir() else None

    async def stop(self, *, final: bool = False) -> None:
        self.client.stop(final=final)

    async def wait_final(self, timeout_s: float) -> FinalResult:
        done = await asyncio.to_thread(self.client.wait_final, timeout_s)
        return FinalResult(step=done.get("step"), weights_dir=done.get("weights_dir"),
                           checkpoint=done.get("checkpoint"))

    async def failure_context(self) -> str:
        if self.process is None:
            return ""
        return f"--- learner.log tail ---\n{await asyncio.to_thread(self.process.log_tail)}"

    def where(self) -> str:
        if self.process is None:
            return f"learner mailbox: {self.run_dir / 'mailbox'}"
        n = self.process.node_args["nnodes"]
        more = (f"; the learner spans {n} hosts: run `agentloop learner-node --run-dir {self.run_dir}` on each of the "
                f"other {n - 1}" if n > 1 else "")
        return f"learner log: {self.process.log_path}{more}"

    async def close(self) -> int | None:
        if self.process is None:
            return None
        proc = self.process.proc
        if proc is not None and proc.poll() is None:
            self.client.stop()
        return await asyncio.to_thread(self.process.stop)



def node_command(run_dir: str | Path, python: str = sys.executable) -> list[str]:
    """The learner command of one more node of a run whose learner spans hosts (`agentloop learner-node`): what the
    run's first node runs, read from the run dir (on the shared filesystem), with this host's python."""
    f = Path(run_dir) / NODE_FILE
    try:
        args = json.loads(f.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{f} is missing: start `agentloop train` with learner.nnodes > 1 on the first node first "
                          "(it writes it), and give every node the same run dir (a shared filesystem)") from None
    return learner_command(**args, python=python)
