"""Run untrusted Python in a contained subprocess, asynchronously.

    SandboxLimits   the limits of one run (wall, CPU, memory, processes, file size, disk, output)
    SandboxResult   what happened: captured output, exit code/signal, why it was stopped
    run_python      `await run_python(code, limits)`: the one entry point

What contains what (see sandbox_launcher.py for the child side):

    threat                      containment (as root)                       fallback (not root / no namespaces)
    endless loop                wall timeout: the process group is SIGKILLed   same
                                RLIMIT_CPU: SIGXCPU, then SIGKILL              same
    huge allocation             RLIMIT_AS -> MemoryError                       same
    fork bomb                   own uid per run + RLIMIT_NPROC; pid namespace   RLIMIT_NPROC counts the caller's uid;
                                (pid 1 exits -> all its descendants die)        process group killed at the end
    huge output                 read at most `max_output_bytes` per stream,     same
                                then kill; the text says "output truncated"
    network                     new network namespace: no interface at all     `socket` is replaced in a preamble
                                                                                (pure-Python code only; documented weak)
    reading our secrets         scrubbed environment (PATH, HOME, LANG, ...);  scrubbed environment
                                other uid cannot read /proc/<ours>/environ
    writing outside its dir     every mount read-only in a private mount ns;   nothing (documented): it writes where
                                the work dir is a size-limited tmpfs; and it   the calling user may
                                runs as an unprivileged uid that owns nothing
    disk filling                tmpfs of `disk_limit_mb`; RLIMIT_FSIZE         RLIMIT_FSIZE per file only

RLIMIT_NPROC is not enforced for root, and it counts every process of a uid, so each run gets its own
uid (`uid_base + slot`, no passwd entry needed); concurrent runs therefore never share a process budget
and cannot signal each other. Files under the host work dir are removed afterwards in every mode.

The interpreter must be executable by that uid: by default the first of the running interpreter's real
path, `/usr/bin/python3`, `/usr/local/bin/python3` that every user can run (a venv under /root is not).

Simplifications: a MemoryError is detected from the program's stderr; RLIMIT_AS counts virtual memory,
so heavy native libraries (e.g. numpy's BLAS threads) need a generous `memory_limit_mb`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
import weakref
from pathlib import Path

from agentloop.tools.sandbox.limits import SandboxLimits, SandboxResult

logger = logging.getLogger(__name__)

LAUNCHER = Path(__file__).with_name("launcher.py")

_NETWORK_PREAMBLE = """\
import socket as _s
def _no_network(*a, **k):
    raise OSError(101, "network is disabled in this sandbox")
_s.socket = _no_network; _s.create_connection = _no_network; _s.socketpair = _no_network
del _s, _no_network
"""


# ------------------------------------------------------------------ uid slots and interpreter


class _UidPool:
    """Per-process pool of sandbox uids, so concurrent runs never share a uid."""

    def __init__(self) -> None:
        self._used: set[int] = set()
        self._next = 0

    def acquire(self, base: int) -> int:
        for _ in range(1000):
            slot = self._next
            self._next = (self._next + 1) % 1000
            if slot not in self._used:
                self._used.add(slot)
                return base + (os.getpid() % 10000) * 1000 + slot
        raise RuntimeError("more than 1000 concurrent sandbox runs in one process")

    def release(self, base: int, uid: int) -> None:
        self._used.discard((uid - base) % 1000)


_UIDS = _UidPool()
_PYTHON_CACHE: dict[bool, str] = {}


def _others_can_run(path: str) -> bool:
    p = Path(path)
    try:
        if not (p.stat().st_mode & stat.S_IXOTH):
            return False
        for parent in p.parents:
            if not (parent.stat().st_mode & stat.S_IXOTH):
                return False
    except OSError:
        return False
    return True


def pick_interpreter(as_other_uid: bool) -> str:
    """An interpreter the sandbox can execute (cached)."""
    if as_other_uid not in _PYTHON_CACHE:
        candidates = [os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"]
        found = None
        for c in candidates:
            if os.path.isfile(c) and (not as_other_uid or _others_can_run(os.path.realpath(c))):
                found = os.path.realpath(c)
                break
        if found is None:
            raise RuntimeError(
                f"no Python interpreter that an unprivileged uid can run among {candidates}; "
                "set tools.python.python to one")
        _PYTHON_CACHE[as_other_uid] = found
    return _PYTHON_CACHE[as_other_uid]


def _scrubbed_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
    }


# ------------------------------------------------------------------ the run


async def _read_capped(stream: asyncio.StreamReader, cap: int, buf: bytearray, on_overflow) -> None:
    overflowed = False
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return
        if overflowed:
            # Keep draining to EOF: a reader that stops leaves the transport paused, the pipe's EOF
            # is never seen, and on Python 3.11 Process.wait() then waits forever.
            continue
        room = cap - len(buf)
        if len(chunk) > room:
            buf.extend(chunk[:max(room, 0)])
            overflowed = True
            on_overflow()
            continue
        buf.extend(chunk)


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _uid_alive(uid: int) -> bool:
    """Whether any process of `uid` exists (scans /proc)."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as fh:
                    for line in fh:
                        if line.startswith("Uid:"):
                            if int(line.split()[1]) == uid:
                                return True
                            break
            except (OSError, ValueError, IndexError):
                continue  # exited while we looked
    return False


