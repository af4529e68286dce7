"""`ray start --head` (Ray 2.60) turns token authentication on when a token exists (`~/.ray/auth_token`: any local
`ray.init()` cluster writes one, `ray get-auth-token --generate` too) and leaves it off otherwise; `agentloop train
cluster.address=HEAD` must join either cluster as the README says, without the user exporting RAY_AUTH_MODE (a
client joining by address sends its token only in token mode, and otherwise retries "Authentication token is
missing or incorrect" until it gives up). Each case has a HOME of its own, so what it asserts does not depend on
what earlier tests or runs left in the machine's ~/.ray (it did: a fresh machine's first run had no token)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize("token", [True, False], ids=["token-exists", "no-token"])
def test_joining_a_cluster_that_ray_start_made(token, tmp_path):
    pytest.importorskip("ray", reason="cluster.backend=ray needs `pip install 'agentloop[ray]'` (scripts/setup.sh)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["HOME"] = str(tmp_path)
    if token:
        gen = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"], env=env,
                             capture_output=True, text=True, timeout=120)
        assert gen.returncode == 0 and (tmp_path / ".ray" / "auth_token").is_file(), gen.stderr[-2000:]
    port = _free_port()
    # --block: the head lives in this process group, stopped by us alone (`ray stop` would stop every Ray here)
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
                             "--num-cpus=1", "--include-dashboard=false", "--disable-usage-stats", "--block"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _listening(port):  # the GCS answers once the head (and its token) is in place
            assert head.poll() is None, head.stdout.read().decode(errors="replace")
            assert time.monotonic() < deadline, "the Ray head did not come up"
            time.sleep(0.2)
        code = ("import asyncio, os, ray\n"
                "from agentloop.cluster.backend import RayBackend\n"
                "from agentloop.config import load_config\n"
                f"cfg = load_config(None, ['cluster.backend=ray', 'cluster.address=127.0.0.1:{port}'])\n"
                "b = RayBackend(cfg)\n"
                "asyncio.run(b.start())\n"
                "print('joined', int(ray.cluster_resources()['CPU']), os.environ.get('RAY_AUTH_MODE'))\n"
                "asyncio.run(b.close())\n")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=150)
        want = "joined 1 token" if token else "joined 1 None"
        assert out.returncode == 0 and want in out.stdout, out.stdout + out.stderr[-3000:]
    finally:
        try:
            os.killpg(head.pid, signal.SIGTERM)
            head.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        head.stdout.close()
