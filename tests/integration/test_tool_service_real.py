"""tool_agent_loop with its tools on `agentloop tools serve` (its own process) against the real SGLang CPU server:
the same records, token for token, as with the tools in this process, same seeds. The tiny model seldom writes a
call, so a test parser reads every turn as one calculator call (as in test_tool_loop_real); the calls and their
results are real, on each side."""

from __future__ import annotations

import asyncio

import pytest

from agentloop import ServerManager
from agentloop.data import load_samples
from agentloop.loops import get_agent_loop
from agentloop.models.loading import load_tokenizer_for
from agentloop.rollout.engine import RolloutEngine
from tests.integration.test_tool_loop_real import _cfg, check_episode
from tests.unit.tools.test_tool_service import Service

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_remote_tools_give_the_records_of_local_tools(sglang_server, tiny_model_path, tmp_path):
    svc = Service()
    try:
        base = ["tools.parser=\"test_always_calculator\"", "tools.max_turns=3", "tools.max_tokens_per_turn=12",
                "rollout.seed=11", "rollout.n_samples=2"]
        local_cfg = _cfg(sglang_server.url, tmp_path / "local", *base)
        remote_cfg = _cfg(sglang_server.url, tmp_path / "remote", *base, f"tools.server_url=[\"{svc.url}\"]")
        tok = load_tokenizer_for(local_cfg, tiny_model_path)
        samples = load_samples(local_cfg.data)[:3]

        async def once(cfg):
            async with ServerManager([sglang_server.url]) as sm:
                engine = RolloutEngine(cfg, sm, tok, get_agent_loop("tool_agent_loop"), progress=False)
                return (await engine.run(samples)).records

        local = asyncio.run(asyncio.wait_for(once(local_cfg), 600))
        remote = asyncio.run(asyncio.wait_for(once(remote_cfg), 600))
    finally:
        svc.stop()
    assert len(local) == len(remote) == 6
    by_id = {r.episode_id: r for r in local}
    for r in remote:
        a = by_id[r.episode_id]
        check_episode(r, tok)
        assert r.error is None and r.metrics["tool_calls"] == 2 and r.metrics["tool_errors"] == 0
        assert (r.prompt_ids, r.response_ids, r.response_mask) == (a.prompt_ids, a.response_ids, a.response_mask)
        assert r.extra["messages"] == a.extra["messages"] and r.reward == a.reward
        # the server's logprobs of the same tokens differ run to run by up to ~1e-4 (CPU batching)
        assert r.response_logprobs == pytest.approx(a.response_logprobs, abs=1e-3)
