"""The sandbox launcher: a stdlib-only program, `python -I -S launcher.py SPEC_FD` (a memfd, marshal data).

It is a separate, single-threaded process so that namespace and credential changes never run in a forked
copy of the (multi-threaded) engine. Every mode first joins the run's cgroups (so everything it starts is
counted and can be killed together), then:

    builtin  (root) unshare(mount, pid, net, ipc, uts, cgroup namespaces); build the minimal root of
             `rootfs.RootPlan` on a tmpfs: read-only nosuid nodev binds, private /tmp /dev/shm WORKDIR tmpfs,
             device files, pivot_root into it, detach the host's root, remount / read-only; fork the
             init (pid 1 of the new pid namespace: a fresh /proc with hidepid=2, reaps orphans), which
             supervises the program
    bwrap    the engine starts bubblewrap itself (one interpreter start less), which builds the same root
             and runs this file inside as `python -I -S -c <this file> --stub SPEC_FD`: join the cgroups,
             a fresh network namespace (bwrap's own has `lo` up), write the files, supervise the program
    none     no isolation (not root, no working bwrap): supervise the program in a host work dir

The supervisor forks the program: rlimits, cwd, channel fds moved to 3 and 4, every other fd closed,
capability bounding set emptied and the run's own uid/gid (as root), PR_SET_NO_NEW_PRIVS (so setuid
binaries gain nothing), PR_SET_PDEATHSIG(SIGKILL), then execve of the interpreter with a scrubbed
environment. The cgroups are joined by writing "0" to `cgroup.procs` fds the engine opened, so that
everything forked afterwards is counted. It writes events to STATUS_FD, each a 4-byte big-endian length
and a marshal'ed dict:
{"event": "started"} once the program is forked, then {"event": "exit", exit_code | signal, cpu_s}; a
setup failure writes {"event": "error", "message"} and exits 125. (marshal, not json: importing json and
re is a noticeable part of a start on a loaded machine, and this runs once per sandboxed run.) When the
program ends, the supervisor exits; with a pid namespace the kernel then kills every
process still in it (double-forked daemons included).
"""

import ctypes
import fcntl
import marshal
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_GET_NO_NEW_PRIVS = 1, 24, 38, 39
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}.get(os.uname().machine)
STAGING = "/tmp"  # where the new root is assembled, in our private mount namespace only

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


class SetupError(Exception):
    pass


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def _mount(src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {src} on {target}")


def _prctl(option, arg):
    _check(_libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


class Status:
    def __init__(self, fd):
        self.fd = fd

    def send(self, **event):
        try:
            data = marshal.dumps(event)
            os.write(self.fd, len(data).to_bytes(4, "big") + data)
        except OSError:
            pass  # the engine stopped listening: nothing left to tell


# ------------------------------------------------------------------ the minimal root (builtin backend)


def _bind(fd, target, flags):
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | flags)


def _touch(path):
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))


