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
from tests.conftest import SERVER_START_GUARD_S

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_real_server_killed_mid_rollout(sglang_server, tiny_model_path, tmp_path):
    victim = LocalServer(tiny_model_path, device="cpu", log_path=tmp_path / "victim.log", startup_timeout_s=SERVER_START_GUARD_S).start()
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


def test_real_server_that_missed_an_update_serves_only_after_resync(sglang_server):
    """The real server is ejected during the update to version 1 (it missed it). It answers
    /health_generate, but /model_info says version 0: it stays out and serves nothing until the resync
    hook reloads the current weights into it; then it is re-admitted and serves version 1."""
    from agentloop.config import ManagerConfig, SamplingParams
    from agentloop.errors import AllServersDownError

    url, model = sglang_server.url, str(sglang_server.model_path)
    cfg = ManagerConfig(health_interval_s=3600, all_down_grace_s=0.5, retry_budget_s=5, health_timeout_s=20)
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
    resyncs: list[str] = []

    async def main():
        async with ServerManager([url], cfg, initial_version=0) as sm:
            orig = (await sm.state.get_ok(url, "/model_info", 20)).get("weight_version")
            try:
                await sm.update_weights_from_disk(model, weight_version=0)  # a known start: version 0
                before = await sm.generate("a", prompt_ids=[5, 6, 7], sampling_params=sp)
                sm.router.eject(0)  # its update to version 1 failed
                sm.expect_version(1)
                await sm.probe_all()  # scheduler probe passes, but it reports version 0
                kept_out = (sm.router.servers[0].healthy, await sm.reported_version(0))
                with pytest.raises(AllServersDownError):
                    await sm.generate("b", prompt_ids=[5, 6, 7], sampling_params=sp)

                async def resync(u: str) -> None:
                    resyncs.append(u)
                    await sm.update_weights_from_disk(model, weight_version=1, urls=[u])

                sm.set_resync(resync)
                await sm.probe_all()
                after = await sm.generate("c", prompt_ids=[5, 6, 7], sampling_params=sp)
                return before, kept_out, after, sm.gauges(), sm.server_versions()
            finally:  # the session's server goes back to its label for the tests after this one
                await sm.state.admin_post(url, "/update_weights_from_disk",
                                     {"model_path": model, "weight_version": str(orig or "default")})

    before, kept_out, after, g, versions = asyncio.run(main())
    assert before.weight_version == "0"
    assert kept_out == (False, 0)
    assert resyncs == [url] and g["server/resyncs"] == 1 and g["server/readmissions"] >= 1
    assert versions == {url: 1} and after.weight_version == "1" and after.server == url


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_real_server_paused_by_a_run_that_dies_generates_again(sglang_server, mode):
    """A run that dies while its (external) server is paused must not leave it paused: the manager sends
    /continue_generation as it closes, so the next user of the real server gets tokens."""
    from agentloop.config import ManagerConfig, SamplingParams

    url = sglang_server.url
    cfg = ManagerConfig(health_interval_s=3600, health_timeout_s=20)
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)

    async def main():
        with pytest.raises(RuntimeError, match="the learner died"):
            async with ServerManager([url], cfg) as sm:
                await sm.pause(mode)
                raise RuntimeError("the learner died")
        async with ServerManager([url], cfg) as next_user:
            try:
                return await asyncio.wait_for(
                    next_user.generate("after", prompt_ids=[5, 6, 7], sampling_params=sp), 60)
            finally:  # whatever happened, the session's server is not left paused for the tests after this
                await next_user.state.admin_post(url, "/continue_generation", {}, timeout=20)

    out = asyncio.run(main())
    assert len(out.token_ids) == 4
