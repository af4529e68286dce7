"""What a sandboxed run may use and what it did: `SandboxLimits` (config) and `SandboxResult` (record).

A leaf of the config tree (`tools.python` extends SandboxLimits): imports nothing of agentloop.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class SandboxLimits(BaseModel):
    """Limits of one sandboxed run."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    timeout_s: float = Field(default=5.0, gt=0)
    """Wall-clock limit; past it the whole process tree is killed."""
    cpu_s: int = Field(default=5, ge=1)
    """CPU-time limit per process (RLIMIT_CPU)."""
    memory_limit_mb: int = Field(default=512, ge=32)
    """Memory limit in MiB: of the whole run's process tree (cgroup, where the host allows one) and of the
    address space of each process (RLIMIT_AS)."""
    max_processes: int = Field(default=16, ge=1)
    """Processes/threads of the run (cgroup pids.max where available, and RLIMIT_NPROC of its uid)."""
    max_file_mb: int = Field(default=16, ge=1)
    """Largest file the program may write (RLIMIT_FSIZE), in MiB."""
    disk_limit_mb: int = Field(default=32, ge=1)
    """Size of each private tmpfs (the work dir, /tmp, /dev/shm), in MiB."""
    max_output_bytes: int = Field(default=16384, ge=256)
    """Bytes kept per stream (stdout, stderr); more stops the program and marks the output truncated."""
    isolate: bool = True
    """Run in an isolating backend (namespaces, a minimal root, a private uid). Off: rlimits only, and as
    root the program then runs as root; for debugging only."""
    backend: Literal["auto", "builtin", "bwrap"] = "auto"
    """Isolation backend: bwrap (bubblewrap, root or not), builtin (our namespace launcher, needs root), or
    auto (bwrap when it works here, else builtin as root, else no isolation with a loud warning)."""
    allow_unisolated: bool = False
    """Let `agentloop train` run model code when no backend can isolate it (not root and no working bwrap):
    the code then runs as the trainer's user with rlimits only."""
    max_concurrent_starts: int = Field(default=4, ge=1)
    """Sandboxes being set up at once in this process (namespaces, mounts, interpreter start); more wait."""
    uid_base: int = Field(default=2_000_000_000, ge=1000)
    """First uid handed to sandboxed runs (as root); a run gets uid_base + (pid % 10000) * 1000 + slot."""
    python: str | None = None
    """Interpreter for the program; None: the running one (its installation is bound read-only)."""


class SandboxResult(BaseModel):
    """What one sandboxed run did."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    stdout: str = ""
    """Captured stdout (at most max_output_bytes, decoded with replacement)."""
    stderr: str = ""
    """Captured stderr (same cap)."""
    exit_code: int | None = None
    """Exit status; None when the program was killed by a signal or never reported."""
    signal: int | None = None
    """Signal that killed the program, if any."""
    timed_out: bool = False
    """The wall-clock limit was hit."""
    truncated: bool = False
    """Output exceeded max_output_bytes and the program was stopped."""
    reason: str = "ok"
    """One of ok, error, timeout, cpu_limit, memory_limit, file_size_limit, output_limit, killed, setup_error."""
    wall_s: float = 0.0
    """Wall time of the run."""
    cpu_s: float = 0.0
    """CPU seconds of the program and the children it waited for."""
    backend: str = "none"
    """Backend that ran it: bwrap, builtin, or none (no isolation)."""
    isolation: list[str] = Field(default_factory=list)
    """Isolation that was in place (net/mount/pid/ipc/uts namespaces, minimal_root, uid, no_new_privs), or
    socket_preamble and unisolated without a backend."""
    limits_applied: list[str] = Field(default_factory=list)
    """Limits that were in place: cgroup_v2_memory/pids, cgroup_v1_memory/pids, rlimit_*, tmpfs_size."""
    oom_kills: int = 0
    """Processes of the run the kernel's OOM killer stopped inside the run's memory cgroup."""
    memory_peak_mb: float | None = None
    """Peak memory of the whole run (cgroup), in MiB; None without a memory cgroup."""

    def summary(self, limits: SandboxLimits) -> str:
        """Text for the model: what happened, then the output."""
        memory = " + ".join(a for a in self.limits_applied if "memory" in a or a == "rlimit_as") or "rlimit_as"
        head = {
            "ok": "exit code 0",
            "error": f"exit code {self.exit_code}",
            "timeout": f"timeout after {limits.timeout_s:g}s",
            "cpu_limit": f"killed: CPU time limit ({limits.cpu_s}s)",
            "memory_limit": f"killed: memory limit ({limits.memory_limit_mb} MB, {memory})",
            "file_size_limit": f"killed: file size limit ({limits.max_file_mb} MB)",
            "output_limit": f"output truncated at {limits.max_output_bytes} bytes; program stopped",
            "killed": f"killed by signal {self.signal}",
            "setup_error": "sandbox setup failed",
        }[self.reason]
        parts = [head]
        if self.stdout:
            parts.append("stdout:\n" + self.stdout)
        if self.stderr:
            parts.append("stderr:\n" + self.stderr)
        if self.truncated and self.reason != "output_limit":
            parts.append("[output truncated]")
        return "\n".join(parts)


