"""`ray start --head` (Ray 2.60) turns token authentication on; `agentloop train cluster.address=HEAD` must join that
cluster as the README says, without the user exporting RAY_AUTH_MODE (a client joining by address sends its token
only in token mode, and otherwise retries "Authentication token is missing or incorrect" until it gives up)."""

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


def test_joining_a_cluster_that_ray_start_made():
    pytest.importorskip("ray", reason="cluster.backend=ray needs `pip install 'agentloop[ray]'` (scripts/setup.sh)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
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
        assert out.returncode == 0 and "joined 1 token" in out.stdout, out.stdout + out.stderr[-3000:]
    finally:
        try:
            os.killpg(head.pid, signal.SIGTERM)
            head.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        head.stdout.close()