async def _reap_uid(uid: int, deadline_s: float = 3.0) -> bool:
    """Kill every process of `uid` and wait until none is left (True) or the deadline passes (False)."""
    end = time.monotonic() + deadline_s
    while True:
        await _kill_uid(uid)
        for _ in range(10):
            if not _uid_alive(uid):
                return True
            await asyncio.sleep(0.02)
        if time.monotonic() > end:
            return False


async def _kill_uid(uid: int) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", str(LAUNCHER), "--reap", str(uid),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        env={"PATH": "/usr/bin:/bin"})
    await proc.wait()


async def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` in a fresh sandbox and report what happened (never raises for the program's faults)."""
    limits = limits or SandboxLimits()
    as_root = os.geteuid() == 0 and limits.isolate
    if not as_root and "no_isolation" not in _SETUP_LOGGED:
        _SETUP_LOGGED.add("no_isolation")
        logger.warning("python sandbox without root isolation: rlimits, a scrubbed env and a socket preamble "
                       "only; writes outside the work dir are not prevented (see agentloop.tools.sandbox)")
    python = limits.python or pick_interpreter(as_root)
    uid = _UIDS.acquire(limits.uid_base) if as_root else None
    workdir = tempfile.mkdtemp(prefix="agentloop-sbx-")
    status_r, status_w = os.pipe()
    uid_leaked = False
    t0 = time.monotonic()
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        code_file = "main.py"
        # the preamble is harmless when the network namespace works, and the only guard when it does not
        Path(workdir, code_file).write_text(code)
        launcher_py = sys.executable
        argv = [python, "-B", "-s", "-c",
                _NETWORK_PREAMBLE + "import sys\nsys.argv = ['main.py']\n"
                "exec(compile(open('main.py', encoding='utf-8').read(), 'main.py', 'exec'), "
                "{'__name__': '__main__', '__file__': 'main.py'})"]
        spec = {
            "workdir": workdir, "code_file": code_file, "python": python, "argv": argv,
            "env": _scrubbed_env(workdir), "uid": uid, "gid": uid,
            "cpu_s": limits.cpu_s, "mem_bytes": limits.memory_limit_mb << 20, "nproc": limits.max_processes,
            "fsize_bytes": limits.max_file_mb << 20, "disk_bytes": limits.disk_limit_mb << 20,
            "isolate": as_root,
        }
        proc = await asyncio.create_subprocess_exec(
            launcher_py, "-I", "-S", str(LAUNCHER), json.dumps(spec), str(status_w),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            pass_fds=(status_w,), start_new_session=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        os.close(status_w)
        status_w = -1
        out, err = bytearray(), bytearray()
        overflow = asyncio.Event()
        assert proc.stdout is not None and proc.stderr is not None
        readers = [asyncio.create_task(_read_capped(proc.stdout, limits.max_output_bytes, out, overflow.set)),
                   asyncio.create_task(_read_capped(proc.stderr, limits.max_output_bytes, err, overflow.set))]
        waiter = asyncio.create_task(proc.wait())
        overflow_task = asyncio.create_task(overflow.wait())
        try:
            done, _ = await asyncio.wait({waiter, overflow_task}, timeout=limits.timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            overflow_task.cancel()
        timed_out = not done
        truncated = overflow.is_set()
        killed = timed_out or truncated or proc.returncode is None
        if killed:
            _killpg(proc.pid)
        await waiter
        if uid is not None and killed and not await _reap_uid(uid):
            logger.error("sandbox uid %d still has processes after SIGKILL; not reusing it", uid)
            uid_leaked = True
        # the pipes close once every process holding them is gone; bounded wait, then give up on them
        _, pending = await asyncio.wait(readers, timeout=2.0)
        for t in pending:
            t.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        wall = time.monotonic() - t0
        status = _read_status(status_r)
    finally:
        if status_w >= 0:
            os.close(status_w)
        os.close(status_r)
        shutil.rmtree(workdir, ignore_errors=True)
        if uid is not None and not uid_leaked:
            _UIDS.release(limits.uid_base, uid)
    return _classify(status, out, err, limits, timed_out=timed_out, truncated=truncated, wall=wall,
                     uid=uid)


def _read_status(fd: int) -> dict | None:
    os.set_blocking(fd, False)
    data = b""
    try:
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
    except BlockingIOError:
        pass  # a killed launcher wrote nothing
    try:
        return json.loads(data.decode().strip().splitlines()[0]) if data.strip() else None
    except (json.JSONDecodeError, IndexError):
        return None


_SETUP_LOGGED: set[str] = set()
_LAST_ISOLATION: list[str] = []
"""Isolation seen on the last run that reported it (a killed launcher reports nothing)."""


def _classify(status: dict | None, out: bytearray, err: bytearray, limits: SandboxLimits, *, timed_out: bool,
              truncated: bool, wall: float, uid: int | None) -> SandboxResult:
    stdout = out.decode("utf-8", errors="replace")
    stderr = err.decode("utf-8", errors="replace")
    isolation: list[str] = []
    exit_code = sig = None
    cpu = 0.0
    if status is not None:
        exit_code, sig, cpu = status.get("exit_code"), status.get("signal"), float(status.get("cpu_s", 0.0))
        for key, name in (("net", "net_namespace"), ("mount", "mount_namespace"), ("pid", "pid_namespace")):
            if status.get(key):
                isolation.append(name)
        if not status.get("net"):
            isolation.append("socket_preamble")
        msg = "; ".join(status.get("errors") or [])
        if msg and msg not in _SETUP_LOGGED:
            _SETUP_LOGGED.add(msg)
            logger.info("sandbox isolation is partial: %s", msg)
    if status is not None:
        _LAST_ISOLATION[:] = isolation
    else:
        isolation = list(_LAST_ISOLATION)
    if uid is not None:
        isolation.append("uid")
    if timed_out:
        reason = "timeout"
    elif truncated:
        reason = "output_limit"
    elif exit_code == 126 and "sandbox setup failed" in stderr:
        reason = "setup_error"
    elif sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= limits.cpu_s):
        reason = "cpu_limit"
    elif sig == signal.SIGXFSZ or (exit_code not in (0, None) and "File too large" in stderr):
        reason = "file_size_limit"
    elif exit_code not in (0, None) and "MemoryError" in stderr:
        reason = "memory_limit"
    elif sig is not None:
        reason = "killed"
    elif exit_code == 0:
        reason = "ok"
    else:
        reason = "error"
    return SandboxResult(stdout=stdout, stderr=stderr, exit_code=exit_code, signal=sig, timed_out=timed_out,
                         truncated=truncated, reason=reason, wall_s=wall, cpu_s=cpu, isolation=isolation)


# One concurrency cap per (event loop, user): a Semaphore belongs to the loop it first waits on.
_SEMAPHORES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Semaphore]]" = \
    weakref.WeakKeyDictionary()


def loop_semaphore(key: str, n: int) -> asyncio.Semaphore:
    """The running loop's semaphore named `key` (created with `n` permits on first use)."""
    per_loop = _SEMAPHORES.setdefault(asyncio.get_running_loop(), {})
    sem = per_loop.get(key)
    if sem is None:
        sem = per_loop[key] = asyncio.Semaphore(n)
    return sem
