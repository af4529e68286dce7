"""ServerManager and engine failure behaviour against scripted fake servers on real sockets.

No test synchronizes by sleeping: they wait on the fake's hooks (`wait_until`, `hold`, `hold_after`,
`events`, `probes`: tests/fakes/fake_sglang.py) or on events of their own."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from agentloop import AgentLoopBase, AgentLoopOutput, ServerManager
from agentloop.config import Config, ManagerConfig, SamplingParams, load_config
from agentloop.errors import (
    AllServersDownError,
    FatalRequestError,
    RetryBudgetExhausted,
)
from agentloop.loops.base import TrajectoryBuilder
from agentloop.records import Sample
from agentloop.rollout.engine import RolloutEngine
from tests.fakes.fake_sglang import start_fakes

FAST = dict(health_interval_s=0.2, health_timeout_s=0.5, retry_backoff_s=0.01, eject_after_failures=1,
            all_down_grace_s=1.0, request_timeout_s=2.0, retry_budget_s=10.0)


def run(coro):
    return asyncio.run(coro)


def sp(**kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=8, seed=kw.pop("seed", 1), **kw)


class TwoTurnLoop(AgentLoopBase):
    """Token-only test loop: two generate calls, no tokenizer needed; reward = 1 if index is even."""

    async def run(self, sample, sampling_params):
        prompt = [1, 2, 3, sample.index % 50 + 4]
        traj = TrajectoryBuilder(prompt)
        for turn in range(2):
            out = await self.server_manager.generate(sample.episode_id, prompt_ids=traj.all_ids,
                                                     sampling_params=self.turn_params(sampling_params, turn))
            traj.add_model(out)
            if turn == 0:
                traj.add_env([7, 7])
        return traj.build(reward=float(sample.index % 2 == 0))


def make_samples(n: int) -> list[Sample]:
    return [Sample(index=i, data_source="test", messages=[{"role": "user", "content": str(i)}]) for i in range(n)]


def engine_cfg(**over) -> Config:
    cfg = load_config(None, ["server.urls=[\"http://127.0.0.1:1\"]", "rollout.progress_interval_s=100"])
    cfg.manager = ManagerConfig(**{**FAST, **over})
    return cfg


def test_generate_parses_tokens_and_gauges():
    async def main():
        (f,) = await start_fakes(1)
        async with ServerManager([f.url], ManagerConfig(**FAST)) as sm:
            out = await sm.generate("ep", prompt_ids=[1, 2, 3, 4, 5], sampling_params=sp())
            g = sm.gauges()
        await f.stop()
        return out, g, f

    out, g, f = run(main())
    assert len(out.token_ids) == 8 and out.logprobs == [-0.5] * 8
    assert out.finish_reason == "length" and out.weight_version == "default"
    assert out.cached_tokens == 1 and out.attempts == 1
    req = f.requests[0]
    assert req["input_ids"] == [1, 2, 3, 4, 5] and req["return_logprob"] is True
    assert req["sampling_params"]["sampling_seed"] == 1
    assert g["server/requests"] == 1 and g["server/prefix_cache_hit_rate"] == pytest.approx(1 / 5)


def test_500_is_retried_on_another_server():
    async def main():
        bad, good = await start_fakes(2)
        bad.mode = "error500"
        async with ServerManager([bad.url, good.url], ManagerConfig(**FAST)) as sm:
            outs = [await sm.generate(f"ep{i}", prompt_ids=[1, 2, i], sampling_params=sp()) for i in range(4)]
            g = sm.gauges()
        await bad.stop(), await good.stop()
        return outs, g, good

    outs, g, good = run(main())
    assert all(o.server == good.url for o in outs)
    assert g["server/retries"] >= 1
    assert len(good.completed) == 4


def test_hang_times_out_aborts_and_retries_elsewhere():
    async def main():
        hang, good = await start_fakes(2)
        hang.mode = "hang"
        async with ServerManager([hang.url, good.url], ManagerConfig(**{**FAST, "request_timeout_s": 0.5,
                                                                         "health_interval_s": 30})) as sm:
            sm.router._rr = 0  # first pick is the hanging server
            out = await sm.generate("ep", prompt_ids=[1, 2], sampling_params=sp())
            g = sm.gauges()
            await hang.wait_until(lambda f: "/abort_request" in f.events)  # the best-effort abort lands
        await hang.stop(), await good.stop()
        return out, g, hang

    out, g, hang = run(main())
    assert out.attempts == 2
    assert g["server/timeouts"] == 1
    assert ("/abort_request", {"rid": hang.requests[0]["rid"]}) in hang.admin


def test_4xx_is_not_retried():
    async def main():
        (f,) = await start_fakes(1)
        f.mode = "error400"
        async with ServerManager([f.url], ManagerConfig(**FAST)) as sm:
            with pytest.raises(FatalRequestError, match="HTTP 400"):
                await sm.generate("ep", prompt_ids=[1], sampling_params=sp())
        await f.stop()
        return f

    f = run(main())
    assert len(f.requests) == 1


def test_retry_budget_exhausted_names_the_last_error():
    async def main():
        (f,) = await start_fakes(1)
        f.mode = "error500"
        async with ServerManager([f.url], ManagerConfig(**{**FAST, "max_attempts": 3,
                                                              "eject_after_failures": 10})) as sm:
            with pytest.raises(RetryBudgetExhausted, match="3 attempt.*HTTP 500"):
                await sm.generate("ep", prompt_ids=[1], sampling_params=sp())
        await f.stop()

    run(main())


def test_episodes_stick_to_one_server():
    async def main():
        fakes = await start_fakes(3)
        async with ServerManager([f.url for f in fakes], ManagerConfig(**FAST)) as sm:
            servers = {}
            for turn in range(3):
                outs = await asyncio.gather(*(sm.generate(f"ep{i}", prompt_ids=[1, i, turn], sampling_params=sp())
                                              for i in range(12)))
                for i, o in enumerate(outs):
                    servers.setdefault(i, set()).add(o.server)
        for f in fakes:
            await f.stop()
        return servers

    servers = run(main())
    assert all(len(s) == 1 for s in servers.values())
    assert len(set.union(*servers.values())) == 3  # and load was spread


def test_per_server_cap_is_respected():
    """12 calls at once, cap 3: the fake holds what reaches it. When 3 requests are there, the manager
    counts 3 in flight (all 12 tasks have run up to their first wait by then, so without a cap it would
    count 12 and all would be on their way); after the release every call completes and the server never
    saw more than 3 at once."""
    async def main():
        (f,) = await start_fakes(1)
        f.hold()
        async with ServerManager([f.url], ManagerConfig(**{**FAST, "max_inflight_per_server": 3})) as sm:
            calls = [asyncio.create_task(sm.generate(f"e{i}", prompt_ids=[i + 1], sampling_params=sp()))
                     for i in range(12)]
            await f.wait_until(lambda f: f.inflight >= 3)
            held = (f.inflight, sm.gauges()["server/inflight"], len(f.requests))
            f.release()
            outs = await asyncio.wait_for(asyncio.gather(*calls), 10)
        await f.stop()
        return held, outs, f

    held, outs, f = run(main())
    assert held == (3, 3.0, 3)
    assert len(outs) == 12 and len(f.completed) == 12
    assert f.peak_inflight == 3


def test_server_killed_mid_rollout_no_episode_lost_or_duplicated():
    async def main():
        fakes = await start_fakes(3, delay_s=0.02)  # pacing, not synchronization: fewer connects racing a stop
        fakes[1].hold_after = 3  # the victim answers 3 requests, then holds the rest in flight
        # nothing here waits for a timeout, so a loaded machine must not turn slow answers (or slow health
        # probes) of the live servers into ejections; the killed one refuses connections at once
        cfg = engine_cfg(request_timeout_s=60.0, retry_budget_s=120.0, health_timeout_s=30.0, all_down_grace_s=30.0)
        async with ServerManager([f.url for f in fakes], cfg.manager) as sm:
            engine = RolloutEngine(cfg, sm, tokenizer=None, loop_cls=TwoTurnLoop, progress=False)

            async def killer():
                # kill once the victim has finished some requests and holds others in flight
                await fakes[1].wait_until(lambda f: len(f.completed) >= 3 and f.inflight >= 1)
                await fakes[1].stop()

            result, _ = await asyncio.gather(engine.run(make_samples(60), n_samples=2), killer())
        for f in (fakes[0], fakes[2]):
            await f.stop()
        return result, fakes

    result, fakes = run(main())
    ids = Counter(r.episode_id for r in result.records)
    assert len(ids) == 120 and set(ids.values()) == {1}
    assert sorted({r.error for r in result.records if r.error}) == []
    assert result.stopped is None
    assert len(fakes[1].completed) == 3  # the killed server did work before dying
    assert result.summary["server/retries"] >= 1
    assert result.summary["mean_reward"] == pytest.approx(0.5)


def test_all_servers_gone_stops_run_and_keeps_records():
    async def main():
        fakes = await start_fakes(2, delay_s=0.02)  # pacing, not synchronization: fewer connects racing a stop
        cfg = engine_cfg(all_down_grace_s=0.5)
        cfg.rollout.max_concurrency = 8
        written = []
        five = asyncio.Event()

        def on_record(rec):
            written.append(rec)
            if len(written) >= 5:
                five.set()

        async with ServerManager([f.url for f in fakes], cfg.manager) as sm:
            engine = RolloutEngine(cfg, sm, tokenizer=None, loop_cls=TwoTurnLoop, progress=False)

            async def killer():
                await asyncio.wait_for(five.wait(), 10)  # some records exist before every server dies
                for f in fakes:
                    await f.stop()

            result, _ = await asyncio.gather(engine.run(make_samples(200), n_samples=1, on_record=on_record),
                                             killer())
        return result, written

    result, written = run(main())
    assert result.stopped and "down" in result.stopped
    assert written == result.records
    done_ok = [r for r in result.records if r.error is None]
    assert done_ok, "records made before the servers died are kept"
    errs = [r for r in result.records if r.error]
    assert all(r.error.split(":")[0] in ("AllServersDownError", "RetryBudgetExhausted") for r in errs)
    ids = [r.episode_id for r in result.records]
    assert len(ids) == len(set(ids))
    assert len(result.records) + result.summary["not_started"] == 200


def test_episode_exceptions_become_error_records():
    class Broken(AgentLoopBase):
        async def run(self, sample, sampling_params):
            if sample.index == 1:
                raise ValueError("model output made no sense")
            if sample.index == 2:
                return "not an output"
            return AgentLoopOutput(prompt_ids=[1], response_ids=[], response_mask=[], response_logprobs=[],
                                   reward=1.0)

    async def main():
        (f,) = await start_fakes(1)
        cfg = engine_cfg()
        async with ServerManager([f.url], cfg.manager) as sm:
            result = await RolloutEngine(cfg, sm, None, Broken, progress=False).run(make_samples(3), n_samples=1)
        await f.stop()
        return result

    result = run(main())
    by = {r.index: r for r in result.records}
    assert by[0].error is None and by[0].reward == 1.0
    assert by[1].error == "ValueError: model output made no sense" and by[1].finish_reason == "error"
    assert by[2].error.startswith("TypeError")
    assert result.summary["errors"] == 2


def test_pause_blocks_new_requests_until_resume_and_weights_broadcast():
    """A generate issued while paused reaches no server before /continue_generation: each fake's arrival
    order proves it (sent at once, it would arrive during the two admin round trips that follow)."""
    async def main():
        fakes = await start_fakes(2)
        async with ServerManager([f.url for f in fakes], ManagerConfig(**{**FAST, "health_interval_s": 30})) as sm:
            await sm.pause()
            task = asyncio.create_task(sm.generate("ep", prompt_ids=[1], sampling_params=sp()))
            await sm.update_weights_from_disk("/tmp/ckpt", weight_version="v7")
            await sm.flush_cache()
            assert not task.done()
            await sm.resume()
            out = await asyncio.wait_for(task, 5)
        for f in fakes:
            await f.stop()
        return out, fakes

    out, fakes = run(main())
    assert out.weight_version == "v7"
    admin = ["/pause_generation", "/update_weights_from_disk", "/flush_cache", "/continue_generation"]
    for f in fakes:
        assert [p for p, _ in f.admin] == admin
    assert sorted(f.events for f in fakes) == [admin, admin + ["/generate"]]


def test_ejected_server_is_readmitted_when_healthy_again():
    async def main():
        a, b = await start_fakes(2)
        # no grace: probes alone decide here (a server starts inside answered_grace_s otherwise)
        async with ServerManager([a.url, b.url], ManagerConfig(**{**FAST, "answered_grace_s": 0})) as sm:
            async def after_two_probes(status: int) -> float:
                # probes are sequential: the 2nd answer with `status` was asked for after the manager
                # had taken in the 1st (eject_after_failures=1), so its verdict is in the gauges now
                n = len(a.probes)
                await a.wait_until(lambda f: f.probes[n:].count(status) >= 2)
                return sm.gauges()["server/0/healthy"]

            a.healthy = False
            down = await after_two_probes(503)
            a.healthy = True
            up = await after_two_probes(200)
            g = sm.gauges()
        await a.stop(), await b.stop()
        return down, up, g

    down, up, g = run(main())
    assert down == 0.0 and up == 1.0
    assert g["server/ejections"] >= 1 and g["server/readmissions"] >= 1


def test_all_down_error_raised_by_generate():
    async def main():
        (f,) = await start_fakes(1)
        await f.stop()
        async with ServerManager([f.url], ManagerConfig(**{**FAST, "all_down_grace_s": 0.3})) as sm:
            with pytest.raises((AllServersDownError, RetryBudgetExhausted)):
                await sm.generate("ep", prompt_ids=[1], sampling_params=sp())

    run(main())


def test_out_of_vocab_ids_rejected_before_sending():
    async def main():
        (f,) = await start_fakes(1)
        async with ServerManager([f.url], ManagerConfig(**FAST), vocab_size=100) as sm:
            with pytest.raises(FatalRequestError, match="token id 100 outside the vocabulary"):
                await sm.generate("ep", prompt_ids=[1, 100], sampling_params=sp())
            with pytest.raises(FatalRequestError, match="empty"):
                await sm.generate("ep", prompt_ids=[], sampling_params=sp())
        await f.stop()
        return f

    assert run(main()).requests == []


def test_connection_closed_unanswered_is_retried_once_on_the_same_server_uncounted():
    """SGLang's uvicorn closes idle keep-alive connections after 5 s; a request sent as it does finds its
    connection closed unanswered. That is no server failure: a lone server must not be ejected for it (a
    2-core `agentloop train` lost its only server to two such drops after a ~5 s learner step)."""
    async def main():
        (f,) = await start_fakes(1)
        cfg = ManagerConfig(**{**FAST, "eject_after_failures": 1})
        async with ServerManager([f.url], cfg) as sm:
            await sm.generate("warm", prompt_ids=[1, 2, 3], sampling_params=sp())
            f.drop_next = 1
            out = await sm.generate("ep", prompt_ids=[1, 2, 3], sampling_params=sp())
            g1 = sm.gauges()
            # a server that drops every request is a failing one: the second drop of a call counts
            f.drop_next = 10**6
            with pytest.raises(RetryBudgetExhausted):
                await sm.generate("ep2", prompt_ids=[1, 2, 3], sampling_params=sp())
            g2 = sm.gauges()
        f.drop_next = 0
        await f.stop()
        return out, g1, g2, f

    out, g1, g2, f = run(main())
    assert out.server == f.url and out.attempts == 1 and len(out.token_ids) == 8
    assert g1["server/dropped_connections"] == 1 and g1["server/retries"] == 0
    assert g1["server/ejections"] == 0 and g1["server/healthy"] == 1
    assert g2["server/ejections"] >= 1


def test_idle_pooled_connections_expire_before_the_servers_keepalive(monkeypatch):
    """An idle connection is not reused after `manager.keepalive_s` (below SGLang's 5 s), so the client
    does not send on connections the server is about to close: a request after the idle time opens a
    new connection, one right after it reuses that one. The idle time passes on the pool's clock (moved
    forward), so no verdict depends on how fast this machine runs the requests."""
    from agentloop.util import http1

    shift = [0.0]

    class PoolClock:  # the time module as the pool sees it: monotonic() moved forward by `shift`
        def __getattr__(self, name: str):
            return getattr(time, name)

        def monotonic(self) -> float:
            return time.monotonic() + shift[0]

    monkeypatch.setattr(http1, "time", PoolClock())

    async def main():
        (f,) = await start_fakes(1)
        async with ServerManager([f.url], ManagerConfig(**{**FAST, "keepalive_s": 30.0, "health_interval_s": 3600.0})) as sm:
            await sm.generate("a", prompt_ids=[1, 2, 3], sampling_params=sp())
            before = f.connections
            shift[0] += 60.0  # idle for twice keepalive_s on the pool's clock
            await sm.generate("b", prompt_ids=[1, 2, 3], sampling_params=sp())
            after_idle = f.connections
            await sm.generate("c", prompt_ids=[1, 2, 3], sampling_params=sp())
            reused = f.connections
        await f.stop()
        return before, after_idle, reused

    before, after_idle, reused = run(main())
    assert after_idle == before + 1 and reused == after_idle
