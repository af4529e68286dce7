"""The client side of a zygote (agentloop.util.zygote): ask the one an environment variable names for a process, and
watch it through what a caller needs of a Popen. Standard library only: the launcher and the learner's process
manager import it, before anything heavy.

Map:
    spawn           ask the zygote named by an environment variable for one process: a ForkedProcess, or why not
    ForkedProcess   pid, poll, wait, returncode of a process this one did not fork: the exit status comes from a file
                    the zygote writes when it reaps the process
    pid_file, status_dir   the files beside a zygote's socket
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

_REPLY_TIMEOUT_S = 600.0
"""How long a requester waits for the zygote's answer: the first request waits out the zygote's imports (a guard
against a hang, not a verdict on the machine's speed)."""


class ForkedProcess:
    """A process a zygote forked, seen through the subset of `subprocess.Popen` its callers use."""

    def __init__(self, pid: int, status_path: Path, zygote_pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._status = status_path
        self._zygote_pid = zygote_pid

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._status.read_text())
            except (FileNotFoundError, ValueError):
                if not _alive(self._zygote_pid) and not _alive(self.pid):
                    self.returncode = -signal.SIGKILL  # the zygote died first and took the process with it
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"zygote-forked process {self.pid}", timeout)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def spawn(env_var: str, argv: list[str], env: dict[str, str], log_path: Path,
          python: str | None = None) -> ForkedProcess | str:
    """Ask the zygote whose socket the environment variable `env_var` names for a process running its program on
    `argv`, with `env`, this process's working directory, and stdout and stderr appended to `log_path`, in place of
    `python -m MODULE ARGV` run by `python` (default: ours; the zygote refuses another interpreter). Otherwise why
    not ('' when no zygote is named): it is gone, or `env` differs from its environment where it matters; the caller
    then spawns the process itself."""
    path = os.environ.get(env_var)
    if not path:
        return ""
    if not _ready(Path(path)):
        return f"no zygote at {path}"
    request = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log_path), "owner": os.getpid(),
               "python": python or sys.executable}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(_REPLY_TIMEOUT_S)
            s.connect(path)
            s.sendall(json.dumps(request).encode() + b"\n")
            reply = json.loads(s.makefile("rb").readline() or b"{}")
    except (OSError, ValueError) as e:  # a stale socket file, or it died while answering
        return f"the zygote at {path} did not answer: {type(e).__name__}: {e}"
    if "pid" not in reply:
        return f"the zygote at {path} refused: {reply.get('error', reply)}"
    return ForkedProcess(int(reply["pid"]), Path(reply["status"]), int(reply["zygote"]))


def _ready(sock_path: Path) -> bool:
    """The socket is there, or appears while its zygote (the pid file beside it) still imports."""
    deadline = time.monotonic() + _REPLY_TIMEOUT_S
    while not sock_path.exists():
        try:
            pid = int(pid_file(sock_path).read_text())
        except (OSError, ValueError):
            return False
        if not _alive(pid) or time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def pid_file(sock_path: Path) -> Path:
    """Where a zygote's pid is written, first thing (whoever starts one may write it sooner: requesters wait for the
    socket while that process lives)."""
    return sock_path.with_name(sock_path.name + ".pid")


def status_dir(sock_path: Path) -> Path:
    """Where the zygote writes the exit status of each process it reaped (a file named by its pid)."""
    return sock_path.with_name(sock_path.name + ".exit")
