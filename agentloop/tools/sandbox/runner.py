"""Run untrusted Python in a sandbox, asynchronously: the parent side.

    run_python(code, limits, stdin=, files=)   run to the end, return a SandboxResult
    start_python(..., channels=True)           a running SandboxProcess with two private pipes (the
                                               program's fds 3 and 4) for a request/reply protocol;
                                               `await proc.wait()` for its result, `proc.kill()` to stop it
    loop_semaphore(key, n)                     a per-event-loop concurrency cap

What contains what (backends.py picks the backend, launcher.py is the child side, rootfs.py the root):

    threat                     bwrap / builtin (isolated)                          none (not root, no bwrap)
    reading host files         minimal root: only /usr, the interpreter, loader     scrubbed env only: reads
                               files, /dev nodes, private /proc /tmp work dir       what the caller can
    host services (sockets)    no host /tmp or /run inside; own network namespace  socket preamble (Python-level)
    setuid binaries            every mount nosuid; PR_SET_NO_NEW_PRIVS              PR_SET_NO_NEW_PRIVS
    other runs, the engine     own pid namespace and uid per run (as root)          same uid as the engine
    memory bomb (any # procs)  memory cgroup (v2, else v1) + RLIMIT_AS              RLIMIT_AS per process
    fork bomb                  pids cgroup + RLIMIT_NPROC of its own uid            RLIMIT_NPROC (caller's uid)
    leftover daemons           pid 1 of the run exits -> kernel kills the rest;     process group killed
                               cgroup killed and removed
    endless loop / CPU         wall timeout (tree killed), RLIMIT_CPU               same
    output flood / disk        capped reads; tmpfs sizes; RLIMIT_FSIZE              capped reads; RLIMIT_FSIZE

Start storms: at most `max_concurrent_starts` sandboxes are being set up at once per event loop (the slot
is held until the supervisor reports the program forked). Without isolation every run still works, but
a loud warning is logged once and `agentloop train` refuses (see backends.require_isolation).
"""

from __future__ import annotations

import asyncio
import logging
import marshal
import os
import shutil
import signal
import tempfile
import time
import weakref

from agentloop.tools.sandbox.backends import (
    IsolationStatus,
    cached_status,
    interpreter,
    is_root,
    isolation_status,
    launch_argv,
    launch_spec,
)
from agentloop.tools.sandbox.cgroups import RunCgroups
from agentloop.tools.sandbox.limits import SandboxLimits, SandboxResult

logger = logging.getLogger(__name__)

_NETWORK_PREAMBLE = """\
import socket as _s
def _no_network(*a, **k):
    raise OSError(101, "network is disabled in this sandbox")
_s.socket = _no_network; _s.create_connection = _no_network; _s.socketpair = _no_network
del _s, _no_network
"""
_RUN_MAIN = ("import sys\nsys.argv = ['main.py']\n"
             "exec(compile(open('main.py', encoding='utf-8').read(), 'main.py', 'exec'), "
             "{'__name__': '__main__', '__file__': 'main.py', '__builtins__': __builtins__})")
_ISOLATION = {
    "bwrap": ["net_namespace", "mount_namespace", "pid_namespace", "ipc_namespace", "uts_namespace",
              "minimal_root", "no_new_privs"],
    "builtin": ["net_namespace", "mount_namespace", "pid_namespace", "ipc_namespace", "uts_namespace",
                "cgroup_namespace", "minimal_root", "no_new_privs"],
    "none": ["unisolated", "no_new_privs"],
}
SETUP_TIMEOUT_S = 60.0
"""Longest a sandbox may take to start (namespaces, mounts, cgroups) before its program runs."""
_RLIMITS = ["rlimit_cpu", "rlimit_as", "rlimit_nproc", "rlimit_fsize", "rlimit_nofile"]


# ------------------------------------------------------------------ uid slots


class _UidPool:
    """Per-process pool of sandbox uids, so concurrent runs never share a uid."""

    def __init__(self) -> None:
        self._used: set[int] = set()
        self._next = 0

    def acquire(self, base: int) -> int:
        for _ in range(999):
            slot = self._next
            self._next = (self._next + 1) % 999  # slot 999 is the isolation probe's
            if slot not in self._used:
                self._used.add(slot)
                return base + (os.getpid() % 10000) * 1000 + slot
        raise RuntimeError("more than 999 concurrent sandbox runs in one process")

    def release(self, base: int, uid: int) -> None:
        self._used.discard((uid - base) % 1000)


