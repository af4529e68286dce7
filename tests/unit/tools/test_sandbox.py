"""Adversarial programs against the python sandbox: each one contained, with the right message.

Every isolating backend runs the same suite (the `backend` fixture: builtin needs root, bwrap needs
bubblewrap; a missing one is skipped with the reason). The unisolated fallback has its own tests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import socket
import stat
from pathlib import Path

import pytest

import agentloop
from agentloop.tools.sandbox import SandboxLimits, cgroups, run_python
from agentloop.tools.sandbox import backends as sandbox_backends
from agentloop.tools.sandbox.backends import find_bwrap

# a loaded 2-core CI box can take seconds to start an interpreter: calls expected to succeed get room
RELAXED = dict(timeout_s=10.0, cpu_s=5)
LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=3, memory_limit_mb=256, max_processes=16, max_output_bytes=4096,
                       max_file_mb=1, disk_limit_mb=8)
AS_ROOT = os.geteuid() == 0
CHECKOUT = Path(agentloop.__file__).resolve().parents[1]
root_only = pytest.mark.skipif(not AS_ROOT, reason="uid isolation and cgroups need root; fallbacks are documented")


@pytest.fixture(params=["builtin", "bwrap"])
def backend(request) -> str:
    if request.param == "builtin" and not AS_ROOT:
        pytest.skip("the builtin backend needs root")
    if request.param == "bwrap" and find_bwrap() is None:
        pytest.skip("bubblewrap is not installed (scripts/setup.sh installs it where apt and root are available)")
    return request.param


@pytest.fixture
def limits(backend: str) -> SandboxLimits:
    return LIMITS.model_copy(update={"backend": backend})


def run(code: str, limits: SandboxLimits = LIMITS, **kw):
    return asyncio.run(run_python(code, limits, **kw))


def _uid_processes(base: int) -> list[str]:
    """Processes running under a sandbox uid of this process (there must be none after a run); other
    processes on the host may be running sandboxes of their own."""
    base += (os.getpid() % 10000) * 1000
    left = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                uid = int((d / "status").read_text().split("Uid:")[1].split()[0])
            except (OSError, IndexError):
                continue
            if base <= uid < base + 1000:
                left.append(d.name)
    return left


def _processes_with(marker: str) -> list[str]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker in (d / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(d.name)
            except OSError:
                continue
    return found


# ---------------------------------------------------------------- the original suite, on every backend


def test_normal_program(limits):
    r = run("import sys\nprint('hello', 6 * 7)\nprint('warn', file=sys.stderr)", limits)
    assert r.reason == "ok" and r.exit_code == 0
    assert r.stdout == "hello 42\n" and r.stderr == "warn\n"
    assert r.summary(limits).startswith("exit code 0\nstdout:\nhello 42")
    assert r.backend == limits.backend and "minimal_root" in r.isolation and "no_new_privs" in r.isolation


def test_venv_packages_importable(limits):
    # the interpreter's own installation is bound: stdlib and the venv's packages (not the pyenv's) import
    r = run("import sys, json, sqlite3, numpy\nprint(sys.prefix)\nprint(numpy.__file__)",
            limits.model_copy(update=RELAXED))
    import sys

    assert r.reason == "ok", r
    assert r.stdout.splitlines()[0] == sys.prefix
    assert r.stdout.splitlines()[1].startswith(sys.prefix)


def test_error_exit_code(limits):
    r = run("raise SystemExit(3)", limits)
    assert r.reason == "error" and r.exit_code == 3 and "exit code 3" in r.summary(limits)


def test_infinite_loop_times_out(limits):
    r = run("while True: pass", limits.model_copy(update={"timeout_s": 1.0, "cpu_s": 5}))
    assert r.reason == "timeout" and r.timed_out
    assert r.summary(limits.model_copy(update={"timeout_s": 1.0})).startswith("timeout after 1s")


def test_cpu_limit(limits):
    r = run("while True: pass", limits.model_copy(update={"timeout_s": 10.0, "cpu_s": 1}))
    assert r.reason == "cpu_limit", r
    assert "killed: CPU time limit" in r.summary(limits)


def test_memory_limit(limits):
    r = run("x = bytearray(10 * 1024 ** 3)\nprint('allocated')", limits)
    assert r.reason == "memory_limit" and "allocated" not in r.stdout
    assert r.summary(limits).startswith("killed: memory limit")


def test_huge_output_truncated(limits):
    r = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", limits)  # would print far more than 100 MB
    assert r.reason == "output_limit" and r.truncated
    assert len(r.stdout) == limits.max_output_bytes
    assert "output truncated" in r.summary(limits)
    r = run("print('y' * 100_000_000)", limits)
    assert r.truncated and len(r.stdout) <= limits.max_output_bytes


def test_socket_blocked(limits):
    r = run("import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 22))\nprint('connected')", limits)
    assert "connected" not in r.stdout and r.exit_code != 0
    assert "network" in r.stderr.lower()


@root_only
def test_network_namespace_blocks_raw_sockets(limits):
    # bypass the Python-level preamble: only the network namespace stops this (no interface is up)
    r = run("import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', 22))\nprint('connected')", limits)
    assert "net_namespace" in r.isolation
    assert "connected" not in r.stdout and "Network is unreachable" in r.stderr


def test_parent_env_not_visible(monkeypatch, limits):
    monkeypatch.setenv("AGENTLOOP_SECRET_TEST", "hunter2")
    r = run("import os\nprint(sorted(os.environ))\nprint(os.environ.get('AGENTLOOP_SECRET_TEST'))\n"
            "try:\n    print(open(f'/proc/{os.getppid()}/environ','rb').read())\nexcept OSError as e:\n"
            "    print('denied')", limits)
    assert r.reason == "ok"
    assert "hunter2" not in r.stdout and "AGENTLOOP_SECRET_TEST" not in r.stdout
    assert "HOME" in r.stdout


def test_writes_outside_workdir_fail(limits):
    # the root and every bind are read-only; /tmp and /dev/shm are the run's own tmpfs: writes there stay
    # inside the run (gone afterwards) and never reach the host's /tmp or /dev/shm
    targets = ["/tmp/agentloop_escape_test", "/agentloop_escape_test", "/dev/shm/agentloop_escape_test",
               "/usr/agentloop_escape_test", f"{os.path.dirname(os.__file__)}/agentloop_escape_test"]
    for target in targets:
        Path(target).unlink(missing_ok=True)
    r = run("import os\nfor t in %r:\n    try:\n        open(t, 'w').write('x')\n        print('wrote', t)\n"
            "    except OSError as e:\n        print('failed', t, e.strerror)" % (targets,), limits)
    assert r.reason == "ok", r
    for target in targets[:1] + targets[2:3]:
        assert f"wrote {target}" in r.stdout  # private
    for target in targets[1:2] + targets[3:]:
        assert f"failed {target} Read-only file system" in r.stdout or f"failed {target} Permission denied" in r.stdout
    for target in targets:
        assert not Path(target).exists()


def test_workdir_is_writable_and_removed(limits):
    r = run("import os\nopen('f.txt', 'w').write('hi')\nprint(os.getcwd())\nprint(open('f.txt').read())", limits)
    assert r.reason == "ok" and r.stdout.endswith("hi\n")
    assert not Path(r.stdout.splitlines()[0]).exists()


def test_file_size_and_disk_limits(limits):
    r = run("open('big', 'wb').write(b'x' * (4 << 20))", limits)  # 4 MB > max_file_mb=1
    assert r.reason == "file_size_limit", r
    r = run("for i in range(20):\n    open(f'f{i}', 'wb').write(b'x' * (900 << 10))\nprint('done')", limits)  # 18 MB > 8 MB
    assert "done" not in r.stdout and "No space left" in r.stderr


def test_fork_bomb_contained_and_concurrent_call_ok(limits):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"

    async def both():
        return await asyncio.gather(run_python(bomb, limits.model_copy(update={"timeout_s": 1.5})),
                                    run_python("print(sum(range(10)))", limits.model_copy(update=RELAXED)))

    bombed, normal = asyncio.run(both())
    assert bombed.reason == "timeout"
    assert normal.reason == "ok" and normal.stdout == "45\n"
    assert _uid_processes(limits.uid_base) == []


def test_concurrent_runs(limits):
    async def many():
        lim = limits.model_copy(update=RELAXED)
        return await asyncio.gather(*(run_python(f"print({i} * 2)", lim) for i in range(4)))

    results = asyncio.run(many())
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(4)], results


# ---------------------------------------------------------------- the gaps the minimal root and cgroups close


@root_only
def test_setuid_binaries_gain_nothing(limits, tmp_path):
    # a setuid-root copy of `id`, once where the old sandbox could see it (host /tmp) and once bound in on
    # purpose (extra_ro): unreachable in the first case, and no euid 0 in the second (nosuid + no_new_privs)
    d = Path(f"/tmp/agentloop-suid-{secrets.token_hex(4)}")
    d.mkdir(mode=0o755)
    try:
        shutil.copy("/usr/bin/id", d / "id")
        os.chmod(d / "id", 0o4755)
        assert (d / "id").stat().st_mode & stat.S_ISUID
        code = ("import subprocess\nfor p in [%r, '/usr/bin/su']:\n    try:\n"
                "        r = subprocess.run([p] + ([] if p.endswith('id') else ['-c', 'id']), capture_output=True,"
                " text=True, timeout=5, stdin=subprocess.DEVNULL)\n        print(p, r.stdout.strip(), r.stderr.strip())\n"
                "    except OSError as e:\n        print(p, 'not runnable', e.strerror)\n"
                "print(open('/proc/self/status').read().split('NoNewPrivs:')[1].split()[0])\n"
                "print([l.split()[4] for l in open('/proc/self/mountinfo') if 'nosuid' not in l.split()[5]])"
                % str(d / "id"))
        lim = limits.model_copy(update=RELAXED)
        hidden = run(code, lim)
        assert hidden.reason == "ok", hidden
        assert f"{d / 'id'} not runnable No such file or directory" in hidden.stdout
        bound = run(code, lim, extra_ro=(str(d),))
        assert bound.reason == "ok", bound
        lines = bound.stdout.splitlines()
        assert lines[0].startswith(str(d / "id") + " uid=") and "euid=0" not in lines[0], lines
        assert "uid=0" not in lines[1] and "euid=0" not in lines[1], lines  # host su: no privilege either
        assert lines[2] == "1" and lines[3] == "[]", lines  # NoNewPrivs, every mount nosuid
    finally:
        shutil.rmtree(d)


def test_host_files_are_not_readable(limits):
    # run dirs (rollouts hold ground_truth), data files, the checkout, /root: nothing of them exists inside
    tag = secrets.token_hex(6)
    secret = f"ground_truth-secret-{tag}"
    run_dir = CHECKOUT / "runs" / f"sandbox-test-{tag}"
    data_dir = Path(f"/tmp/agentloop-data-{tag}")
    planted = [run_dir / "rollouts.jsonl", data_dir / "train.jsonl", CHECKOUT / f".sandbox-secret-{tag}",
               Path(f"/root/.sandbox-secret-{tag}")]
    try:
        for p in list(planted):
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(secret)
                os.chmod(p, 0o644)
            except PermissionError:  # not root: /root and maybe the checkout are not ours to write
                planted.remove(p)
        assert planted  # the data dir in /tmp at least; the checkout is also probed through its own source
        paths = [str(p) for p in planted] + [agentloop.__file__, str(Path.home() / ".bash_history"), "/etc/passwd",
                                             "/etc/shadow"]
        code = ("for p in %r:\n    try:\n        print(p, 'READ', open(p, errors='replace').read()[:200])\n"
                "    except OSError as e:\n        print(p, 'denied', type(e).__name__)\n"
                "import os\nprint(sorted(os.listdir('/')))" % (paths,))
        r = run(code, limits)
        assert r.reason == "ok", r
        assert secret not in r.stdout and "READ" not in r.stdout, r.stdout
        top = eval(r.stdout.splitlines()[-1])  # our own program's repr of a list of names
        assert "home" not in top and "runs" not in top and "var" not in top, top
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(data_dir, ignore_errors=True)
        for p in planted:
            p.unlink(missing_ok=True)


@root_only
def test_memory_bomb_over_16_processes_stays_in_its_cgroup(limits):
    # each child stays under RLIMIT_AS (256 MB), together they want 1 GB: only a cgroup limits the tree
    code = ("import os, time\nkids = []\nfor i in range(16):\n    pid = os.fork()\n    if pid == 0:\n"
            "        x = bytearray(b'x') * (64 << 20)\n        time.sleep(3)\n        os._exit(0)\n    kids.append(pid)\n"
            "killed = 0\nfor pid in kids:\n    _, st = os.waitpid(pid, 0)\n    killed += os.WIFSIGNALED(st)\n"
            "print('killed', killed)\nraise SystemExit(min(killed, 100))")
    support = cgroups.detect()
    if support.kind == "none":
        pytest.skip(f"no usable memory cgroup on this host ({support.reason}); rlimits only")
    r = run(code, limits.model_copy(update={"max_processes": 40, "timeout_s": 20.0, "cpu_s": 10}))
    assert f"cgroup_{support.kind}_memory" in r.limits_applied and f"cgroup_{support.kind}_pids" in r.limits_applied
    assert r.reason == "memory_limit", r
    assert r.oom_kills >= 1
    assert r.memory_peak_mb is not None and r.memory_peak_mb <= limits.memory_limit_mb + 1
    assert r.summary(limits).startswith("killed: memory limit")


def test_double_forked_daemon_is_gone_after_release(backend):
    from agentloop.tools import get_tool
    from agentloop.tools.config import PythonToolConfig, ToolsConfig

    marker = f"7{secrets.randbelow(10**6)}.25"  # sleep's argument: findable in the host's /proc
    code = ("import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv('/usr/bin/sleep', ['sleep', '{marker}'])\n    os._exit(0)\n"
            "os.wait()\nprint('parent done')")
    tool = get_tool("python")(ToolsConfig(python=PythonToolConfig(backend=backend, timeout_s=10)))

    async def go():
        inst = await tool.create(None)
        try:
            return await tool.execute(inst, {"code": code})
        finally:
            await tool.release(inst)

    resp = asyncio.run(go())
    assert resp.error is None and "parent done" in resp.text
    assert _processes_with(marker) == []


def test_unix_socket_of_a_host_service_is_unreachable(limits):
    # the pattern of dbus/X11: a world-writable socket file in the host's /tmp
    path = f"/tmp/agentloop-svc-{secrets.token_hex(4)}.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(4)
    srv.setblocking(False)
    try:
        code = ("import _socket\ns = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)\n"
                f"s.connect({path!r})\ns.send(b'pwned')\nprint('sent')")
        r = run(code, limits)
        assert "sent" not in r.stdout and "No such file or directory" in r.stderr, r
        with pytest.raises(BlockingIOError):  # nothing ever connected (a connect would wait in the backlog)
            srv.accept()
    finally:
        srv.close()
        os.unlink(path)


def test_other_runs_work_dir_is_invisible(limits):
    # A writes a secret into its work dir and keeps running; B searches every place it could be meanwhile
    secret = f"episode-secret-{secrets.token_hex(6)}"
    writer = ("import os, time\nopen('answer.txt', 'w').write(%r)\nt0 = time.time()\n"
              "while time.time() - t0 < 3:\n    pass\nprint(t0, time.time(), os.getcwd())" % secret)
    searcher = ("import glob, os, time\nt0 = time.time()\nfound = []\nwhile time.time() - t0 < 2:\n"
                "    for pat in ['/tmp/*', '/tmp/*/*', '/sandbox/*', '/proc/*/cwd/*', '/proc/*/root/sandbox/*',"
                " '/dev/shm/*', '/*/*']:\n"
                "        for p in glob.glob(pat):\n            try:\n"
                "                if os.path.isfile(p) and %r + %r in open(p, 'rb').read(1 << 20):\n"
                "                    found.append(p)\n            except OSError:\n                pass\n"
                "print(t0, time.time(), found)" % (secret.encode()[:8], secret.encode()[8:]))  # not in its own source
    lim = limits.model_copy(update={"timeout_s": 15.0, "cpu_s": 10})

    async def both():
        return await asyncio.gather(run_python(writer, lim), run_python(searcher, lim))

    a, b = asyncio.run(both())
    assert a.reason == "ok" and b.reason == "ok", (a, b)
    a0, a1, _ = a.stdout.split()
    b0, b1, found = b.stdout.split(maxsplit=2)
    assert float(b0) < float(a1) and float(a0) < float(b1), "the two runs did not overlap"
    assert found.strip() == "[]"


def test_start_storms_are_capped(monkeypatch, limits):
    from agentloop.tools.sandbox import runner

    active, peak = 0, 0
    original = runner.SandboxProcess._start

    async def spy(self, *a, **k):
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        try:
            await original(self, *a, **k)
            await self.wait_started()
        finally:
            active -= 1

    monkeypatch.setattr(runner.SandboxProcess, "_start", spy)
    lim = limits.model_copy(update={**RELAXED, "max_concurrent_starts": 2})

    async def many():
        return await asyncio.gather(*(run_python("print(1)", lim) for _ in range(6)))

    results = asyncio.run(many())
    assert all(r.stdout == "1\n" for r in results), results
    assert peak == 2


def test_python_tool_text(backend):
    from agentloop.tools import get_tool
    from agentloop.tools.config import PythonToolConfig, ToolsConfig

    tool = get_tool("python")(ToolsConfig(python=PythonToolConfig(backend=backend)))

    async def go():
        inst = await tool.create(None, timeout_s=1)
        try:
            ok = await tool.execute(inst, {"code": "print(2 ** 10)"})
            slow = await tool.execute(inst, {"code": "while True: pass"})
        finally:
            await tool.release(inst)
        return ok, slow

    ok, slow = asyncio.run(go())
    assert ok.error is None and "1024" in ok.text
    assert slow.error == "timeout" and slow.text.startswith("timeout after 1s")


# ---------------------------------------------------------------- backend choice, the unisolated fallback


def test_isolation_status_here():
    st = sandbox_backends.isolation_status(SandboxLimits())
    if AS_ROOT or find_bwrap():
        assert st.isolated and st.backend == ("bwrap" if find_bwrap() else "builtin"), st
    assert sandbox_backends.isolation_status(SandboxLimits(isolate=False)) == (False, "none",
                                                                                  "tools.python.isolate is false")


@pytest.fixture
def no_backend(monkeypatch):
    """This process as a non-root user on a host without bubblewrap."""
    monkeypatch.setattr(sandbox_backends, "find_bwrap", lambda: None)
    monkeypatch.setattr(sandbox_backends, "is_root", lambda: False)
    monkeypatch.setattr(sandbox_backends, "_STATUS", {})
    from agentloop.tools.sandbox import runner

    monkeypatch.setattr(runner, "_WARNED", set())


def test_unisolated_is_refused_for_training_unless_allowed(no_backend):
    from agentloop.config import Config
    from agentloop.errors import ConfigError
    from agentloop.train.orchestrator.loop import run_train

    st = sandbox_backends.isolation_status(SandboxLimits())
    assert not st.isolated and st.backend == "none"
    assert "bubblewrap is not installed" in st.reason and "needs root" in st.reason
    with pytest.raises(ConfigError, match="tools.python.allow_unisolated=true"):
        sandbox_backends.require_isolation(SandboxLimits())
    assert sandbox_backends.require_isolation(SandboxLimits(allow_unisolated=True)) == st
    cfg = Config()
    with pytest.raises(ConfigError, match="agentloop train refuses to run model-written code unisolated"):
        run_train(cfg)  # before any server, learner or run dir


def test_unisolated_rollout_warns_loudly_once(no_backend, caplog):
    caplog.set_level(logging.WARNING, logger="agentloop.tools.sandbox.runner")

    async def two():
        return [await run_python("print('hi')", LIMITS) for _ in range(2)]

    rs = asyncio.run(two())
    assert [r.stdout for r in rs] == ["hi\n", "hi\n"] and rs[0].backend == "none"
    assert "unisolated" in rs[0].isolation and "socket_preamble" in rs[0].isolation
    loud = [r for r in caplog.records if "UNISOLATED" in r.getMessage()]
    assert len(loud) == 1 and "allow_unisolated" in loud[0].getMessage()


def test_asked_for_backend_that_does_not_work_is_a_setup_error(no_backend):
    r = run("print('hi')", LIMITS.model_copy(update={"backend": "bwrap"}))
    assert r.reason == "setup_error" and r.stdout == "" and "bubblewrap is not installed" in r.stderr


def test_fallback_without_isolation():
    limits = LIMITS.model_copy(update={"isolate": False})
    r = run("print('ok')", limits)
    assert r.reason == "ok" and r.stdout == "ok\n" and "uid" not in r.isolation
    assert "socket_preamble" in r.isolation and r.backend == "none"
    r = run("import socket\nsocket.socket()", limits)
    assert "network is disabled" in r.stderr
    r = run("while True: pass", limits.model_copy(update={"timeout_s": 1.0}))
    assert r.reason == "timeout"


def test_bwrap_command_line_is_sealed():
    # the flags that matter, whatever bwrap does by default: own namespaces, dies with us, read-only root
    from agentloop.tools.sandbox.rootfs import root_plan

    argv = sandbox_backends.bwrap_argv("/usr/bin/bwrap", root_plan(os.path.realpath("/usr/bin/python3")),
                                       "/usr/bin/python3", 1 << 20, 7)
    for flag in ("--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
                 "--new-session", "--remount-ro"):
        assert flag in argv
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind"]
    assert "/usr" in binds and not any(b in ("/", "/home", "/root", "/tmp", "/work") for b in binds), binds
    assert "--bind" not in argv and "--dev-bind" not in argv
