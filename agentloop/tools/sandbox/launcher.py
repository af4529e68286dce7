"""The sandbox launcher: a tiny stdlib-only program run as `python -I -S sandbox_launcher.py SPEC STATUS_FD`.

It is a separate, single-threaded process so that namespace and credential changes never run
in a forked copy of the (multi-threaded) engine. Steps, each recorded in the status it writes:

    1. unshare(CLONE_NEWNET)   no network at all (not even loopback)          -> status.net
    2. unshare(CLONE_NEWNS)    private mounts: every mount remounted read-only,
                               a size-limited tmpfs mounted on the work dir     -> status.mount
    3. unshare(CLONE_NEWPID)   the user program is pid 1 of a new pid namespace:
                               when it exits or is killed, everything it forked dies -> status.pid
    4. fork; the child: fresh /proc, rlimits (CPU, AS, NPROC, FSIZE, CORE, NOFILE), cwd = work dir,
       drop to the episode's own unprivileged uid/gid, PR_SET_PDEATHSIG(SIGKILL), execve the
       interpreter with a scrubbed environment.
    5. the launcher waits, kills whatever is left under that uid (when it has no pid namespace),
       and writes one JSON status line to STATUS_FD: exit code or signal, CPU seconds, which
       isolation steps worked, setup errors.

Every step is best effort: when not root (or without CAP_SYS_ADMIN) the matching isolation is
missing and the status says so; `agentloop.tools.sandbox` then adds its fallbacks.

`python -I -S sandbox_launcher.py --reap UID` kills every process of UID (used after a timeout).
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flag: int, what: str) -> None:
    _check(_libc.unshare(flag), f"unshare({what})")


def _mount(src, target: str, fstype, flags: int, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            mp = line.split()[4]
            mp = mp.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
            if mp not in points:
                points.append(mp)
    return points


def _readonly_everything(errors: list[str]) -> None:
    """Remount every mount point read-only (keeping nosuid/nodev/noexec) in our private namespace."""
    for mp in _mount_points():
        try:
            st = os.statvfs(mp)
        except OSError as e:
            errors.append(f"statvfs {mp}: {e}")
            continue
        keep = st.f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)  # ST_* and MS_* agree for these bits
        try:
            _mount(None, mp, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
        except OSError as e:
            errors.append(str(e))


def _set_limits(spec: dict) -> None:
    cpu = int(spec["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # soft: SIGXCPU, hard: SIGKILL
    resource.setrlimit(resource.RLIMIT_AS, (spec["mem_bytes"], spec["mem_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize_bytes"], spec["fsize_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))


def _reap_uid(uid: int) -> None:
    """Kill every process of `uid`: fork, become `uid`, kill(-1) (which reaches exactly that uid's processes)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            for _ in range(3):  # a fork bomb may fork between rounds; a few rounds catch stragglers
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:
                    break
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _child(spec: dict, status: dict) -> None:
    """In the forked child: never returns (execve or _exit)."""
    try:
        if status["pid"] and status["mount"]:
            try:
                _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            except OSError:
                pass  # the host /proc stays (read-only); other users' /proc/<pid>/environ is still unreadable
        _set_limits(spec)
        os.chdir(spec["workdir"])
        uid = spec.get("uid")
        if uid is not None:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(uid)
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.execve(spec["python"], spec["argv"], spec["env"])
    except BaseException as e:  # noqa: BLE001 - reported on stderr, the launcher reports the exit code
        try:
            os.write(2, f"sandbox setup failed: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(126)


def main() -> None:
    if sys.argv[1] == "--reap":
        _reap_uid(int(sys.argv[2]))
        return
    spec = json.loads(sys.argv[1])
    status_fd = int(sys.argv[2])
    os.set_inheritable(status_fd, False)
    status = {"net": False, "mount": False, "pid": False, "errors": []}
    errors: list[str] = status["errors"]
    if spec.get("isolate", True):
        try:
            _unshare(CLONE_NEWNET, "CLONE_NEWNET")
            status["net"] = True
        except OSError as e:
            errors.append(str(e))
        try:
            _unshare(CLONE_NEWNS, "CLONE_NEWNS")
            _mount(None, "/", None, MS_REC | MS_PRIVATE)
            code_path = os.path.join(spec["workdir"], spec["code_file"])
            with open(code_path, "rb") as fh:
                code = fh.read()
            _readonly_everything(errors)
            uid, gid = spec.get("uid"), spec.get("gid")
            opts = f"size={spec['disk_bytes']},mode=0700" + (f",uid={uid},gid={gid}" if uid is not None else "")
            _mount("tmpfs", spec["workdir"], "tmpfs", MS_NOSUID | MS_NODEV, opts)
            with open(code_path, "wb") as fh:
                fh.write(code)
            if uid is not None:
                os.chown(code_path, uid, gid)
            status["mount"] = True
        except OSError as e:
            errors.append(str(e))
        try:
            _unshare(CLONE_NEWIPC, "CLONE_NEWIPC")
        except OSError as e:
            errors.append(str(e))
        try:
            _unshare(CLONE_NEWPID, "CLONE_NEWPID")
            status["pid"] = True
        except OSError as e:
            errors.append(str(e))

    pid = os.fork()
    if pid == 0:
        _child(spec, status)
    _, wstatus, ru = os.wait4(pid, 0)
    if os.WIFSIGNALED(wstatus):
        status["signal"] = os.WTERMSIG(wstatus)
        status["exit_code"] = None
    else:
        status["signal"] = None
        status["exit_code"] = os.WEXITSTATUS(wstatus)
    status["cpu_s"] = ru.ru_utime + ru.ru_stime
    status["maxrss_kb"] = ru.ru_maxrss
    if spec.get("uid") is not None and not status["pid"]:
        _reap_uid(spec["uid"])  # background processes the program left behind
    os.write(status_fd, (json.dumps(status) + "\n").encode())


if __name__ == "__main__":
    main()