_UIDS = _UidPool()


def _uid_pids(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as fh:
                    for line in fh:
                        if line.startswith("Uid:"):
                            if int(line.split()[1]) == uid:
                                pids.append(int(name))
                            break
            except (OSError, ValueError, IndexError):
                continue  # exited while we looked
    return pids


async def _reap_uid(uid: int, deadline_s: float = 3.0) -> bool:
    """Kill every process of `uid` until none is left (True) or the deadline passes (False)."""
    end = time.monotonic() + deadline_s
    while True:
        pids = _uid_pids(uid)
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------ backend choice (probed once)

_STATUS_LOCKS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock]" = weakref.WeakKeyDictionary()
_WARNED: set[str] = set()


async def _isolation(limits: SandboxLimits) -> IsolationStatus:
    st = cached_status(limits)
    if st is None:
        lock = _STATUS_LOCKS.setdefault(asyncio.get_running_loop(), asyncio.Lock())
        async with lock:  # one probe at a time, off the event loop
            st = await asyncio.to_thread(isolation_status, limits)
    if not st.isolated and limits.isolate and "unisolated" not in _WARNED:
        _WARNED.add("unisolated")
        logger.warning(
            "\n" + "!" * 100 + "\n!! MODEL-WRITTEN CODE RUNS UNISOLATED: %s.\n!! It runs as this user with rlimits "
            "only and can read every file this user can (run dirs with ground truth, data, the checkout).\n!! Run "
            "as root or install bubblewrap; `agentloop train` refuses this unless tools.python.allow_unisolated=true.\n"
            + "!" * 100, st.reason)
    return st


# ------------------------------------------------------------------ one run


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


