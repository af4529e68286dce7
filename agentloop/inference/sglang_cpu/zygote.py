"""A fork server for CPU SGLang servers: it imports SGLang once and forks each server from that process.

A CPU server's start is mostly importing SGLang (~30 s of CPU on the 2-core box, GPU libraries included), paid again
by every server a run or a test starts. The zygote pays it once: `python -m agentloop.inference.sglang_cpu.zygote
--socket PATH` imports what a server needs, then forks one server per request on a UNIX socket; the forked process
runs SGLang's own launcher (`launch_server.run`) exactly as a spawned one would. `launcher.LocalServer` asks the zygote
named by `AGENTLOOP_SGLANG_ZYGOTE` for its CPU servers and spawns them itself when there is none, when the zygote does
not answer, or when the server's environment differs from the zygote's in a variable read at import time (`_FIXED`).
The test suite starts one for its session (tests/conftest.py); a user may start one for repeated CPU runs.

Map:
    start           start a zygote for the servers this process would start (the test session's fixture does)
    serve           the zygote: prepare, bind, then accept requests and fork; reaps its children, kills a server
                    whose requester died (what PR_SET_PDEATHSIG does for a spawned one), kills all at its own end
    forked.py       the client: `spawn` asks for one server, a `ForkedProcess` watches it (LocalServer uses them)

A forked server is the leader of its own session (process group), so LocalServer's stop() and kill() reach SGLang's
children as for a spawned one; it dies with the zygote (PR_SET_PDEATHSIG) and with the process that asked for it.
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
from pathlib import Path

from agentloop.inference.sglang_cpu.forked import ENV, ForkedProcess, pid_file, spawn, status_dir

__all__ = ["ENV", "ForkedProcess", "serve", "server_environment", "spawn", "start"]

_FIXED = ("SGLANG_", "OMP_", "MKL_", "KMP_", "MALLOC_", "LD_", "CUDA_", "NCCL_", "TORCH", "HF_", "TRANSFORMERS_",
          "TOKENIZERS_", "OPENBLAS_", "GLIBC_", "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONUNBUFFERED",
          "PYTHONWARNINGS", "PYTHONMALLOC", "PYTHONOPTIMIZE", "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONSAFEPATH",
          "PYTHONNOUSERSITE", "PYTHONDEVMODE", "PYTHONFAULTHANDLER", "PYTHONTRACEMALLOC")
"""Prefixes of the variables a process reads at start or at import (the allocator, OpenMP, SGLang's flags, the hub's
offline switch, the interpreter's start-up settings; not PYTHONBREAKPOINT, which Ray's workers set and Python reads at
each breakpoint()): a request whose values differ from the zygote's is not forked. OMP_NUM_THREADS is the exception: the
forked server sets torch's thread count from it; the allocator's settings are the others (`_MALLOPT`)."""


_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_MMAP_MAX_": -4,
            "MALLOC_ARENA_TEST": -7, "MALLOC_ARENA_MAX": -8}
"""glibc's allocator settings a forked server applies itself (mallopt; glibc reads them from the environment only at
a process's start): a server's may differ from the zygote's when the zygote has none (LoRA servers set two)."""


def _fixed(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_FIXED) and k != "OMP_NUM_THREADS" and k not in _MALLOPT}


def _mallopt(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k in _MALLOPT}


def server_environment() -> dict[str, str]:
    """The environment this process's CPU servers start with (LocalServer's, from ours)."""
    from agentloop.inference.launcher import LocalServer

    return LocalServer("-", device="cpu").environment()


