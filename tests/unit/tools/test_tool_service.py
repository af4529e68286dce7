"""`agentloop tools serve` in its own process and tool_agent_loop using it through tools.server_url: the same
records as local tools; leases, per-call timeouts, concurrency limits, the start rate, the token; a service
killed mid-run gives error text and counts, never a hung episode. The LLM side is the scripted stand-in of
test_tool_loop (the real-server comparison is tests/integration/test_tool_service_real.py)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agentloop.config import SamplingParams
from agentloop.errors import ConfigError
from agentloop.records import Sample
from agentloop.tools.config import ToolsConfig
from agentloop.tools.remote import ToolServiceError, ToolServicePool
from agentloop.tools.service import Leases, StartRate, check_bind
from tests.unit.loops.test_tool_loop import ScriptedServer, call, get_tokenizer, make_loop

PLUGIN = str(Path(__file__).resolve().parents[2] / "fakes" / "remote_tools_plugin.py")
ROOT = Path(__file__).resolve().parents[3]


class Service:
    """`agentloop tools serve --port 0` in a child process; its URL read from the line it prints."""

    def __init__(self, *overrides: str, token: str | None = None, host: str = "127.0.0.1"):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("AGENTLOOP_TOOLS_TOKEN", None)
        if token:
            env["AGENTLOOP_TOOLS_TOKEN"] = token
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentloop.cli", "tools", "serve", "--port", "0", "--host", host,
             "--plugin", PLUGIN, *overrides], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()  # blocks until it listens, or it exits (then line is "")
        if "serving" not in line:
            self.proc.kill()
            raise RuntimeError(f"tool service did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        self.url = line.rsplit(" on ", 1)[1].split()[0]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        self.kill()
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture
def service():
    made: list[Service] = []

    def start(*overrides: str, **kw: Any) -> Service:
        s = Service(*overrides, **kw)
        made.append(s)
        return s

    yield start
    for s in made:
        s.stop()


def test_leases_and_start_rate_rules():
    lz = Leases(10.0)
    lz.touch("a", 0.0)
    lz.touch("b", 5.0)
    assert lz.expired(9.9) == [] and lz.expired(10.0) == ["a"]
    lz.touch("a", 9.0)  # a call renews it
    assert lz.expired(14.0) == [] and sorted(lz.expired(19.0)) == ["a", "b"]
    lz.drop("a")
    assert len(lz) == 1
    r = StartRate(10.0, burst=2)
    assert [r.reserve(0.0), r.reserve(0.0)] == [0.0, 0.0]  # the burst
    assert r.reserve(0.0) == pytest.approx(0.1) and r.reserve(0.0) == pytest.approx(0.2)  # then 10 per second
    assert r.reserve(10.0) == 0.0  # refilled


def test_non_local_bind_needs_a_token():
    check_bind("127.0.0.1", None)
    check_bind("localhost", None)
    check_bind("::1", None)
    for host in ("0.0.0.0", "10.1.2.3", "example.org"):
        with pytest.raises(ConfigError, match="AGENTLOOP_TOOLS_TOKEN"):
            check_bind(host, None)
        with pytest.raises(ConfigError, match="needs TLS, or the shared secret travels in plain HTTP"):
            check_bind(host, "s3cret")
        check_bind(host, "s3cret", tls=True)
    p = subprocess.run([sys.executable, "-m", "agentloop.cli", "tools", "serve", "--host", "0.0.0.0", "--port", "0"],
                       capture_output=True, text=True, timeout=120,
                       env={**{k: v for k, v in os.environ.items() if k != "AGENTLOOP_TOOLS_TOKEN"},
                            "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2 and "needs a shared secret" in p.stderr


def _turns(k: int, **args: Any) -> list[tuple[str, str]]:
    return [(call("echo", json.dumps({"text": f"turn {i}", **args})), "stop") for i in range(k)] + \
        [("The answer is 84.", "stop")]


def _episode(tok, turns, *, index: int = 0, urls: list[str] | None = None, **tools_cfg: Any):
    server = ScriptedServer(tok, turns)
    loop = make_loop(tok, server, names=["echo"], server_url=urls or [], **tools_cfg)
    s = Sample(index=index, data_source="test", messages=[{"role": "user", "content": "Echo three times."}],
               tools_kwargs={"echo": {"prefix": "P"}})
    return loop.run(s, SamplingParams(max_new_tokens=256, seed=7))


def _same(a, b) -> None:
    assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids
    assert a.response_mask == b.response_mask and a.response_logprobs == b.response_logprobs
    assert a.extra["messages"] == b.extra["messages"]
    assert a.extra["tool_rewards"] == b.extra["tool_rewards"] and a.finish_reason == b.finish_reason
    timeless = {k for k in a.metrics if not k.endswith("time_s")}
    assert {k: a.metrics[k] for k in timeless} == {k: b.metrics[k] for k in timeless}


def test_remote_records_equal_local_records(service):
    import tests.fakes.remote_tools_plugin  # noqa: F401 - registers the same tools here, for the local run

    svc = service()
    tok = get_tokenizer("test")
    turns = _turns(3) + [(call("echo", '{"text": "x", "fail": true}'), "stop"), ("done", "stop")]

    async def both():
        local = await _episode(tok, turns)
        remote = await _episode(tok, turns, urls=[svc.url])
        return local, remote

    local, remote = asyncio.run(asyncio.wait_for(both(), 120))
    _same(local, remote)
    assert [m["content"] for m in remote.extra["messages"] if m["role"] == "tool"] == [
        "P#1: turn 0", "P#2: turn 1", "P#3: turn 2"]
    assert remote.extra["tool_rewards"] == {"echo": 3.0}


def test_remote_exception_and_timeout_read_as_local(service):
    import tests.fakes.remote_tools_plugin  # noqa: F401

    svc = service()
    tok = get_tokenizer("test")
    turns = [(call("echo", '{"text": "a", "fail": true}'), "stop"),
             (call("echo", '{"text": "b", "sleep_s": 30}'), "stop"), ("done", "stop")]

    async def both():
        local = await _episode(tok, turns, tool_timeout_s=0.5)
        remote = await _episode(tok, turns, urls=[svc.url], tool_timeout_s=0.5)
        return local, remote

    local, remote = asyncio.run(asyncio.wait_for(both(), 120))
    _same(local, remote)
    tool_msgs = [m["content"] for m in remote.extra["messages"] if m["role"] == "tool"]
    assert tool_msgs == ["error: ValueError: failed on purpose at call 1", "error: echo timed out after 0.5s"]
    assert remote.metrics["tool_timeouts"] == 1 and remote.metrics["tool_errors"] == 2


async def _get(url: str, path: str, token: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(headers=headers) as s:
        async with s.get(url + path, timeout=aiohttp.ClientTimeout(total=30)) as r:
            return r.status, await r.json(content_type=None)


def test_token_health_metrics_and_leases(service, monkeypatch):
    svc = service("tools.service.lease_s=0.5", token="s3cret")
    tok = get_tokenizer("test")
    assert asyncio.run(_get(svc.url, "/health"))[0] == 401
    status, health = asyncio.run(_get(svc.url, "/health", "s3cret"))
    assert status == 200 and "echo" in health["tools"] and health["instances"] == 0
    monkeypatch.setenv("AGENTLOOP_TOOLS_TOKEN", "s3cret")
    out = asyncio.run(asyncio.wait_for(_episode(tok, _turns(2), urls=[svc.url]), 120))
    assert [m["content"] for m in out.extra["messages"] if m["role"] == "tool"] == ["P#1: turn 0", "P#2: turn 1"]

    async def vanished():
        # an instance whose episode vanished (created, then never used or released): its lease frees it
        headers = {"Authorization": "Bearer s3cret"}
        async with aiohttp.ClientSession(headers=headers) as s:
            body = {"tool": "echo", "episode": Sample(index=9, data_source="t", messages=[]).model_dump(mode="json")}
            async with s.post(svc.url + "/v1/instances", json=body) as r:
                iid = (await r.json())["instance_id"]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                m = (await _get(svc.url, "/metrics", "s3cret"))[1]
                if m["lease_expired"] >= 1:
                    break
                await asyncio.sleep(0.1)
            async with s.post(svc.url + f"/v1/instances/{iid}/execute", json={"arguments": {"text": "x"}}) as r:
                return m, r.status

    metrics, late = asyncio.run(vanished())
    assert metrics["lease_expired"] >= 1 and metrics["instances"] == 0 and late == 404
    assert metrics["creates"] == 2 and metrics["calls"] == 2 and metrics["releases"] >= 1
    assert metrics["unauthorized"] >= 1


def test_concurrency_limit_holds(service):
    import tests.fakes.remote_tools_plugin  # noqa: F401

    svc = service("tools.service.max_concurrent_calls=2")
    tok = get_tokenizer("test")

    async def many():
        return await asyncio.gather(*(_episode(tok, _turns(1, sleep_s=0.2), index=i, urls=[svc.url])
                                      for i in range(6)))

    outs = asyncio.run(asyncio.wait_for(many(), 120))
    assert all(o.metrics["tool_errors"] == 0 for o in outs)
    assert max(o.metrics["tool/echo/peak_running"] for o in outs) == 2.0  # six at once asked, two ran


def test_service_killed_mid_run_gives_error_text_never_a_hang(service):
    svc = service()
    tok = get_tokenizer("test")

    async def run():
        n = 8
        tasks = [asyncio.create_task(_episode(tok, _turns(3, sleep_s=0.3), index=i, urls=[svc.url]))
                 for i in range(n)]
        # kill once the episodes are inside their first calls (instances exist, calls in flight)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if (await _get(svc.url, "/metrics"))[1]["calls"] >= n:
                break
            await asyncio.sleep(0.05)
        svc.kill()
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    outs = asyncio.run(asyncio.wait_for(run(), 120))
    assert len(outs) == 8
    for o in outs:
        msgs = [m["content"] for m in o.extra["messages"] if m["role"] == "tool"]
        assert len(msgs) == 3 and o.finish_reason == "stop"
        assert any(m.startswith("error: tool service unavailable") for m in msgs), msgs
        assert o.metrics["tool_errors"] >= 1 and o.metrics["tool/echo/service_errors"] >= 1


def test_a_service_refuses_to_run_sandboxed_tools_unisolated_and_clients_refuse_its_catalog(service):
    """With no working sandbox (tools.python.isolate=false stands for a host without one), `tools serve` refuses
    as `agentloop train` does; told explicitly, it serves and says so in its catalog, which clients refuse unless
    they allow it too."""
    env = {**{k: v for k, v in os.environ.items() if k != "AGENTLOOP_TOOLS_TOKEN"}, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "agentloop.cli", "tools", "serve", "--port", "0",
                        "tools.python.isolate=false"], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2 and "refuses to run model-written code unisolated" in p.stderr and "'python'" in p.stderr
    svc = service("tools.python.isolate=false", "tools.python.allow_unisolated=true")

    async def catalog(**cfg):
        pool = ToolServicePool([svc.url], None, ToolsConfig(**cfg))
        try:
            return await pool.catalog()
        finally:
            await pool.close()

    with pytest.raises(ToolServiceError, match=r"runs \['python'\] \(model-written code\) without isolation"):
        asyncio.run(catalog())
    tools = asyncio.run(catalog(allow_unisolated_service=True))
    assert tools["python"]["sandboxed"] is True and tools["python"]["isolated"] is False
    assert tools["echo"]["sandboxed"] is False and tools["echo"]["isolated"] is None


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_the_service_speaks_tls_with_the_token_and_binds_beyond_loopback_only_with_both(service, tmp_path):
    cert, key = _self_signed(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AGENTLOOP_TOOLS_TOKEN": "s3cret"}
    p = subprocess.run([sys.executable, "-m", "agentloop.cli", "tools", "serve", "--host", "0.0.0.0", "--port", "0"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2 and "needs TLS" in p.stderr
    svc = service(f"tools.service.tls_cert={cert}", f"tools.service.tls_key={key}", token="s3cret")
    assert svc.url.startswith("https://127.0.0.1:")

    async def catalog(url, **cfg):
        pool = ToolServicePool([url], "s3cret", ToolsConfig(**cfg))
        try:
            return await pool.catalog()
        finally:
            await pool.close()

    assert "echo" in asyncio.run(catalog(svc.url, server_ca_file=str(cert)))
    with pytest.raises(ToolServiceError, match="certificate verify failed|CERTIFICATE_VERIFY_FAILED"):
        asyncio.run(catalog(svc.url))  # an unknown CA is refused
    with pytest.raises(ToolServiceError):
        asyncio.run(catalog(svc.url.replace("https://", "http://"), server_ca_file=str(cert)))  # no plain HTTP
