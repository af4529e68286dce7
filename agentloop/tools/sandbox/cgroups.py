"""Per-run cgroups: a memory and a pids limit on a run's whole process tree, and a way to kill all of it.

    detect()          which cgroup hierarchy this host lets us use (cached): v2, v1, or none
    RunCgroups        one run's cgroups: create (limits written), procs files for the launcher to join,
                      kill(), stats() (OOM kills, peak memory), close() (kill + rmdir)

Why: rlimits are per process, so a memory bomb spread over many processes passes RLIMIT_AS and can wake
the host's OOM killer, which then may pick SGLang or the learner. A memory cgroup makes the OOM killer
act inside the run only. Order of preference:

    v2   memory and pids enabled on a cgroup2 mount (memory.max, memory.swap.max, pids.max, cgroup.kill)
    v1   the v1 memory and pids hierarchies (memory.limit_in_bytes, memsw, pids.max); a cgroup2 mount
         without controllers (hybrid layout) still gives a kill-everything cgroup (cgroup.kill)
    none not root, or nothing writable: rlimits only (the result's `limits_applied` says which applied)

Run cgroups live under `<hierarchy root>/agentloop-sandbox/run-<pid>-<n>`, outside the engine's own cgroup,
so the engine is never charged for, nor OOM-killed because of, a sandboxed program.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

BASE = "agentloop-sandbox"
_SEQ = itertools.count()


@dataclass(frozen=True)
class CgroupSupport:
    """What this host offers (see the module doc)."""

    kind: str = "none"
    """v2, v1 or none."""
    memory: str | None = None
    """Parent dir of run cgroups with the memory controller."""
    pids: str | None = None
    """Parent dir of run cgroups with the pids controller."""
    kill: str | None = None
    """Parent dir of run cgroups that have cgroup.kill (v2, or the controller-less v2 of a hybrid layout)."""
    reason: str = ""
    """Why this kind (what failed for the better ones)."""


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of cgroup mounts."""
    out = []
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                fstype, _, opts = (right.split() + ["", "", ""])[:3]
                if fstype in ("cgroup", "cgroup2"):
                    out.append((left.split()[4], fstype, set(opts.split(","))))
    except OSError:
        pass
    return out


