"""The minimal root a sandboxed program sees, as a plan both backends build (`root_plan(python)`).

Nothing of the host is in it except what running Python needs, all bound read-only, nosuid, nodev:

    /usr                              the system (libc, the loader, /usr/bin/python3 ...)
    /bin /lib /lib64 /sbin ...        the host's symlinks into /usr, or read-only binds where they are dirs
    /etc/ld.so.cache                  the loader's cache (libraries found only through ld.so.conf)
    <the interpreter's prefixes>      sys.prefix / base_prefix / exec_prefix of `python` (a venv and the
                                      installation it was made from), each with 0755 parent dirs so that an
                                      unprivileged uid can reach a venv under a 0700 /root
    /dev                              null zero full random urandom, fd/stdin/stdout/stderr links
    /proc                             a fresh procfs of the run's own pid namespace
    /tmp /dev/shm WORKDIR             private size-limited tmpfs mounts (WORKDIR is the program's cwd and HOME)

So run dirs (rollouts hold ground_truth), data files, the checkout, home directories and the host's /tmp
(unix sockets of host services) do not exist inside. The plan is data; `launcher.py` (builtin backend)
and `backends.bwrap_argv` turn it into mounts.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field

WORKDIR = "/sandbox"
"""The program's working directory (and HOME) inside an isolated sandbox."""

_PRIVATE_MOUNTS = ("/tmp", "/dev", "/dev/shm", "/proc", WORKDIR)
_HOST_TOP_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_DEV_NODES = ("null", "zero", "full", "random", "urandom")
_DEV_LINKS = (("/proc/self/fd", "/dev/fd"), ("/proc/self/fd/0", "/dev/stdin"),
              ("/proc/self/fd/1", "/dev/stdout"), ("/proc/self/fd/2", "/dev/stderr"))


@dataclass(frozen=True)
class RootPlan:
    """Mounts and links of the minimal root (paths inside the sandbox equal the host paths they come from)."""

    ro_binds: list[str] = field(default_factory=list)
    """Host directories or files bound read-only at the same path."""
    dirs: list[str] = field(default_factory=list)
    """Directories to create (mode 0755) before binding, parents first."""
    symlinks: list[tuple[str, str]] = field(default_factory=list)
    """(target, path) symlinks to create."""
    dev_nodes: list[str] = field(default_factory=lambda: [f"/dev/{n}" for n in _DEV_NODES])
    """Device files bound from the host (writable, no exec, no suid)."""
    dev_links: list[tuple[str, str]] = field(default_factory=lambda: list(_DEV_LINKS))
    """(target, path) symlinks inside /dev."""

    def to_data(self) -> dict:
        return {"ro_binds": self.ro_binds, "dirs": self.dirs, "symlinks": [list(s) for s in self.symlinks],
                "dev_nodes": self.dev_nodes, "dev_links": [list(s) for s in self.dev_links]}


_PREFIX_CACHE: dict[str, list[str]] = {}


def interpreter_prefixes(python: str) -> list[str]:
    """The installation directories `python` runs from (asked once per interpreter, then cached)."""
    if python not in _PREFIX_CACHE:
        probe = ("import json, os, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, "
                 "sys.base_exec_prefix, os.path.dirname(os.path.realpath(sys.executable))]))")
        try:
            out = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True, timeout=60,
                                 env={"PATH": "/usr/bin:/bin"}, check=True).stdout
            paths = json.loads(out.strip().splitlines()[-1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
            raise RuntimeError(f"cannot run the sandbox interpreter {python!r} to find its installation: {e}") from e
        prefixes = []
        for p in paths:
            p = os.path.realpath(p) if os.path.islink(p) else os.path.normpath(p)
            if p == "/":
                raise RuntimeError(f"interpreter {python!r} has prefix '/': binding it would expose the whole host")
            prefixes.append(p)
        _PREFIX_CACHE[python] = prefixes
    return _PREFIX_CACHE[python]


def _covered(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def root_plan(python: str, extra_ro: tuple[str, ...] = ()) -> RootPlan:
    """The minimal root for running `python` (its prefixes, /usr, loader files) plus `extra_ro` paths."""
    binds: list[str] = ["/usr"]
    symlinks: list[tuple[str, str]] = []
    for name in _HOST_TOP_LINKS:
        host = "/" + name
        if os.path.islink(host):
            symlinks.append((os.readlink(host), host))
        elif os.path.isdir(host):
            binds.append(host)
    if os.path.exists("/etc/ld.so.cache"):
        binds.append("/etc/ld.so.cache")
    wanted = [*interpreter_prefixes(python), *(os.path.realpath(p) for p in extra_ro)]
    # the venv's python may be reached through symlinks: the path we exec must exist inside too
    exe_dir = os.path.dirname(os.path.abspath(python))
    if not _covered(os.path.realpath(exe_dir), wanted + binds):
        wanted.append(os.path.realpath(exe_dir))
    for p in sorted(set(wanted), key=len):
        if not _covered(p, binds):
            binds.append(p)
    dirs: list[str] = []
    for b in binds:
        parent = os.path.dirname(b)
        chain = []
        while parent not in ("/", "") and parent not in dirs:
            chain.append(parent)
            parent = os.path.dirname(parent)
        dirs.extend(reversed(chain))
    dirs = [d for d in dirs if not _covered(d, binds) and d not in _PRIVATE_MOUNTS]
    return RootPlan(ro_binds=binds, dirs=dirs, symlinks=symlinks)
