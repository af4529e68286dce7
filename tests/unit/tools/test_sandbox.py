"""Adversarial programs against the python sandbox: each one contained, with the right message."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from agentloop.tools.sandbox import SandboxLimits, run_python

# a loaded 2-core CI box can take seconds to start an interpreter: calls expected to succeed get room
RELAXED = dict(timeout_s=10.0, cpu_s=5)
LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=3, memory_limit_mb=256, max_processes=16, max_output_bytes=4096,
                       max_file_mb=1, disk_limit_mb=8)
AS_ROOT = os.geteuid() == 0
root_only = pytest.mark.skipif(not AS_ROOT, reason="namespace/uid isolation needs root; fallbacks are documented")


def run(code: str, limits: SandboxLimits = LIMITS):
    return asyncio.run(run_python(code, limits))


def _uid_processes(base: int) -> list[str]:
    """Processes running under any sandbox uid (there must be none after a run)."""
    left = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                uid = int((d / "status").read_text().split("Uid:")[1].split()[0])
            except (OSError, IndexError):
                continue
            if uid >= base:
                left.append(d.name)
    return left


def test_normal_program():
    r = run("import sys\nprint('hello', 6 * 7)\nprint('warn', file=sys.stderr)")
    assert r.reason == "ok" and r.exit_code == 0
    assert r.stdout == "hello 42\n" and r.stderr == "warn\n"
    assert r.summary(LIMITS).startswith("exit code 0\nstdout:\nhello 42")


def test_error_exit_code():
    r = run("raise SystemExit(3)")
    assert r.reason == "error" and r.exit_code == 3 and "exit code 3" in r.summary(LIMITS)


def test_infinite_loop_times_out():
    r = run("while True: pass", LIMITS.model_copy(update={"timeout_s": 1.0, "cpu_s": 5}))
    assert r.reason == "timeout" and r.timed_out
    assert r.summary(LIMITS.model_copy(update={"timeout_s": 1.0})).startswith("timeout after 1s")
    assert r.wall_s < 3


def test_cpu_limit():
    r = run("while True: pass", LIMITS.model_copy(update={"timeout_s": 10.0, "cpu_s": 1}))
    assert r.reason == "cpu_limit", r
    assert "killed: CPU time limit" in r.summary(LIMITS)


def test_memory_limit():
    r = run("x = bytearray(10 * 1024 ** 3)\nprint('allocated')")
    assert r.reason == "memory_limit" and "allocated" not in r.stdout
    assert r.summary(LIMITS).startswith("killed: memory limit")


def test_huge_output_truncated():
    r = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")  # would print far more than 100 MB
    assert r.reason == "output_limit" and r.truncated
    assert len(r.stdout) == LIMITS.max_output_bytes
    assert "output truncated" in r.summary(LIMITS)
    r = run("print('y' * 100_000_000)")
    assert r.truncated and len(r.stdout) <= LIMITS.max_output_bytes


def test_socket_blocked():
    r = run("import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 22))\nprint('connected')")
    assert "connected" not in r.stdout and r.exit_code != 0
    assert "network" in r.stderr.lower()


@root_only
def test_network_namespace_blocks_raw_sockets():
    # bypass the Python-level preamble: only the network namespace stops this
    r = run("import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', 22))\nprint('connected')")
    assert "net_namespace" in r.isolation
    assert "connected" not in r.stdout and "Network is unreachable" in r.stderr


def test_parent_env_not_visible(monkeypatch):
    monkeypatch.setenv("AGENTLOOP_SECRET_TEST", "hunter2")
    r = run("import os\nprint(sorted(os.environ))\nprint(os.environ.get('AGENTLOOP_SECRET_TEST'))\n"
            "try:\n    print(open(f'/proc/{os.getppid()}/environ','rb').read())\nexcept OSError as e:\n    print('denied')")
    assert r.reason == "ok"
    assert "hunter2" not in r.stdout and "AGENTLOOP_SECRET_TEST" not in r.stdout
    assert "HOME" in r.stdout


@root_only
@pytest.mark.parametrize("target", ["/tmp/agentloop_escape_test", "/agentloop_escape_test",
                                    "/dev/shm/agentloop_escape_test"])
def test_writes_outside_workdir_fail(target):
    Path(target).unlink(missing_ok=True)
    r = run(f"open({target!r}, 'w').write('x')\nprint('wrote')")
    assert "wrote" not in r.stdout and r.exit_code != 0
    assert "Read-only file system" in r.stderr or "Permission denied" in r.stderr
    assert not Path(target).exists()


def test_workdir_is_writable_and_removed():
    r = run("import os\nopen('f.txt', 'w').write('hi')\nprint(os.getcwd())\nprint(open('f.txt').read())")
    assert r.reason == "ok" and r.stdout.endswith("hi\n")
    assert not Path(r.stdout.splitlines()[0]).exists()


@root_only
def test_file_size_and_disk_limits():
    r = run("open('big', 'wb').write(b'x' * (4 << 20))")  # 4 MB > max_file_mb=1
    assert r.reason == "file_size_limit", r
    r = run("for i in range(20):\n    open(f'f{i}', 'wb').write(b'x' * (900 << 10))\nprint('done')")  # 18 MB > 8 MB tmpfs
    assert "done" not in r.stdout and "No space left" in r.stderr


@root_only
def test_fork_bomb_contained_and_concurrent_call_ok():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"

    async def both():
        return await asyncio.gather(run_python(bomb, LIMITS.model_copy(update={"timeout_s": 1.5})),
                                    run_python("print(sum(range(10)))", LIMITS.model_copy(update=RELAXED)))

    bombed, normal = asyncio.run(both())
    assert bombed.reason == "timeout"
    assert normal.reason == "ok" and normal.stdout == "45\n"
    assert _uid_processes(LIMITS.uid_base) == []


def test_concurrent_runs():
    async def many():
        limits = LIMITS.model_copy(update=RELAXED)
        return await asyncio.gather(*(run_python(f"print({i} * 2)", limits) for i in range(4)))

    results = asyncio.run(many())
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(4)], results


def test_python_tool_text():
    from agentloop.tools import get_tool

    tool = get_tool("python")()

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


def test_fallback_without_isolation():
    limits = LIMITS.model_copy(update={"isolate": False})
    r = run("print('ok')", limits)
    assert r.reason == "ok" and r.stdout == "ok\n" and "uid" not in r.isolation
    assert "socket_preamble" in r.isolation
    r = run("import socket\nsocket.socket()", limits)
    assert "network is disabled" in r.stderr
    r = run("while True: pass", limits.model_copy(update={"timeout_s": 1.0}))
    assert r.reason == "timeout"
