"""Which backend runs a sandbox here, and the launch spec each one gets.

    isolation_status(limits)   -> IsolationStatus(isolated, backend, reason), probed once per setting
    require_isolation(limits)  ConfigError unless isolated or `allow_unisolated` (used by `agentloop train`)
    find_bwrap()               the bubblewrap binary, or None
    launch_spec(...)           the data the launcher reads (mode, root plan, program, limits, fds)
    launch_argv(spec)          the command that starts a run (bubblewrap, or our launcher)
    bwrap_argv(...)            the bubblewrap command line of a run

Resolution of `backend` (auto tries them in this order):

    bwrap    bubblewrap present and a probe run works (as root: no user namespace, our supervisor then drops
             to the run's uid; not root: an unprivileged user namespace, the run keeps the caller's uid)
    builtin  root: our own launcher (namespaces + pivot_root)
    none     neither: rlimits only, the program can read what the caller can; loudly warned, and refused by
             `agentloop train` unless `tools.python.allow_unisolated=true`

A probe is a real sandboxed `print` run through the launcher; its failure text is the reason given.
"""

from __future__ import annotations

import marshal
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from agentloop.errors import ConfigError
from agentloop.tools.sandbox.limits import SandboxLimits
from agentloop.tools.sandbox.rootfs import WORKDIR, RootPlan, root_plan

LAUNCHER = Path(__file__).with_name("launcher.py")
_LAUNCHER_SRC: list[str] = []


class IsolationStatus(NamedTuple):
    """Whether sandboxed code is isolated here, by which backend, and why (or why not)."""

    isolated: bool
    backend: str
    reason: str


def is_root() -> bool:
    """Whether this process may create namespaces, mounts and cgroups for other uids."""
    return os.geteuid() == 0


def find_bwrap() -> str | None:
    """bubblewrap on PATH, or in /usr/bin."""
    found = shutil.which("bwrap")
    if found:
        return found
    return "/usr/bin/bwrap" if os.access("/usr/bin/bwrap", os.X_OK) else None


def interpreter(limits: SandboxLimits) -> str:
    """The program's interpreter: `limits.python`, else the running one (a venv path kept as is: argv[0]
    must be the venv's own path for the venv to be found)."""
    return limits.python or sys.executable


def _launcher_source() -> str:
    if not _LAUNCHER_SRC:
        _LAUNCHER_SRC.append(LAUNCHER.read_text())
    return _LAUNCHER_SRC[0]


def scrubbed_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": "/tmp" if workdir == WORKDIR else workdir,
        "USER": "sandbox",
        "LOGNAME": "sandbox",
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


