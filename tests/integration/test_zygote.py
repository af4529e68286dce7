"""The zygote that forks CPU SGLang servers (agentloop.inference.sglang_cpu.zygote), against real servers: a forked
server serves and stops like a spawned one, its exit code comes back, it dies with the process that asked for it and
with the zygote, and a server whose environment the zygote cannot serve is spawned instead.

Each test starts a zygote of its own (the session's, tests/conftest.py, serves the other tests' servers)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentloop.errors import ServerStartError
from agentloop.inference.launcher import LocalServer
from agentloop.inference.sglang_cpu import zygote
from agentloop.util.zygote import _fixed
from tests.conftest import SERVER_START_GUARD_S, require_sglang

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]


def _gone(pids: list[int]) -> bool:
    return not any(Path(f"/proc/{p}").exists() and "Z" not in _state(p) for p in pids)


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat[stat.rfind(")") + 2:].split()[0]


def _wait_until(cond, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout  # a hang guard, not a verdict
    while not cond():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.05)


@pytest.fixture
def own_zygote(tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, subprocess.Popen]]:
    require_sglang()
    sock = tmp_path / "z" / "zygote.sock"
    proc = zygote.start(sock, tmp_path / "zygote.log")
    monkeypatch.setenv(zygote.ENV, str(sock))
    try:
        yield sock, proc
    finally:
        proc.kill()
        proc.wait()


def test_a_forked_server_serves_stops_cleanly_and_dies_with_its_requester(own_zygote, tiny_model_path, tmp_path,
                                                                          monkeypatch):
    sock, zproc = own_zygote
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(32 << 20))  # a LoRA server's: applied in the forked server
    server = LocalServer(tiny_model_path, log_path=tmp_path / "s.log", startup_timeout_s=SERVER_START_GUARD_S).start()
    try:
        assert isinstance(server.process, zygote.ForkedProcess)
        asyncio.run(server.wait_ready())
        assert f"forked by the zygote {zproc.pid}" in server.log_path.read_text()
        pids = server.group_pids()
        assert server.pid in pids and len(pids) >= 3  # its own session: main process, scheduler, detokenizer
        assert os.getsid(server.pid) == server.pid
        # `ps` shows a server, not the zygote
        assert b"agentloop.inference.sglang_cpu.launch_server" in Path(f"/proc/{server.pid}/cmdline").read_bytes()
    finally:
        server.stop()
    assert server.process.returncode == 0  # SGLang's own clean exit, reported through the zygote
    assert server.group_pids() == [] and not server.alive()

    # a requester killed outright takes its server with it (a spawned server's parent-death signal)
    code = ("import asyncio, sys, time\n"
            "from agentloop.inference.launcher import LocalServer\n"
            f"s = LocalServer({str(tiny_model_path)!r}, log_path={str(tmp_path / 'o.log')!r}).start()\n"
            "print(type(s.process).__name__, s.pid, flush=True)\n"
            "time.sleep(3600)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        kind, pid = child.stdout.readline().split()
        assert kind == "ForkedProcess"
        _wait_until(lambda: len(_members(int(pid))) >= 3, "scheduler and detokenizer", SERVER_START_GUARD_S)
        members = _members(int(pid))
        child.kill()
        child.wait()
        _wait_until(lambda: _gone(members), "end of the orphaned server's processes")
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def _members(pgid: int) -> list[int]:
    from agentloop.inference.launcher import _group_members

    return _group_members(pgid)


def test_a_failed_start_reports_its_exit_code_and_a_dead_zygote_takes_its_servers(own_zygote, tiny_model_path,
                                                                                   tmp_path):
    sock, zproc = own_zygote
    bad = LocalServer(tmp_path / "no-such-model", log_path=tmp_path / "bad.log", startup_timeout_s=240).start()
    assert isinstance(bad.process, zygote.ForkedProcess)
    with pytest.raises(ServerStartError, match="exited with code 1 during startup"):
        asyncio.run(bad.wait_ready())
    assert bad.group_pids() == []

    server = LocalServer(tiny_model_path, log_path=tmp_path / "s.log", startup_timeout_s=SERVER_START_GUARD_S).start()
    try:
        _wait_until(lambda: len(server.group_pids()) >= 3, "scheduler and detokenizer", SERVER_START_GUARD_S)
        members = server.group_pids()
        os.kill(zproc.pid, signal.SIGKILL)
        zproc.wait()
        _wait_until(lambda: _gone(members), "end of the dead zygote's server")
        _wait_until(lambda: server.process.poll() is not None, "an exit code")
        assert server.process.returncode == -signal.SIGKILL
    finally:
        server.stop()


def test_a_server_whose_environment_differs_is_spawned(own_zygote, tiny_model_path, tmp_path, monkeypatch):
    """A variable read at start (here OpenMP's wait policy) that differs from the zygote's: the zygote refuses, the
    launcher spawns the server itself, which then serves as usual."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    server = LocalServer(tiny_model_path, log_path=tmp_path / "s.log", startup_timeout_s=SERVER_START_GUARD_S).start()
    try:
        assert isinstance(server.process, subprocess.Popen)
        asyncio.run(server.wait_ready())
        log = server.log_path.read_text()
        assert "forked by the zygote" not in log
        assert "# agentloop: spawned, not forked: the zygote at" in log and "'OMP_WAIT_POLICY': ('ACTIVE', 'PASSIVE')" in log
    finally:
        server.stop()
    # the variables that may differ, and the one exception (the thread count, set in the forked server)
    base = {"PATH": "/bin", "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "2"}
    assert _fixed({**base, "PATH": "/usr/bin", "OMP_NUM_THREADS": "1"}) == _fixed(base)
    assert _fixed({**base, "SGLANG_X": "1"}) != _fixed(base)
    # read when used, not at start (Ray's workers set it); the allocator's, applied by the forked server itself
    assert _fixed({**base, "PYTHONBREAKPOINT": "x", "MALLOC_ARENA_MAX": "2"}) == _fixed(base)
    # cache paths torch and SGLang write into the requester's environment, read at first use (a compile, a kernel)
    assert _fixed({**base, "TORCHINDUCTOR_CACHE_DIR": "/tmp/i", "CUDA_CACHE_PATH": "/tmp/nv"}) == _fixed(base)
