"""A zygote: a fork server that imports a program's modules once, then forks one process per request.

A process whose start is mostly imports (a CPU SGLang server: ~30 s of CPU on the 2-core box; the learner: ~8 s of
torch and transformers) pays them again each time it starts. A zygote pays them once: it imports what its `Program`
needs, then listens on a UNIX socket and forks one process per request; the forked process runs the program's own
entry point exactly as a spawned one would, with the requester's argv, environment, working directory and log. The
client is agentloop.util.forked (`spawn`). The programs: agentloop.inference.sglang_cpu.zygote (CPU SGLang servers)
and agentloop.train.trainer.zygote (the one-rank learner). The test suite starts one of each (tests/conftest.py).

Map:
    Program         what a zygote imports once (preload) and what a forked process runs (run)
    serve           the zygote: preload, bind, then accept requests and fork; reaps its children, kills a process
                    whose requester died (what PR_SET_PDEATHSIG does for a spawned one), kills all at its own end
    main            the command line: `--socket PATH`, re-exec'd once with the environment its processes need

A forked process leads its own session (process group), so killing its group reaches its children as for a spawned
one; it dies with the zygote (PR_SET_PDEATHSIG) and with the process that asked for it (the zygote watches its pidfd).
A request is refused (the requester then spawns the process itself) when its environment differs from the zygote's in
a variable read at start (`_FIXED`), or when a thread started in the zygote since its imports.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agentloop.util.forked import pid_file, status_dir

__all__ = ["Program", "die_with_parent", "main", "serve", "start"]

_FIXED = ("SGLANG_", "OMP_", "MKL_", "KMP_", "MALLOC_", "LD_", "CUDA_", "NCCL_", "TORCH", "HF_", "TRANSFORMERS_",
          "TOKENIZERS_", "OPENBLAS_", "GLIBC_", "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONUNBUFFERED",
          "PYTHONWARNINGS", "PYTHONMALLOC", "PYTHONOPTIMIZE", "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONSAFEPATH",
          "PYTHONNOUSERSITE", "PYTHONDEVMODE", "PYTHONFAULTHANDLER", "PYTHONTRACEMALLOC")
"""Prefixes of the variables a process reads at start or at import (the allocator, OpenMP, SGLang's flags, the hub's
offline switch, the interpreter's start-up settings; not PYTHONBREAKPOINT, which Ray's workers set and Python reads at
each breakpoint()): a request whose values differ from the zygote's is not forked. OMP_NUM_THREADS is the exception: the
forked process sets torch's thread count from it; the allocator's settings are the others (`_MALLOPT`)."""


_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_MMAP_MAX_": -4,
            "MALLOC_ARENA_TEST": -7, "MALLOC_ARENA_MAX": -8}
"""glibc's allocator settings a forked process applies itself (mallopt; glibc reads them from the environment only at
a process's start): a request's may differ from the zygote's when the zygote has none (LoRA servers set two)."""


_READ_WHEN_USED = frozenset({"TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH"})
"""Under `_FIXED`'s prefixes but read when used, not at start (inductor's cache at its first compile, CUDA's at its
first kernel, neither of which a zygote reaches): a forked process reads the request's value. torch and SGLang write
them into the environment of the process that asks (their defaults), so comparing them refused every request of an
`agentloop train` started by hand."""


def _fixed(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_FIXED) and k != "OMP_NUM_THREADS" and k not in _MALLOPT
            and k not in _READ_WHEN_USED}


def _mallopt(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k in _MALLOPT}


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent dies (PR_SET_PDEATHSIG; Linux with glibc, best
    effort). A preexec_fn for a child that must not outlive what started it, even a SIGKILLed parent."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass  # not glibc Linux: the caller's own stop still applies


@dataclass(frozen=True)
class Program:
    """What a zygote serves."""

    module: str
    """The module a spawned process runs (`python -m MODULE ARGV`): what `ps` shows for a forked one."""
    preload: Callable[[], None]
    """Imports what every process of the program imports before it works, in the zygote, once."""
    run: Callable[[list[str]], None]
    """Runs the program on ARGV in the forked process, as `python -m MODULE ARGV` would."""


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