class SandboxProcess:
    """A started sandbox run: its output is being read; `wait()` ends it and says what happened."""

    def __init__(self, limits: SandboxLimits, backend: str) -> None:
        self.limits = limits
        self.backend = backend
        self.proc: asyncio.subprocess.Process | None = None
        self.request_fd = -1
        """Parent end of the program's fd 3 (write requests here), with channels=True."""
        self.reply_fd = -1
        """Parent end of the program's fd 4 (read replies here), with channels=True."""
        self.uid: int | None = None
        self.cgroups: RunCgroups | None = None
        self.host_workdir: str | None = None
        self.events: list[dict] = []
        self._started = asyncio.Event()
        self._t0 = time.monotonic()
        self._out, self._err = bytearray(), bytearray()
        self._overflow = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._killed = False
        self._result: SandboxResult | None = None
        self._setup_error: str | None = None
        self._t_started: float | None = None
        self._cgroups_applied: list[str] = []
        self._uid_used: int | None = None

    # -------------------------------------------------------------- start

    async def _start(self, code: str, stdin: bytes | None, files: dict[str, str], channels: bool,
                     extra_ro: tuple[str, ...]) -> None:
        limits, backend = self.limits, self.backend
        as_root = is_root()
        python = interpreter(limits)
        fds_child: list[int] = []
        spec_fd = status_r = status_w = -1
        try:
            if backend == "none":
                self.host_workdir = tempfile.mkdtemp(prefix="agentloop-sbx-")
            # the preamble only gives a clear message where the network namespace already blocks everything
            argv = [python, "-B", "-s", "-c", _NETWORK_PREAMBLE + _RUN_MAIN]
            if backend != "none" and as_root:
                self.uid = _UIDS.acquire(limits.uid_base)
                # + 2: the supervisor (and the builtin's launcher) are in the cgroup too
                self.cgroups = RunCgroups.create(limits.memory_limit_mb << 20, limits.max_processes + 2)
            chan_child: list[int] = []
            if channels:
                req_r, self.request_fd = os.pipe()
                self.reply_fd, rep_w = os.pipe()
                chan_child = [req_r, rep_w]
                fds_child += chan_child
            status_r, status_w = os.pipe()
            spec_fd = os.memfd_create("agentloop-sandbox-spec")
            cgroup_fds: list[int] = []
            for path in self.cgroups.procs_files if self.cgroups else []:
                cgroup_fds.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
                fds_child.append(cgroup_fds[-1])
            spec = launch_spec(backend, limits, python=python, argv=argv, files={**files, "main.py": code},
                               status_fd=status_w, spec_fd=spec_fd, workdir=self.host_workdir, uid=self.uid,
                               cgroup_fds=cgroup_fds, channels=chan_child, extra_ro=extra_ro)
            os.write(spec_fd, marshal.dumps(spec))
            self.proc = await asyncio.create_subprocess_exec(
                *launch_argv(spec, spec_fd),
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                pass_fds=(spec_fd, status_w, *fds_child), start_new_session=True,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        except BaseException:
            for fd in (spec_fd, status_r, status_w, *fds_child):
                if fd >= 0:
                    os.close(fd)
            await self._cleanup()
            raise
        for fd in (spec_fd, status_w, *fds_child):
            os.close(fd)
        self._t0 = time.monotonic()
        proc = self.proc
        assert proc.stdout is not None and proc.stderr is not None
        cap = limits.max_output_bytes
        self._tasks = [
            asyncio.create_task(_read_capped(proc.stdout, cap, self._out, self._overflow.set)),
            asyncio.create_task(_read_capped(proc.stderr, cap, self._err, self._overflow.set)),
            asyncio.create_task(self._read_status(status_r)),
        ]
        if stdin is not None:
            self._tasks.append(asyncio.create_task(self._feed(stdin)))

    async def _feed(self, data: bytes) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(data)
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the program did not read all of its input
        finally:
            self.proc.stdin.close()

    async def _read_status(self, fd: int) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 16)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    os.fdopen(fd, "rb", 0))
        try:
            while True:
                try:
                    size = int.from_bytes(await reader.readexactly(4), "big")
                    if size > 1 << 16:
                        break
                    event = marshal.loads(await reader.readexactly(size))
                except (asyncio.IncompleteReadError, ValueError, EOFError, TypeError):
                    break
                if not isinstance(event, dict):
                    break
                self.events.append(event)
                if event.get("event") == "started":
                    self._t_started = time.monotonic()
                if event.get("event") in ("started", "error"):
                    self._started.set()
        finally:
            transport.close()
            self._started.set()

    async def wait_started(self) -> None:
        """Until the program is forked (or setup failed, or the launcher ended), at most SETUP_TIMEOUT_S."""
        try:
            await asyncio.wait_for(self._started.wait(), timeout=SETUP_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass

    # -------------------------------------------------------------- stop

    def kill(self) -> None:
        """SIGKILL the whole run now (launcher, supervisor, program and everything it started)."""
        self._killed = True
        if self.proc is not None and self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.cgroups is not None:
            self.cgroups.kill()

    async def wait(self) -> SandboxResult:
        """Wait for the program to end (killing it at `timeout_s` or on an output flood), clean up, classify."""
        if self._result is not None:
            return self._result
        if self.proc is None:
            return await self._finish(timed_out=False, truncated=False)
        waiter = asyncio.ensure_future(self.proc.wait())
        overflow = asyncio.ensure_future(self._overflow.wait())
        # the program's time counts from its fork: a slow sandbox start on a loaded host is not its fault
        if self._t_started is None:
            await self.wait_started()
        start = self._t_started if self._t_started is not None else time.monotonic()
        remaining = max(0.0, self.limits.timeout_s - (time.monotonic() - start))
        try:
            done, _ = await asyncio.wait({waiter, overflow}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        finally:
            overflow.cancel()
        timed_out = not done
        truncated = self._overflow.is_set()
        if timed_out or truncated or self._killed:
            self.kill()
        await waiter
        return await self._finish(timed_out=timed_out, truncated=truncated)

    async def _finish(self, *, timed_out: bool, truncated: bool) -> SandboxResult:
        # the pipes close once every process holding them is gone; bounded wait, then give up on them
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=2.0)
            for t in pending:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        wall = time.monotonic() - self._t0
        oom, peak = self.cgroups.stats() if self.cgroups is not None else (0, None)
        await self._cleanup()
        self._result = self._classify(timed_out=timed_out, truncated=truncated, wall=wall, oom=oom, peak=peak)
        return self._result

    async def _cleanup(self) -> None:
        for attr in ("request_fd", "reply_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                os.close(fd)
                setattr(self, attr, -1)
        uid_clean = True
        if self.cgroups is not None:
            uid_clean = await self.cgroups.close()
            self._cgroups_applied = self.cgroups.applied
        if self.uid is not None:
            if not self.cgroups or not self.cgroups.dirs:
                uid_clean = await _reap_uid(self.uid)
            if uid_clean:
                _UIDS.release(self.limits.uid_base, self.uid)
            else:
                logger.error("sandbox uid %d still has processes after SIGKILL; not reusing it", self.uid)
            self._uid_used = self.uid
            self.uid = None
        if self.host_workdir is not None:
            shutil.rmtree(self.host_workdir, ignore_errors=True)
            self.host_workdir = None

    def _classify(self, *, timed_out: bool, truncated: bool, wall: float, oom: int,
                  peak: float | None) -> SandboxResult:
        limits = self.limits
        stdout = self._out.decode("utf-8", errors="replace")
        stderr = self._err.decode("utf-8", errors="replace")
        started = any(e.get("event") == "started" for e in self.events)
        errors = [str(e.get("message", "")) for e in self.events if e.get("event") == "error"]
        exit_ev = next((e for e in self.events if e.get("event") == "exit"), None)
        exit_code = sig = None
        cpu = 0.0
        if exit_ev is not None:
            exit_code, sig, cpu = exit_ev.get("exit_code"), exit_ev.get("signal"), float(exit_ev.get("cpu_s") or 0.0)
        if self._setup_error is not None:
            errors.append(self._setup_error)
        if errors and not stderr:
            stderr = "sandbox setup failed: " + "; ".join(errors) + "\n"
        isolation = list(_ISOLATION[self.backend]) + ["socket_preamble"] if started else []
        if started and self._uid_used is not None:
            isolation.append("uid")
        if started and self.backend == "bwrap" and not is_root():
            isolation.append("user_namespace")
        applied = list(self._cgroups_applied) + _RLIMITS
        if self.backend != "none":
            applied.append("tmpfs_size")
        if timed_out:
            reason = "timeout"
        elif truncated:
            reason = "output_limit"
        elif errors or (exit_code == 126 and "sandbox setup failed" in stderr) or (not started and not self._killed):
            reason = "setup_error"
        elif sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= limits.cpu_s):
            reason = "cpu_limit"
        elif sig == signal.SIGXFSZ or (exit_code not in (0, None) and "File too large" in stderr):
            reason = "file_size_limit"
        elif (oom and exit_code != 0) or (exit_code not in (0, None) and "MemoryError" in stderr):
            reason = "memory_limit"
        elif sig is not None or exit_ev is None:
            reason = "killed"
        elif exit_code == 0:
            reason = "ok"
        else:
            reason = "error"
        if reason == "setup_error" and errors:
            msg = "; ".join(errors)
            if msg not in _WARNED:
                _WARNED.add(msg)
                logger.error("sandbox setup failed (%s backend): %s", self.backend, msg)
        return SandboxResult(stdout=stdout, stderr=stderr, exit_code=exit_code, signal=sig, timed_out=timed_out,
                             truncated=truncated, reason=reason, wall_s=wall, cpu_s=cpu, backend=self.backend,
                             isolation=isolation, limits_applied=applied, oom_kills=oom, memory_peak_mb=peak)


async def start_python(code: str, limits: SandboxLimits | None = None, *, stdin: bytes | None = None,
                       files: dict[str, str] | None = None, channels: bool = False,
                       extra_ro: tuple[str, ...] = ()) -> SandboxProcess:
    """Start `code` (as main.py, run as __main__) in a fresh sandbox; `files` are written next to it,
    `stdin` is its standard input, `channels` gives it private pipes on fds 3 (in) and 4 (out), `extra_ro`
    host paths bound read-only at the same path (isolated backends only)."""
    limits = limits or SandboxLimits()
    st = await _isolation(limits)
    backend = st.backend if st.isolated else "none"
    proc = SandboxProcess(limits, backend)
    if not st.isolated and limits.isolate and limits.backend != "auto":
        proc._setup_error = f"backend {limits.backend!r} was asked for and does not work here: {st.reason}"
        return proc
    async with loop_semaphore("sandbox_starts", limits.max_concurrent_starts):
        await proc._start(code, stdin, dict(files or {}), channels, extra_ro)
        try:
            await proc.wait_started()
        except BaseException:  # cancelled while it starts: nothing of it may stay behind
            proc.kill()
            await asyncio.shield(proc.wait())
            raise
    return proc


async def run_python(code: str, limits: SandboxLimits | None = None, *, stdin: bytes | None = None,
                     files: dict[str, str] | None = None, extra_ro: tuple[str, ...] = ()) -> SandboxResult:
    """Run `code` in a fresh sandbox and report what happened (never raises for the program's faults)."""
    proc = await start_python(code, limits, stdin=stdin, files=files, extra_ro=extra_ro)
    try:
        return await proc.wait()
    except BaseException:
        proc.kill()
        await asyncio.shield(proc.wait())
        raise


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


