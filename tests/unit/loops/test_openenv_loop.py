"""openenv_loop against real OpenEnv servers (openenv-core's create_app, run as processes), the model scripted:
the echo environment OpenEnv's own `openenv init` generates (max_concurrent_envs=1, as generated) and the calculator
environment of examples/envs. Token exactness and masks, the server's rewards, and every bad input an EnvError with
the server's words: a server that is down, one at capacity, an action it refuses, an observation that is not text.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from agentloop.config import Config, SamplingParams
from agentloop.errors import EnvError
from agentloop.loops.openenv_env import OpenEnvLoop, observation_text, openenv_rows, ws_url
from agentloop.records import Sample
from tests.unit.loops.test_tool_loop import ScriptedServer, get_tokenizer

pytest.importorskip("openenv", reason="the envs extra (openenv-core) is not installed")

ROOT = Path(__file__).resolve().parents[3]
CALCULATOR_ENV = ROOT / "examples" / "envs" / "openenv_calculator.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the OpenEnv server {url} exited ({proc.returncode}): {proc.stdout.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)  # polling a process's start, not synchronising threads of this one
    raise RuntimeError(f"the OpenEnv server {url} did not answer /health in {timeout:g} s")


def start_servers(tmp: Path) -> tuple[dict[str, str], list[subprocess.Popen]]:
    """The echo env made by `openenv init` and the calculator env, each `python -m ...` / `python file` on a port."""
    openenv_cli = Path(sys.executable).with_name("openenv")
    subprocess.run([str(openenv_cli), "init", "echo_env"], cwd=tmp, check=True, capture_output=True, timeout=120)
    ports = {"echo": free_port(), "calculator": free_port()}
    env = {**os.environ, "PYTHONPATH": str(tmp)}
    procs = [
        subprocess.Popen([sys.executable, "-m", "echo_env.server.app", "--port", str(ports["echo"])], cwd=tmp,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        subprocess.Popen([sys.executable, str(CALCULATOR_ENV), "--port", str(ports["calculator"])], cwd=tmp,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
    ]
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    return urls, procs


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openenv")
    urls, procs = start_servers(tmp)
    try:
        for (_, url), proc in zip(urls.items(), procs):
            wait_healthy(url, proc)
        yield urls
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
        shutil.rmtree(tmp, ignore_errors=True)


class FakeManager(ScriptedServer):
    """The scripted server plus what a ServerManager offers the loop's HTTP session (closed with it)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.closers = []

    def on_close(self, fn):
        self.closers.append(fn)

    async def close(self):
        for fn in self.closers:
            await fn()


def run(url: str, turns: list[str], tok=None, **cfg):
    tok = tok or get_tokenizer("modelzoo")
    server = FakeManager(tok, [(t, "stop") for t in turns])
    c = Config()
    c.envs.openenv.url = url
    for k, v in cfg.items():
        setattr(c.envs.openenv, k, v)
    rows = openenv_rows(c.envs.openenv.model_copy(update={"episodes": 1}))
    sample = Sample(index=0, data_source=rows[0]["data_source"], messages=rows[0]["prompt"],
                    extra_info=rows[0]["extra_info"])

    async def go():
        try:
            return await OpenEnvLoop(server_manager=server, tokenizer=tok, config=c).run(
                sample, SamplingParams(max_new_tokens=64, seed=5))
        finally:
            await server.close()

    return asyncio.run(go()), server


def test_echo_env_as_openenv_init_makes_it(servers):
    tok = get_tokenizer("modelzoo")
    out, server = run(servers["echo"], ["hello", "abc"], max_turns=2)
    assert out.finish_reason == "max_turns" and out.num_turns == 2
    # OpenEnv's template env: reward len(message) * 0.1 per step, summed
    assert out.reward == pytest.approx(0.5 + 0.3) and out.extra["env_rewards"] == pytest.approx([0.5, 0.3])
    first = out.extra["messages"][-4]
    assert first == {"role": "user", "content": "Echo Env environment ready!"}
    assert out.extra["messages"][-2] == {"role": "user", "content": "hello"}  # the echo, a masked observation
    assert server.calls[0]["prompt_ids"] == out.prompt_ids
    ids = out.prompt_ids + out.response_ids
    assert ids[:len(server.calls[1]["prompt_ids"])] == server.calls[1]["prompt_ids"]
    env_text = tok.decode([t for t, m in zip(out.response_ids, out.response_mask) if not m])
    assert "hello" in env_text and all(lp == 0.0 for lp, m in zip(out.response_logprobs, out.response_mask) if not m)


def test_calculator_env_rewards_and_tool_role(servers):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 3"}}\n</tool_call>'
    out, _ = run(servers["calculator"], [call, "#### 6"], observation_role="tool", tools=["calculator"])
    assert out.finish_reason == "stop" and out.extra["messages"][-2] == {"role": "tool", "content": "6"}
    assert out.extra["env_rewards"] == [0.0, 0.0]  # the answer 6 is not the question's
    # the same seed, the right answer: the server gives 1.0
    q = out.extra["messages"][0]["content"] if out.extra["messages"][0]["role"] == "user" else \
        out.extra["messages"][1]["content"]
    right = eval(q.removeprefix("What is ").removesuffix("?"))  # the env's own question: two-digit arithmetic
    out, _ = run(servers["calculator"], [f"#### {right}"], observation_role="tool", tools=["calculator"])
    assert out.reward == 1.0 and out.num_turns == 1


def test_bad_input_is_an_env_error_with_the_servers_words(servers):
    port = free_port()
    with pytest.raises(EnvError, match=f"127.0.0.1:{port}/ws is unreachable"):
        run(f"http://127.0.0.1:{port}", ["x"])
    with pytest.raises(EnvError, match="step: Invalid message \\(VALIDATION_ERROR\\): message: Field required"):
        run(servers["echo"], ["x"], action_field="text")
    with pytest.raises(EnvError, match="observation field 'message_length' is not text: int"):
        run(servers["echo"], ["x"], observation_field="message_length")
    with pytest.raises(EnvError, match="no field 'nope'"):
        run(servers["echo"], ["x"], observation_field="nope")


def test_a_server_at_capacity_refuses_the_second_session(servers):
    """`openenv init` generates max_concurrent_envs=1: a second session while one is open is refused."""
    import aiohttp

    async def hold_one():
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(servers["echo"])) as ws:
            await ws.send_str('{"type": "reset", "data": {}}')
            await ws.receive()
            with pytest.raises(EnvError, match="CAPACITY_REACHED|capacity"):
                await asyncio.to_thread(run, servers["echo"], ["x"])

    asyncio.run(hold_one())


def test_observation_text_rules():
    assert observation_text({"observation": {"a": "x", "n": 1}}, None) == "x"
    with pytest.raises(EnvError, match="2 text fields"):
        observation_text({"observation": {"a": "x", "b": "y"}}, None)
    with pytest.raises(EnvError, match="no text field"):
        observation_text({"observation": {"n": 1}}, None)
    with pytest.raises(EnvError, match="not an object"):
        observation_text({"observation": [1]}, None)
    assert ws_url("https://h:1/") == "wss://h:1/ws" and ws_url("http://h:1") == "ws://h:1/ws"
