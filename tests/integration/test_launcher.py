"""LocalServer and launch_servers: command line, startup failures, real CPU servers, teardown."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from pathlib import Path

import aiohttp
import pytest

from agentloop.config import ServerConfig
from agentloop.errors import ServerStartError
from agentloop.inference import launcher
from agentloop.inference.launcher import LocalServer, launch_servers, stop_servers
from agentloop.inference.sglang_cpu import site_dir
from tests.conftest import SERVER_START_GUARD_S, require_sglang


async def _post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
            return r.status, await r.json(content_type=None)


# ---------------------------------------------------------------- no server needed


def test_cpu_command_and_environment(tmp_path: Path) -> None:
    s = LocalServer(tmp_path / "m", port=0, max_total_tokens=4096, extra_args=["--log-level", "warning"],
                    log_path=tmp_path / "s.log")  # fmt: skip
    cmd = s.command()
    assert cmd[1:3] == ["-m", "agentloop.inference.sglang_cpu.launch_server"]
    assert cmd[cmd.index("--device") + 1] == "cpu" and cmd[cmd.index("--max-total-tokens") + 1] == "4096"
    assert cmd[cmd.index("--port") + 1] == str(s.port) and s.port > 0
    assert cmd[-2:] == ["--log-level", "warning"]  # extra args come last and win
    env = s.environment()
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"].split(":")[0] == str(site_dir())
    assert s.url == f"http://127.0.0.1:{s.port}"
    assert s.log_tail() == "" and not s.alive()
    s.stop()  # never started: a no-op


def test_cuda_command(tmp_path: Path) -> None:
    s = LocalServer(tmp_path, device="cuda", gpu_id=3, mem_fraction_static=0.5, max_total_tokens=None)
    cmd = s.command()
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "--device" not in cmd
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.5" and "--max-total-tokens" not in cmd
    env = s.environment()
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert str(site_dir()) not in env.get("PYTHONPATH", "")


def test_missing_sglang_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    with pytest.raises(ServerStartError, match=r"sglang is not installed: pip install 'agentloop\[sglang\]'"):
        LocalServer(tmp_path, log_path=tmp_path / "s.log").start()


def test_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "s.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    s = LocalServer(tmp_path, log_path=log)
    assert s.log_tail(3) == "line 97\nline 98\nline 99"


# ---------------------------------------------------------------- real SGLang processes


@pytest.mark.sglang
def test_bad_model_path_fails_fast_with_log_tail(tmp_path: Path) -> None:
    require_sglang()
    s = LocalServer(tmp_path / "no-such-model", log_path=tmp_path / "s.log", startup_timeout_s=240)
    s.start()
    with pytest.raises(ServerStartError) as info:
        asyncio.run(s.wait_ready())
    msg = str(info.value)
    assert "exited with code" in msg and "last 30 log lines" in msg  # the exit was noticed, not the deadline
    assert msg.rstrip().endswith(s.log_tail(30).rstrip().splitlines()[-1])
    assert not s.alive() and s.group_pids() == []


def _answers_health(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.sglang
def test_kill_during_startup_leaves_no_process(tmp_path: Path, tiny_model_path: Path) -> None:
    """Killed once SGLang has started its own processes (scheduler, detokenizer) but before it serves:
    the whole group goes, not just the main process."""
    require_sglang()
    s = LocalServer(tiny_model_path, log_path=tmp_path / "s.log").start()
    deadline = time.monotonic() + 240
    while len(s.group_pids()) < 3:  # a condition poll: children exist only in /proc
        assert s.alive() and time.monotonic() < deadline, s.log_tail()
        time.sleep(0.05)
    assert not _answers_health(s.url)  # still starting up
    assert s.alive() and s.pid in s.group_pids()
    s.kill()
    assert not s.alive() and s.group_pids() == []
    s.stop()  # idempotent after kill


@pytest.mark.sglang
def test_generate_returns_ids_and_logprobs(sglang_server) -> None:  # type: ignore[no-untyped-def]
    body = {
        "input_ids": [11, 12, 13, 14],
        "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True,
    }
    status, out = asyncio.run(_post(f"{sglang_server.url}/generate", body))
    assert status == 200, out
    ids = out["output_ids"]
    meta = out["meta_info"]
    assert len(ids) == 6 and all(isinstance(i, int) for i in ids)
    entries = meta["output_token_logprobs"]
    assert [e[1] for e in entries] == ids
    assert all(isinstance(e[0], float) and e[0] <= 0.0 for e in entries)
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 6
    assert "cached_tokens" in meta and "weight_version" in meta


@pytest.mark.sglang
def test_a_cpu_servers_children_are_forked_not_spawned(sglang_server) -> None:  # type: ignore[no-untyped-def]
    """The CPU server's scheduler and detokenizer are forked from the launcher process once it imported their
    modules (agentloop.inference.sglang_cpu.launch_server): a spawned child would import sglang again (~40 s of a
    server's start on the 2-core box). A forked child never exec'd, so it holds its parent's auxiliary vector (the
    kernel's AT_RANDOM and stack addresses, new at every exec under ASLR); SGLang renames both (setproctitle), so
    their command lines cannot tell."""
    pid = sglang_server.server.pid
    children = [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
                for c in (t / "children").read_text().split()]
    assert len(children) >= 2, children  # the scheduler and the detokenizer
    parent = Path(f"/proc/{pid}/auxv").read_bytes()
    assert all(Path(f"/proc/{c}/auxv").read_bytes() == parent for c in children)


@pytest.mark.sglang
def test_sampling_seed_is_reproducible_on_cpu(sglang_server) -> None:  # type: ignore[no-untyped-def]
    url = f"{sglang_server.url}/generate"

    def body(seed: int | None, prompt: list[int]) -> dict:
        sp: dict = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}
        if seed is not None:
            sp["sampling_seed"] = seed
        return {"input_ids": prompt, "sampling_params": sp}

    async def scenario() -> None:
        solo = (await _post(url, body(42, [5, 6, 7])))[1]["output_ids"]
        batch = await asyncio.gather(*(_post(url, body(42 if i % 3 == 0 else i, [5, 6, 7] if i % 3 == 0 else [i, 9]))
                                       for i in range(9)))  # fmt: skip
        assert [b[1]["output_ids"] for i, b in enumerate(batch) if i % 3 == 0] == [solo] * 3
        other = (await _post(url, body(43, [5, 6, 7])))[1]["output_ids"]
        assert other != solo
        unseeded = await asyncio.gather(_post(url, body(None, [5, 6, 7])), _post(url, body(None, [5, 6, 7])))
        assert unseeded[0][1]["output_ids"] != unseeded[1][1]["output_ids"]

    asyncio.run(scenario())


@pytest.mark.sglang
def test_prompt_over_context_is_a_400(sglang_server) -> None:  # type: ignore[no-untyped-def]
    body = {"input_ids": [5] * 5000, "sampling_params": {"max_new_tokens": 4}}
    status, out = asyncio.run(_post(f"{sglang_server.url}/generate", body))
    assert status == 400
    assert "longer than the model's context length" in out["error"]["message"]
    assert sglang_server.server.alive()


@pytest.mark.sglang
@pytest.mark.slow
def test_launch_servers_then_stop_leaves_no_process(tmp_path: Path, tiny_model_path: Path) -> None:
    require_sglang()
    cfg = ServerConfig(num_local=1, device="cpu", max_total_tokens=2048, startup_timeout_s=SERVER_START_GUARD_S,
                       shutdown_timeout_s=20)

    async def scenario() -> list[LocalServer]:
        servers = await launch_servers(cfg, tiny_model_path, tmp_path)
        try:
            assert len(servers) == 1 and servers[0].alive()
            assert servers[0].log_path == tmp_path / "servers" / "server0.log"
            status, out = await _post(f"{servers[0].url}/generate",
                                      {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}})  # fmt: skip
            assert status == 200 and len(out["output_ids"]) >= 1
            pids = servers[0].group_pids()
            assert len(pids) >= 3  # main process, scheduler, detokenizer
        finally:
            await stop_servers(servers)
        return servers

    servers = asyncio.run(scenario())
    assert all(not s.alive() and s.group_pids() == [] for s in servers)
    assert servers[0] not in launcher._LIVE
    servers[0].stop()  # idempotent