def build_root(spec):
    """Assemble the root of `spec["root"]` on a tmpfs and pivot into it (we are in a fresh mount namespace)."""
    plan, r, disk = spec["root"], STAGING, spec["disk_bytes"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # open every source first: the staging tmpfs may shadow one of them, an O_PATH fd still reaches it
    fds = {}
    for src in plan["ro_binds"] + plan["dev_nodes"]:
        try:
            fds[src] = os.open(src, os.O_PATH | os.O_CLOEXEC)
        except OSError as e:
            raise SetupError(f"cannot open {src} to bind it: {e}") from None
    os.umask(0o022)
    _mount("tmpfs", r, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in ("/dev/shm", "/tmp"):  # before the binds: one under /tmp (extra_ro) must stay visible
        os.makedirs(r + path, mode=0o755, exist_ok=True)
        _mount("tmpfs", r + path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk},mode=1777")
    for d in plan["dirs"]:
        os.makedirs(r + d, mode=0o755, exist_ok=True)
    ro = MS_RDONLY | MS_NOSUID | MS_NODEV
    for src in plan["ro_binds"]:
        if os.path.isdir(f"/proc/self/fd/{fds[src]}"):
            os.makedirs(r + src, mode=0o755, exist_ok=True)
        else:
            _touch(r + src)
        _bind(fds[src], r + src, ro)
    for target, path in plan["symlinks"]:
        os.symlink(target, r + path)
    for node in plan["dev_nodes"]:
        _touch(r + node)
        _bind(fds[node], r + node, MS_NOSUID | MS_NOEXEC)  # device files: writable, but nothing runs from them
    for target, path in plan["dev_links"]:
        os.symlink(target, r + path)
    work = spec["workdir"]
    os.makedirs(r + work, mode=0o755, exist_ok=True)
    owner = f",uid={spec['uid']},gid={spec['gid']}" if spec.get("uid") is not None else ""
    _mount("tmpfs", r + work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk},mode=0700{owner}")
    os.makedirs(r + "/proc", mode=0o555, exist_ok=True)
    os.makedirs(r + "/.oldroot", mode=0o700)
    for fd in fds.values():
        os.close(fd)
    if SYS_PIVOT_ROOT is None:
        raise SetupError(f"pivot_root: unknown syscall number on {os.uname().machine}")
    _check(_libc.syscall(SYS_PIVOT_ROOT, (r).encode(), (r + "/.oldroot").encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.oldroot", MNT_DETACH), "umount the host root")
    os.rmdir("/.oldroot")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | ro)


# ------------------------------------------------------------------ the program and its supervisor


def write_files(spec):
    uid, gid = spec.get("uid"), spec.get("gid")
    if uid is not None and spec["mode"] == "bwrap":
        os.chown(spec["workdir"], uid, gid)  # bwrap made the tmpfs as root
    for name, text in spec["files"].items():
        path = os.path.join(spec["workdir"], name)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        if uid is not None:
            os.chown(path, uid, gid)


def _set_rlimits(spec):
    cpu = int(spec["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # soft: SIGXCPU, hard: SIGKILL
    resource.setrlimit(resource.RLIMIT_AS, (spec["mem_bytes"], spec["mem_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize_bytes"], spec["fsize_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))


def _program(spec):
    """In the forked child: never returns (execve or _exit)."""
    try:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.chdir(spec["workdir"])
        chans = spec.get("channels") or []
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 16) for fd in chans]  # clear of 3 and 4 first
        for i, fd in enumerate(high):
            os.dup2(fd, 3 + i, inheritable=True)
        os.closerange(3 + len(chans), resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        _set_rlimits(spec)
        uid = spec.get("uid")
        if uid is not None:
            cap = 0
            while _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # until EINVAL: past the last capability
                cap += 1
            os.setgroups([])
            os.setresgid(spec["gid"], spec["gid"], spec["gid"])
            os.setresuid(uid, uid, uid)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        if _libc.prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) != 1:
            raise SetupError("PR_SET_NO_NEW_PRIVS did not stick")
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.execve(spec["python"], spec["argv"], spec["env"])
    except BaseException as e:  # noqa: BLE001 - reported on stderr; the supervisor reports exit code 126
        try:
            os.write(2, f"sandbox setup failed: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(126)


def supervise(spec, status):
    """Fork the program, reap children until it ends, report; returns our exit code."""
    pid = os.fork()
    if pid == 0:
        _program(spec)
    _close_channels(spec)  # the program's pipes end when the program (and what it started) ends
    status.send(event="started")
    while True:
        try:
            got, wstatus, ru = os.wait4(-1, 0)  # also reaps orphans reparented to us (as pid 1)
        except ChildProcessError:
            status.send(event="error", message="the program vanished")
            return 125
        if got == pid:
            break
    event = {"event": "exit", "cpu_s": ru.ru_utime + ru.ru_stime, "exit_code": None, "signal": None}
    if os.WIFSIGNALED(wstatus):
        event["signal"] = os.WTERMSIG(wstatus)
    else:
        event["exit_code"] = os.WEXITSTATUS(wstatus)
    status.send(**event)
    return 0


def _close_channels(spec):
    for fd in spec.get("channels") or []:
        try:
            os.close(fd)
        except OSError:
            pass


def _init(spec, status):
    """pid 1 of the new pid namespace (builtin backend)."""
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the launcher killed -> we die -> the namespace dies
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
        code = supervise(spec, status)
    except BaseException as e:  # noqa: BLE001
        status.send(event="error", message=f"{type(e).__name__}: {e}")
        code = 125
    os._exit(code)


def _read_spec(fd):
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            break
        chunks.append(b)
    return marshal.loads(b"".join(chunks))


def _join_cgroups(spec):
    """Move ourselves into the run's cgroups through fds the engine opened (they work inside bwrap too)."""
    for fd in spec.get("cgroup_fds") or []:
        os.write(fd, b"0")
        os.close(fd)


def main():
    stub = sys.argv[1] == "--stub"
    spec_fd = int(sys.argv[2] if stub else sys.argv[1])
    spec = _read_spec(spec_fd)
    status = Status(spec["status_fd"])
    try:
        if stub:  # inside bubblewrap
            os.close(spec_fd)
            _join_cgroups(spec)
            if spec.get("uid") is not None:  # root bwrap (no user namespace): we hold the capabilities
                # bubblewrap configures `lo` in its network namespace; a fresh one has none up, as with the
                # builtin backend: no network at all, not even loopback (unprivileged bwrap keeps its lo)
                _check(_libc.unshare(CLONE_NEWNET), "unshare(net namespace)")
            write_files(spec)
            sys.exit(supervise(spec, status))
        _join_cgroups(spec)
        mode = spec["mode"]
        os.close(spec_fd)
        if mode == "none":
            write_files(spec)
            sys.exit(supervise(spec, status))
        flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
        _check(_libc.unshare(flags), "unshare(mount, pid, net, ipc, uts, cgroup namespaces)")
        build_root(spec)
        write_files(spec)
        pid = os.fork()
        if pid == 0:
            _init(spec, status)
        _close_channels(spec)
        _, wstatus = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(wstatus) if os.WIFEXITED(wstatus) else 125)
    except (SetupError, OSError) as e:
        status.send(event="error", message=f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e))
        sys.exit(125)


if __name__ == "__main__":
    main()