def start(sock_path: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """Start a zygote on `sock_path` for the CPU servers this process (and those inheriting its environment) would
    start; it dies with this process. Requesters may ask at once: they wait for its imports (its pid file is written
    here)."""
    from agentloop.inference.launcher import _arm_parent_death_signal

    sock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", __name__, "--socket", str(sock_path)], env=server_environment(),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=_arm_parent_death_signal)
    pid_file(sock_path).write_text(str(proc.pid))
    return proc


# ---------------------------------------------------------------- the zygote


def _preload() -> None:
    """What every CPU server imports before it serves, in the zygote's process, once."""
    from agentloop.inference.sglang_cpu import launch_server

    launch_server.prepare(fork_children=True)
    # what sglang.launch_server imports (runpy runs that module itself, so it is not imported here), the HTTP server,
    # the managers (the scheduler's and detokenizer's come with prepare), the model
    import sglang.srt.arg_groups.overrides
    import sglang.srt.entrypoints.http_server
    import sglang.srt.managers.tokenizer_manager
    import sglang.srt.models.qwen2
    import sglang.srt.plugins
    import sglang.srt.server_args  # noqa: F401
    import transformers.models.qwen2  # noqa: F401


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


class _Zygote:
    def __init__(self, sock_path: Path, env: dict[str, str], threads: int):
        self.sock_path = sock_path
        self.env = env
        """The zygote's environment before its imports (what a spawned server starts with)."""
        self.added = {k: v for k, v in os.environ.items() if k not in env}
        """What the imports set (SGLang sets cache paths): a forked server has them as a spawned one would."""
        self.threads = threads
        """Native threads the imports started (torch's, SGLang's; the same ones a spawned server's launcher has when
        it forks SGLang's children; some end at the first fork): more later would mean something runs beside the
        loop."""
        self.children: set[int] = set()
        """The servers forked and not reaped yet."""
        self.owners: dict[int, tuple[int, set[int]]] = {}
        """owner pid -> (its pidfd, the servers it asked for)."""
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)

    def refuse(self, request: dict) -> str | None:
        env = request.get("env", {})
        want, have = _fixed(env), _fixed(self.env)
        if want != have:
            diff = {k: (want.get(k), have.get(k)) for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k)}
            return f"environment differs from the zygote's (the server's value, the zygote's): {diff}"[:2000]
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
        # the server: no return from here
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
            try:
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            except OSError:
                pass
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(null)
            os.close(log)
            try:  # `ps` shows what a spawned server shows, not the zygote's command line (before environ changes)
                import setproctitle

                module = "agentloop.inference.sglang_cpu.launch_server"
                setproctitle.setproctitle(" ".join([sys.executable, "-m", module, *request["argv"]]))
            except ImportError:
                pass
            os.chdir(request["cwd"])
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
            from agentloop.inference.sglang_cpu import launch_server

            launch_server.run(list(request["argv"]))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - a forked server must never return into the zygote's loop
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
                       "since could hold a lock the forked server would inherit held")
            if why is not None:
                print(f"agentloop zygote: refused a server for {request.get('owner')}: {why}", flush=True)
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
            return  # owner already gone (the reap below kills its server) or no pidfd: the server outlives it
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
            _killpg(pid)  # what is left of its group (SGLang's children arm their own death signal too)
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


def serve(sock_path: Path) -> None:
    """Import, then listen on `sock_path` until SIGTERM; every server forked dies with the zygote."""
    sock_path.unlink(missing_ok=True)
    pid_file(sock_path).write_text(str(os.getpid()))  # requesters wait while this process imports
    status_dir(sock_path).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    _preload()
    tmp = sock_path.with_name(sock_path.name + ".binding")
    tmp.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp))
    listener.listen(64)
    tmp.replace(sock_path)  # the socket appears only once the zygote can answer
    try:
        _Zygote(sock_path, env, _threads()).serve(listener)
    finally:
        listener.close()
        sock_path.unlink(missing_ok=True)
        pid_file(sock_path).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m agentloop.inference.sglang_cpu.zygote", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--socket", required=True, type=Path, help="the UNIX socket to listen on")
    args = parser.parse_args(argv)
    env = server_environment()
    if _fixed(env) != _fixed(dict(os.environ)) and "_AGENTLOOP_ZYGOTE_EXEC" not in os.environ:
        # run with what a CPU server's launch is given (or every request would be refused); once
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *(sys.argv[1:] if argv is None else argv)],
                  {**env, "_AGENTLOOP_ZYGOTE_EXEC": "1"})
    serve(args.socket.resolve())


if __name__ == "__main__":
    main()