def bwrap_argv(bwrap: str, plan: RootPlan, python: str, disk_bytes: int, spec_fd: int) -> list[str]:
    """bubblewrap building the plan's root, then our launcher inside as the supervisor (`--stub`)."""
    argv = [bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session"]
    if not is_root():  # an unprivileged user namespace; nested ones are refused
        argv += ["--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
    # private mounts first: a bind under /tmp (extra_ro) goes on top of the private /tmp, not under it
    argv += ["--dev", "/dev", "--perms", "1777", "--size", str(disk_bytes), "--tmpfs", "/dev/shm",
             "--proc", "/proc", "--perms", "1777", "--size", str(disk_bytes), "--tmpfs", "/tmp"]
    for d in plan.dirs:
        argv += ["--perms", "0755", "--dir", d]
    for b in plan.ro_binds:
        argv += ["--ro-bind", b, b]
    for target, path in plan.symlinks:
        argv += ["--symlink", target, path]
    argv += ["--perms", "0700", "--size", str(disk_bytes), "--tmpfs", WORKDIR,
             "--remount-ro", "/", "--chdir", WORKDIR,
             "--", python, "-I", "-S", "-c", _launcher_source(), "--stub", str(spec_fd)]
    return argv


def launch_spec(backend: str, limits: SandboxLimits, *, python: str, argv: list[str], files: dict[str, str],
                status_fd: int, spec_fd: int, workdir: str | None = None, uid: int | None = None,
                cgroup_fds: list[int] | None = None, channels: list[int] | None = None,
                extra_ro: tuple[str, ...] = ()) -> dict:
    """What the launcher needs for one run (see launcher.py): plain data for marshal; `workdir` is the host
    dir of backend none."""
    isolated = backend != "none"
    work = WORKDIR if isolated else workdir
    assert work is not None
    spec = {
        "mode": backend, "status_fd": status_fd, "workdir": work, "files": files,
        "python": python, "argv": argv, "env": scrubbed_env(work), "uid": uid, "gid": uid,
        "cpu_s": limits.cpu_s, "mem_bytes": limits.memory_limit_mb << 20, "nproc": limits.max_processes,
        "fsize_bytes": limits.max_file_mb << 20, "disk_bytes": limits.disk_limit_mb << 20,
        "cgroup_fds": cgroup_fds or [], "channels": channels or [],
    }
    if isolated:
        plan = root_plan(python, extra_ro)
        spec["root"] = plan.to_data()
        if backend == "bwrap":
            bwrap = find_bwrap()
            if bwrap is None:
                raise RuntimeError("bwrap backend requested but bubblewrap is not installed")
            spec["bwrap_argv"] = bwrap_argv(bwrap, plan, python, spec["disk_bytes"], spec_fd)
    return spec


def launch_argv(spec: dict, spec_fd: int) -> list[str]:
    """The command that starts a run: bubblewrap itself, or our launcher (builtin, none)."""
    if spec["mode"] == "bwrap":
        return spec["bwrap_argv"]
    return [os.path.realpath(sys.executable), "-I", "-S", str(LAUNCHER), str(spec_fd)]


# ------------------------------------------------------------------ probing


def probe(backend: str, limits: SandboxLimits) -> str | None:
    """Run `print('ok')` through `backend` synchronously; None when it worked, else what went wrong."""
    python = interpreter(limits)
    status_r, status_w = os.pipe()
    spec_fd = os.memfd_create("agentloop-sandbox-probe")
    try:
        uid = limits.uid_base + 999 if is_root() else None  # a slot the pool never hands out
        try:
            spec = launch_spec(backend, limits, python=python, argv=[python, "-I", "-c", "print('ok')"], files={},
                               status_fd=status_w, spec_fd=spec_fd, uid=uid,
                               workdir=None if backend != "none" else "/")
        except (RuntimeError, OSError) as e:
            return str(e)
        os.write(spec_fd, marshal.dumps(spec))
        try:
            proc = subprocess.run(launch_argv(spec, spec_fd), capture_output=True,
                                  pass_fds=(spec_fd, status_w), timeout=60, env={"PATH": "/usr/bin:/bin"})
        except (OSError, subprocess.SubprocessError) as e:
            return f"{type(e).__name__}: {e}"
        os.close(status_w)
        status_w = -1
        with os.fdopen(status_r, "rb", closefd=False) as fh:
            events = read_events(fh.read())
        errors = [e.get("message", "") for e in events if e.get("event") == "error"]
        exits = [e for e in events if e.get("event") == "exit"]
        if proc.stdout.decode(errors="replace").strip() == "ok" and exits and exits[0].get("exit_code") == 0:
            return None
        detail = "; ".join(errors) or proc.stderr.decode(errors="replace").strip()[-500:] or f"rc {proc.returncode}"
        return detail
    finally:
        os.close(spec_fd)
        if status_w >= 0:
            os.close(status_w)
        os.close(status_r)


def read_events(data: bytes) -> list[dict]:
    """The launcher's status events from the bytes it wrote (length-prefixed marshal dicts)."""
    events, pos = [], 0
    while pos + 4 <= len(data):
        size = int.from_bytes(data[pos:pos + 4], "big")
        try:
            event = marshal.loads(data[pos + 4:pos + 4 + size])
        except (ValueError, EOFError, TypeError):
            break
        if isinstance(event, dict):
            events.append(event)
        pos += 4 + size
    return events


_STATUS: dict[tuple, IsolationStatus] = {}


def _key(limits: SandboxLimits) -> tuple:
    return (limits.isolate, limits.backend, interpreter(limits))


def cached_status(limits: SandboxLimits) -> IsolationStatus | None:
    """isolation_status(limits) if it was probed already, else None (never blocks)."""
    return _STATUS.get(_key(limits))


def isolation_status(limits: SandboxLimits | None = None) -> IsolationStatus:
    """How `limits` would run here (probed once per backend choice and interpreter, then cached)."""
    limits = limits or SandboxLimits()
    key = _key(limits)
    if key in _STATUS:
        return _STATUS[key]
    root = is_root()
    if not limits.isolate:
        st = IsolationStatus(False, "none", "tools.python.isolate is false")
    else:
        tried: list[str] = []
        st = None
        if limits.backend in ("auto", "bwrap"):
            bwrap = find_bwrap()
            if bwrap is None:
                tried.append("bubblewrap is not installed (apt-get install bubblewrap)")
            else:
                err = probe("bwrap", limits)
                if err is None:
                    st = IsolationStatus(True, "bwrap", f"bubblewrap {bwrap}" + ("" if root else ", user namespace"))
                else:
                    tried.append(f"bubblewrap {bwrap} failed: {err}")
        if st is None and limits.backend in ("auto", "builtin"):
            if not root:
                tried.append("the builtin backend needs root")
            else:
                err = probe("builtin", limits)
                if err is None:
                    st = IsolationStatus(True, "builtin", "namespaces and pivot_root as root")
                else:
                    tried.append(f"builtin backend failed: {err}")
        if st is None:
            st = IsolationStatus(False, "none", "; ".join(tried))
    _STATUS[key] = st
    return st


def require_isolation(limits: SandboxLimits, what: str = "agentloop train") -> IsolationStatus:
    """ConfigError unless model code would run isolated here or `limits.allow_unisolated` is set."""
    st = isolation_status(limits)
    if not st.isolated and not limits.allow_unisolated:
        raise ConfigError(
            f"{what} refuses to run model-written code unisolated: no sandbox backend works here ({st.reason}). "
            "Run as root, install bubblewrap, or accept that the python tool and the code reward run model code "
            "as this user with rlimits only: tools.python.allow_unisolated=true")
    return st