class _Zygote:
    def __init__(self, program: Program, sock_path: Path, env: dict[str, str], threads: int):
        self.program = program
        self.sock_path = sock_path
        self.cwd = os.getcwd()
        self.env = env
        """The zygote's environment before its imports (what a spawned process starts with)."""
        self.added = {k: v for k, v in os.environ.items() if k not in env}
        """What the imports set (SGLang sets cache paths): a forked process has them as a spawned one would."""
        self.threads = threads
        """Native threads the imports started (torch's, SGLang's; the same ones a spawned process has at that point;
        some end at the first fork): more later would mean something runs beside the loop."""
        self.children: set[int] = set()
        """The processes forked and not reaped yet."""
        self.owners: dict[int, tuple[int, set[int]]] = {}
        """owner pid -> (its pidfd, the processes it asked for)."""
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)

    def refuse(self, request: dict) -> str | None:
        if request.get("python", sys.executable) != sys.executable:
            return f"another interpreter ({request['python']}; the zygote runs {sys.executable})"
        env = request.get("env", {})
        want, have = _fixed(env), _fixed(self.env)
        if want != have:
            diff = {k: (want.get(k), have.get(k)) for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k)}
            return f"environment differs from the zygote's (the request's value, the zygote's): {diff}"[:2000]
        alloc = _mallopt(env)
        if _mallopt(self.env) and alloc != _mallopt(self.env):
            return f"allocator settings differ from the zygote's own {_mallopt(self.env)}"
        try:
            [int(v) for v in alloc.values()]
        except ValueError:
            return f"allocator settings that are not numbers: {alloc}"
        return None

    def fork(self, request: dict, listener: socket.socket, conn: socket.socket) -> int:
        pid = os.fork()
        if pid:
            return pid
        # the forked process: no return from here
        code = 1
        try:
            listener.close()
            conn.close()
            self.sel.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.set_wakeup_fd(-1)
            os.setsid()
            die_with_parent()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(null)
            os.close(log)
            try:  # `ps` shows what a spawned process shows, not the zygote's command line (before environ changes)
                import setproctitle

                setproctitle.setproctitle(" ".join([sys.executable, "-m", self.program.module, *request["argv"]]))
            except ImportError:
                pass
            os.chdir(request["cwd"])
            if sys.path and sys.path[0] == self.cwd:  # `python -m` puts its working directory first
                sys.path[0] = os.getcwd()
            os.environ.clear()
            os.environ.update(request["env"])
            for k, v in self.added.items():
                os.environ.setdefault(k, v)
            import tempfile

            tempfile.tempdir = None  # TMPDIR is the requester's
            if _mallopt(os.environ) and not _mallopt(self.env):
                libc = ctypes.CDLL("libc.so.6", use_errno=True)
                for k, v in _mallopt(os.environ).items():
                    libc.mallopt(_MALLOPT[k], int(v))
            if "OMP_NUM_THREADS" in os.environ:
                import torch

                torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
            print(f"agentloop: forked by the zygote {os.getppid()} ({self.sock_path})", flush=True)
            self.program.run(list(request["argv"]))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - a forked process must never return into the zygote's loop
            traceback.print_exc()
        finally:
            try:
                import atexit

                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
        raise AssertionError("unreachable")

    def serve(self, listener: socket.socket) -> None:
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)
        self.sel.register(listener, selectors.EVENT_READ, "accept")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "signal")
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        signal.signal(signal.SIGINT, lambda *_: stop.append(1))
        while not stop:
            for key, _ in self.sel.select(timeout=1.0):
                if key.data == "accept":
                    self.accept(listener)
                elif key.data == "signal":
                    try:
                        os.read(self.wake_r, 512)
                    except BlockingIOError:
                        pass
                else:
                    self.owner_died(key.data)
            self.reap()
        for pid in list(self.children):
            _killpg(pid)
        deadline = time.monotonic() + 10
        while self.children and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.05)

    def accept(self, listener: socket.socket) -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(30)
            try:
                request = json.loads(conn.makefile("rb").readline())
            except (OSError, ValueError):
                return
            why = self.refuse(request)
            if why is None and (threading.active_count() != 1 or _threads() > self.threads):
                why = (f"the zygote runs {_threads()} threads, {self.threads} after its imports: a thread started "
                       "since could hold a lock the forked process would inherit held")
            if why is not None:
                print(f"agentloop zygote: refused a process for {request.get('owner')}: {why}", flush=True)
                conn.sendall(json.dumps({"error": why}).encode() + b"\n")
                return
            pid = self.fork(request, listener, conn)
            self.children.add(pid)
            self.watch_owner(int(request["owner"]), pid)
            status = status_dir(self.sock_path) / str(pid)
            status.unlink(missing_ok=True)
            try:
                conn.sendall(json.dumps({"pid": pid, "zygote": os.getpid(), "status": str(status)}).encode() + b"\n")
            except OSError:
                _killpg(pid)  # its requester is gone

    def watch_owner(self, owner: int, pid: int) -> None:
        if owner in self.owners:
            self.owners[owner][1].add(pid)
            return
        try:
            fd = os.pidfd_open(owner)
        except (OSError, AttributeError):
            return  # owner already gone (the reap below kills its process) or no pidfd: the process outlives it
        self.owners[owner] = (fd, {pid})
        self.sel.register(fd, selectors.EVENT_READ, owner)

    def owner_died(self, owner: int) -> None:
        fd, pids = self.owners.pop(owner)
        self.sel.unregister(fd)
        os.close(fd)
        for pid in pids:
            if pid in self.children:
                _killpg(pid)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid not in self.children:
                continue
            self.children.remove(pid)
            _killpg(pid)  # what is left of its group
            code = os.waitstatus_to_exitcode(status)
            path = status_dir(self.sock_path) / str(pid)
            tmp = path.with_name(f"{pid}.tmp")
            try:
                tmp.write_text(str(code))
                tmp.replace(path)
            except OSError:
                pass


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def serve(program: Program, sock_path: Path) -> None:
    """Import, then listen on `sock_path` until SIGTERM; every process forked dies with the zygote."""
    sock_path.unlink(missing_ok=True)
    pid_file(sock_path).write_text(str(os.getpid()))  # requesters wait while this process imports
    status_dir(sock_path).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    program.preload()
    tmp = sock_path.with_name(sock_path.name + ".binding")
    tmp.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp))
    listener.listen(64)
    tmp.replace(sock_path)  # the socket appears only once the zygote can answer
    try:
        _Zygote(program, sock_path, env, _threads()).serve(listener)
    finally:
        listener.close()
        sock_path.unlink(missing_ok=True)
        pid_file(sock_path).unlink(missing_ok=True)