def _write(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def _make_base(parent: str) -> str:
    base = os.path.join(parent, BASE)
    os.makedirs(base, exist_ok=True)
    _clean_stale(base)
    return base


def _clean_stale(base: str) -> None:
    """Remove run cgroups of engines that are gone (empty dirs only; a populated one stays)."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) == 3 and parts[0] == "run" and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            try:
                os.rmdir(os.path.join(base, name))
            except OSError:
                pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _try_v2(mounts) -> CgroupSupport | str:
    for mp, fstype, _ in mounts:
        if fstype != "cgroup2":
            continue
        try:
            controllers = _read(os.path.join(mp, "cgroup.controllers")).split()
        except OSError as e:
            return f"cgroup2 at {mp} unreadable: {e}"
        if "memory" not in controllers or "pids" not in controllers:
            return f"cgroup2 at {mp} has no memory/pids controllers ({' '.join(controllers) or 'none'})"
        try:
            _write(os.path.join(mp, "cgroup.subtree_control"), "+memory +pids")
            base = _make_base(mp)
            _write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids")
        except OSError as e:
            return f"cgroup2 at {mp}: cannot enable memory/pids for our cgroups: {e}"
        return CgroupSupport("v2", memory=base, pids=base, kill=base, reason=f"cgroup2 at {mp}")
    return "no cgroup2 mount"


def _try_v1(mounts) -> CgroupSupport | str:
    mem = next((mp for mp, t, o in mounts if t == "cgroup" and "memory" in o), None)
    pids = next((mp for mp, t, o in mounts if t == "cgroup" and "pids" in o), None)
    if mem is None or pids is None:
        return "no v1 memory and pids hierarchies"
    try:
        mem_base, pids_base = _make_base(mem), _make_base(pids)
    except OSError as e:
        return f"v1 hierarchies not writable: {e}"
    kill = None
    for mp, fstype, _ in mounts:  # hybrid layout: a controller-less cgroup2 still has cgroup.kill
        if fstype == "cgroup2":
            try:
                base = _make_base(mp)
                if os.path.exists(os.path.join(base, "cgroup.kill")):
                    kill = base
            except OSError:
                pass
            break
    return CgroupSupport("v1", memory=mem_base, pids=pids_base, kill=kill, reason=f"v1 memory at {mem}, pids at {pids}")


_SUPPORT: list[CgroupSupport] = []


def detect() -> CgroupSupport:
    """The cgroup support of this host (probed once per process)."""
    if not _SUPPORT:
        if os.geteuid() != 0:
            _SUPPORT.append(CgroupSupport(reason="not root"))
        else:
            mounts = _mounts()
            v2 = _try_v2(mounts)
            if isinstance(v2, CgroupSupport):
                _SUPPORT.append(v2)
            else:
                v1 = _try_v1(mounts)
                _SUPPORT.append(v1 if isinstance(v1, CgroupSupport) else CgroupSupport(reason=f"{v2}; {v1}"))
    return _SUPPORT[0]


@dataclass
class RunCgroups:
    """The cgroups of one run (every dir it made, to join and later remove)."""

    support: CgroupSupport
    dirs: list[str] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, mem_bytes: int, pids_max: int, support: CgroupSupport | None = None) -> "RunCgroups":
        """Make the run's cgroups with their limits (whatever fails is left out and logged once)."""
        sup = support or detect()
        run = cls(sup)
        name = f"run-{os.getpid()}-{next(_SEQ)}"
        try:
            if sup.kind == "v2":
                d = run._mkdir(sup.memory, name)
                _write(os.path.join(d, "memory.max"), str(mem_bytes))
                if os.path.exists(os.path.join(d, "memory.swap.max")):
                    _write(os.path.join(d, "memory.swap.max"), "0")
                _write(os.path.join(d, "pids.max"), str(pids_max))
                run.applied += ["cgroup_v2_memory", "cgroup_v2_pids"]
            elif sup.kind == "v1":
                d = run._mkdir(sup.memory, name)
                _write(os.path.join(d, "memory.limit_in_bytes"), str(mem_bytes))
                if os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(d, "memory.memsw.limit_in_bytes"), str(mem_bytes))
                run.applied.append("cgroup_v1_memory")
                d = run._mkdir(sup.pids, name)
                _write(os.path.join(d, "pids.max"), str(pids_max))
                run.applied.append("cgroup_v1_pids")
                if sup.kill:
                    run._mkdir(sup.kill, name)
        except OSError as e:
            _log_once(f"sandbox cgroups unavailable for this run ({e}); rlimits still apply")
        return run

    def _mkdir(self, parent: str | None, name: str) -> str:
        assert parent is not None
        d = os.path.join(parent, name)
        os.mkdir(d)
        self.dirs.append(d)
        return d

    @property
    def procs_files(self) -> list[str]:
        """`cgroup.procs` of each cgroup; the launcher writes its pid there before anything else."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def _pids(self) -> set[int]:
        pids: set[int] = set()
        for d in self.dirs:
            try:
                pids.update(int(p) for p in _read(os.path.join(d, "cgroup.procs")).split())
            except (OSError, ValueError):
                pass
        return pids

    def kill(self) -> None:
        """SIGKILL every process of the run (cgroup.kill where there is one, else each member pid)."""
        for d in self.dirs:
            if os.path.exists(os.path.join(d, "cgroup.kill")):
                try:
                    _write(os.path.join(d, "cgroup.kill"), "1")
                    return
                except OSError:
                    pass
        for pid in self._pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def stats(self) -> tuple[int, float | None]:
        """(OOM kills inside the run, peak memory in MiB or None)."""
        oom, peak = 0, None
        sup = self.support
        for d in self.dirs:
            try:
                if sup.kind == "v2" and d.startswith(str(sup.memory)):
                    for line in _read(os.path.join(d, "memory.events")).splitlines():
                        if line.startswith("oom_kill "):
                            oom = int(line.split()[1])
                    if os.path.exists(os.path.join(d, "memory.peak")):
                        peak = int(_read(os.path.join(d, "memory.peak"))) / 2**20
                elif sup.kind == "v1" and d.startswith(str(sup.memory)):
                    for line in _read(os.path.join(d, "memory.oom_control")).splitlines():
                        if line.startswith("oom_kill "):
                            oom = int(line.split()[1])
                    peak = int(_read(os.path.join(d, "memory.max_usage_in_bytes"))) / 2**20
            except (OSError, ValueError):
                pass
        return oom, peak

    async def close(self, deadline_s: float = 3.0) -> bool:
        """Kill what is left and remove the cgroups; False when a populated one had to stay."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        left = list(self.dirs)
        while left:
            if self._pids():
                self.kill()
            still = []
            for d in left:
                try:
                    os.rmdir(d)
                except FileNotFoundError:
                    pass
                except OSError:
                    still.append(d)
            left = still
            if not left:
                break
            if loop.time() > end:
                logger.error("sandbox cgroups %s still populated after SIGKILL; left in place", left)
                return False
            await asyncio.sleep(0.01)  # the kernel frees a killed cgroup's last task asynchronously
        return True


_LOGGED: set[str] = set()


def _log_once(msg: str) -> None:
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        logger.warning(msg)
