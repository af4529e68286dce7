"""A real SGLang server killed mid-rollout: its episodes finish on the other one, none lost or duplicated."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from agentloop.config import load_config
from agentloop.data import load_samples
from agentloop.inference.launcher import LocalServer
from agentloop.loops import get_agent_loop
from agentloop.models.loading import load_tokenizer_for
from agentloop.rollout.engine import RolloutEngine
from agentloop.server_manager import ServerManager

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_real_server_killed_mid_rollout(sglang_server, tiny_model_path, tmp_path):
    victim = LocalServer(tiny_model_path, device="cpu", log_path=tmp_path / "victim.log", startup_timeout_s=280).start()
    try:
        asyncio.run(victim.wait_ready())
        cfg = load_config(None, [f"server.urls=[\"{sglang_server.url}\", \"{victim.url}\"]",
                                 "data.max_samples=24", "rollout.n_samples=2", "sampling.max_new_tokens=24",
                                 "manager.health_interval_s=0.5", "manager.retry_backoff_s=0.05",
                                 "rollout.progress_interval_s=100"])
        tok = load_tokenizer_for(cfg, tiny_model_path)
        samples = load_samples(cfg.data)

        async def main():
            async with ServerManager(cfg.server.urls, cfg.manager) as sm:
                engine = RolloutEngine(cfg, sm, tok, get_agent_loop("single_turn_agent_loop"), progress=False)

                async def killer():
                    # kill once the victim has answered some requests and holds others in flight
                    while sm.router.servers[1].requests < 6:
                        await asyncio.sleep(0.05)
                    victim.kill()

                result, _ = await asyncio.gather(engine.run(samples), killer())
                return result, sm.gauges()

        result, g = asyncio.run(main())
    finally:
        victim.stop()
    ids = Counter(r.episode_id for r in result.records)
    assert len(ids) == 48 and set(ids.values()) == {1}, "every episode exactly once"
    assert [r.error for r in result.records if r.error] == []
    assert result.stopped is None
    assert g["server/1/healthy"] == 0.0 and g["server/retries"] >= 1
    assert g["server/1/requests"] >= 6