def start(zygote_module: str, sock_path: Path, log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start the zygote `python -m ZYGOTE_MODULE --socket SOCK_PATH` with `env` (what its program's processes are
    started with), its output appended to `log_path`; it dies with this process. Requesters may ask at once: they
    wait for its imports (its pid file is written here)."""
    sock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", zygote_module, "--socket", str(sock_path)], env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent)
    pid_file(sock_path).write_text(str(proc.pid))
    return proc


def main(program: Program, *, zygote_module: str, environment: dict[str, str] | None, doc: str | None,
         argv: list[str] | None = None) -> None:
    """The command line of the zygote `python -m ZYGOTE_MODULE --socket PATH`, serving `program`: re-exec'd once with
    `environment` (what the program's processes are started with) when it differs from ours in a variable read at
    start, as every request would be refused otherwise."""
    parser = argparse.ArgumentParser(prog=f"python -m {zygote_module}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--socket", required=True, type=Path, help="the UNIX socket to listen on")
    args = parser.parse_args(argv)
    if (environment is not None and _fixed(environment) != _fixed(dict(os.environ))
            and "_AGENTLOOP_ZYGOTE_EXEC" not in os.environ):
        os.execve(sys.executable, [sys.executable, "-m", zygote_module, *(sys.argv[1:] if argv is None else argv)],
                  {**environment, "_AGENTLOOP_ZYGOTE_EXEC": "1"})
    serve(program, args.socket.resolve())
