"""Weight versions and interrupts in the ServerManager, against the scripted server (fault timing).

A call cut by an abort-mode pause continues under the new weights and returns one TokenOutput whose
tokens carry both versions; retract/in_place calls take the server's spans; a cancelled call is aborted
on its server; a server that comes back serving old weights is kept out until it is resynced.
"""

from __future__ import annotations

import asyncio

import pytest

from agentloop.config import ManagerConfig
from agentloop.errors import FatalRequestError
from agentloop.server_manager import ServerManager, parse_generate_response
from tests.fakes.fake_sglang import FakeSGLang

SP = {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 5}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def events() -> asyncio.Queue:
    """A queue for the manager's event lines (ejections, re-admissions, stale servers), to wait on: pass its
    `put_nowait` as the manager's `on_event`."""
    return asyncio.Queue()


async def wait_event(q: asyncio.Queue, text: str) -> str:
    while True:
        line = await q.get()
        if text in line:
            return line


async def _update_midway(sm: ServerManager, fake: FakeSGLang, mode: str, version: int) -> None:
    await fake.started.wait()  # the call is producing tokens
    await sm.pause(mode=mode)
    await sm.update_weights_from_disk("/w", weight_version=version, flush_cache=mode != "in_place")
    await sm.resume()


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_update_midway_continues_the_call_with_both_versions(mode):
    async def main():
        fake = await FakeSGLang(token_delay_s=0.01).start()
        try:
            async with ServerManager([fake.url], ManagerConfig(health_interval_s=60), initial_version=0) as sm:
                gen = asyncio.create_task(sm.generate("e-0", prompt_ids=[5, 6, 7], sampling_params=SP))
                await _update_midway(sm, fake, mode, 1)
                out = await gen
                return out, list(fake.requests), sm.gauges()
        finally:
            await fake.stop()

    out, reqs, g = run(main())
    assert len(out.token_ids) == 40 and len(out.logprobs) == 40 and out.finish_reason == "length"
    vs = out.token_versions
    k = vs.index(1)
    assert k > 0 and vs == [0] * k + [1] * (40 - k)  # monotone: old weights, then new
    if mode == "abort":
        # token-exact continuation: the second request is prompt + partial, with the remaining budget
        assert len(reqs) == 2 and reqs[1]["input_ids"] == [5, 6, 7] + out.token_ids[:k]
        assert reqs[1]["sampling_params"]["max_new_tokens"] == 40 - k
        assert out.token_ids[k:] == FakeSGLang.tokens_for(reqs[1]["input_ids"], 5, 40 - k, 1000, 2)
        assert out.interrupted == 1 and g["server/continued_calls"] == 1.0
    else:
        assert len(reqs) == 1 and out.interrupted == 0  # the server held the request itself
    assert reqs[0]["rid"] != reqs[-1]["rid"] or len(reqs) == 1


def test_without_spans_a_retracted_call_keeps_the_submission_stamp():
    async def main():
        fake = await FakeSGLang(token_delay_s=0.01, report_spans=False).start()
        try:
            async with ServerManager([fake.url], ManagerConfig(health_interval_s=60), initial_version=0) as sm:
                gen = asyncio.create_task(sm.generate("e-0", prompt_ids=[1, 2], sampling_params=SP))
                await _update_midway(sm, fake, "retract", 1)
                return await gen
        finally:
            await fake.stop()

    out = run(main())
    assert out.token_versions == [0] * 40  # conservative: judged by the version it was submitted under


def test_an_abort_that_is_not_an_interrupt_is_returned():
    async def main():
        fake = await FakeSGLang(token_delay_s=0.01).start()
        try:
            async with ServerManager([fake.url], ManagerConfig(health_interval_s=60), initial_version=0) as sm:
                gen = asyncio.create_task(sm.generate("e-0", prompt_ids=[1, 2], sampling_params=SP))
                await fake.started.wait()
                fake.paused, fake.pause_mode = True, "abort"  # the server aborts on its own
                return await gen, len(fake.requests)
        finally:
            await fake.stop()

    out, n = run(main())
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 40 and n == 1


def test_cancelled_call_is_aborted_on_its_server_by_its_own_rid():
    async def main():
        fake = await FakeSGLang(token_delay_s=0.05).start()
        try:
            async with ServerManager([fake.url], ManagerConfig(health_interval_s=60)) as sm:
                gen = asyncio.create_task(sm.generate("7-1", prompt_ids=[1, 2], sampling_params=SP))
                await fake.started.wait()
                gen.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await gen
            # closing drained the abort task
            return fake.requests[0]["rid"], [b for p, b in fake.admin if p == "/abort_request"]
        finally:
            await fake.stop()

    rid, aborts = run(main())
    assert aborts == [{"rid": rid}] and len(rid) == 32  # a uuid: no prefix of another request's rid


def test_missing_logprob_is_an_error_not_zero():
    body = {"output_ids": [4, 5], "meta_info": {"finish_reason": {"type": "stop"},
                                                "output_token_logprobs": [[-0.1, 4, None], [None, 5, None]]}}
    with pytest.raises(FatalRequestError, match="no logprob"):
        parse_generate_response(body, "http://x")


def test_spans_give_per_token_versions_and_unknown_labels_keep_the_stamp():
    meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.1, t, None] for t in range(5)],
            "weight_versions": [{"version": "default", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 5}]}
    out = parse_generate_response({"meta_info": meta}, "http://x", stamp=2)
    assert out.token_versions == [2, 2, 3, 3, 3]


def test_server_back_with_old_weights_stays_out_until_resynced():
    resynced: list[str] = []

    async def main():
        a, b = await FakeSGLang().start(), await FakeSGLang().start()
        try:
            cfg = ManagerConfig(health_interval_s=0.05, eject_after_failures=1, answered_grace_s=0)
            q = events()
            async with ServerManager([a.url, b.url], cfg, initial_version=0, on_event=q.put_nowait) as sm:
                sm.expect_version(0)
                b.healthy = False
                await wait_event(q, f"{b.url} ejected")
                await sm.pause("abort")
                await sm.update_weights_from_disk("/w1", weight_version=1)  # b is out: only a gets it
                await sm.resume()
                sm.expect_version(1)
                assert a.weight_version == "1" and b.weight_version == "default"
                b.healthy = True  # back, but serving the old weights
                await wait_event(q, f"{b.url} answers but serves version None, expected 1")
                state_before = (sm.router.servers[1].healthy, sm.push_targets())

                async def resync(url: str) -> None:
                    resynced.append(url)
                    await sm.update_weights_from_disk("/w1", weight_version=1, urls=[url])

                sm.set_resync(resync)
                await wait_event(q, f"{b.url} re-admitted at version 1")
                return state_before, sm.gauges(), b.weight_version
        finally:
            await a.stop(), await b.stop()

    (healthy_before, targets), g, b_version = run(main())
    assert healthy_before is False and len(targets) == 2  # kept out of routing, but a push must reach it
    assert len(resynced) == 1 and b_version == "1"
    assert g["server/resyncs"] == 1.0 and g["server/stale_servers"] >= 1.0


def test_learner_push_brings_a_stale_server_back():
    async def main():
        a = await FakeSGLang().start()
        try:
            async with ServerManager([a.url], ManagerConfig(health_interval_s=60), initial_version=0) as sm:
                sm.expect_version(2)  # it serves 0: out
                out_before = sm.router.healthy_count
                sm.mark_updated(2, sm.push_targets())
                return out_before, sm.router.healthy_count
        finally:
            await a.stop()

    assert run(main()) == (0, 1)


def test_failed_update_on_one_server_ejects_it_and_keeps_the_rest():
    async def main():
        a, b = await FakeSGLang().start(), await FakeSGLang(refuse={"/update_weights_from_disk"}).start()
        try:
            async with ServerManager([a.url, b.url], ManagerConfig(health_interval_s=60), initial_version=0) as sm:
                await sm.update_weights_from_disk("/w", weight_version=1)
                return sm.server_versions(), [s.healthy for s in sm.router.servers]
        finally:
            await a.stop(), await b.stop()

    versions, healthy = run(main())
    assert list(versions.values()) == [1, 0] and healthy == [True, False]


def test_a_server_answering_requests_is_not_ejected_for_failed_probes():
    """Under heavy load SGLang's /health can miss its timeout; a server still answering requests must stay
    in (ejecting the only server ended a GPU run), and one that answers nothing is ejected."""
    async def main():
        fake = await FakeSGLang(token_delay_s=0.005).start()
        try:
            cfg = ManagerConfig(health_interval_s=0.02, eject_after_failures=1, answered_grace_s=0.5)
            q = events()
            async with ServerManager([fake.url], cfg, on_event=q.put_nowait) as sm:
                await sm.generate("e-first", prompt_ids=[1, 2], sampling_params={**SP, "max_new_tokens": 8})
                fake.healthy = False  # every probe fails from now on
                for i in range(30):
                    await sm.generate(f"e-{i}", prompt_ids=[1, 2], sampling_params={**SP, "max_new_tokens": 8})
                kept = sm.router.servers[0].healthy and sm.gauges()["server/ejections"] == 0
                await wait_event(q, f"{fake.url} ejected")  # idle past the grace: the failing probes count
                return kept
        finally:
            await fake.stop()

    assert run(main()) is True


def test_a_server_that_refuses_connections_is_ejected_inside_the_grace_and_restarted_is_taken_back_resynced():
    """The grace covers a busy server's missed probes, not a dead one: a server that just answered, whose address
    then refuses connections (its process gone; a Ray actor restarting it at the same port), is ejected at once.
    Back at that address with fresh weights (version 0), it is re-admitted only after the resync hook brought
    it to the expected version, never taken back at the weights it serves."""
    async def main():
        fake = await FakeSGLang().start()
        port, resynced = fake.port, []

        async def resync(url: str) -> None:
            resynced.append(url)
            await sm.update_weights_from_disk("/w1", weight_version=1, urls=[url], flush_cache=False)

        try:
            cfg = ManagerConfig(health_interval_s=0.05, answered_grace_s=600)
            q = events()
            async with ServerManager([fake.url], cfg, on_event=q.put_nowait, initial_version=0,
                                     resync=resync) as sm:
                await sm.update_weights_from_disk("/w1", weight_version=1)
                sm.expect_version(1)
                await sm.generate("e", prompt_ids=[1, 2], sampling_params={**SP, "max_new_tokens": 4})
                await fake.stop()  # the process dies right after answering: well inside the grace
                await wait_event(q, f"{fake.url} ejected")
                fake2 = await FakeSGLang(port=port).start()  # restarted at its address, serving fresh weights
                try:
                    line = await wait_event(q, "re-admitted")
                    return line, resynced, fake2.weight_version
                finally:
                    await fake2.stop()
        finally:
            await fake.stop()

    line, resynced, served = run(main())
    assert "re-admitted at version 1" in line and len(resynced) == 1 and served == "1"


def test_pushes_reach_servers_ejected_for_failures_that_answer_again():
    async def main():
        a, b = await FakeSGLang().start(), await FakeSGLang().start()
        try:
            async with ServerManager([a.url, b.url], ManagerConfig(health_interval_s=60), initial_version=0) as sm:
                sm.router.eject(1)  # e.g. timed-out requests under load; the process is alive
                alive = await sm.reachable_targets()
                b.healthy = False  # now really gone
                gone = await sm.reachable_targets()
                return alive, gone, sm.push_targets()
        finally:
            await a.stop(), await b.stop()

    alive, gone, plain = run(main())
    assert len(alive) == 2 and len(gone) == 1 and len(plain) == 1


def _abort_mode_update(n: int, **fake_kw):
    """n calls in flight on a fake server, an abort-mode weight update midway; returns the calls' outputs, the
    server's endpoint events and how many requests were running at each pause."""
    async def main():
        fake = await FakeSGLang(token_delay_s=0.01, **fake_kw).start()
        try:
            async with ServerManager([fake.url], ManagerConfig(health_interval_s=60), initial_version=0) as sm:
                gens = [asyncio.create_task(sm.generate(f"e-{i}", prompt_ids=[5, 6, i], sampling_params=SP))
                        for i in range(n)]
                await fake.wait_until(lambda f: len(f.requests) == n)
                await _update_midway(sm, fake, "abort", 1)
                outs = await asyncio.gather(*gens)
                return outs, list(fake.events), list(fake.running_at_pause)
        finally:
            await fake.stop()

    return run(main())


def test_abort_mode_pause_finds_nothing_running():
    """SGLang's abort-mode pause polls for running requests in 1 s sleeps (>= 1 s per weight sync under
    load): the manager aborts them first and waits for their answers, so the pause finds none running;
    every call still continues under the new weights, token-exact."""
    outs, events, running = _abort_mode_update(8)
    assert running == [0]
    assert events.index("/abort_request") < events.index("/pause_generation")
    assert all(len(o.token_ids) == 40 and o.interrupted == 1 and set(o.token_versions) == {0, 1} for o in outs)


def test_a_server_gets_the_grace_before_its_first_answer():
    """The first wave can keep a server from answering for a while (a cold CPU server: 15 s for its first
    128 episodes) while its probes fail: it is not ejected within the grace; a server that still answers
    nothing after it is."""
    async def main():
        fake = await FakeSGLang().start()
        fake.healthy = False  # every probe fails
        try:
            cfg = ManagerConfig(health_interval_s=0.02, eject_after_failures=1, answered_grace_s=2.0)
            q = events()
            async with ServerManager([fake.url], cfg, on_event=q.put_nowait) as sm:
                fake.hold()
                call = asyncio.create_task(sm.generate("e", prompt_ids=[1, 2], sampling_params={**SP, "max_new_tokens": 4}))
                await fake.wait_until(lambda f: len(f.requests) == 1 and len(f.probes) >= 3)
                kept = sm.router.servers[0].healthy
                fake.release()
                out = await call
                await wait_event(q, f"{fake.url} ejected")  # answered nothing since, past the grace
                return kept, out
        finally:
            await fake.stop()

    kept, out = run(main())
    assert kept is True and len(out.token_ids) == 4


def test_abort_mode_pause_goes_on_when_a_server_refuses_the_early_abort():
    """The early abort is a shortcut only: a server that refuses it still gets the pause, which aborts
    what runs itself, and the calls still continue under the new weights."""
    outs, events, _ = _abort_mode_update(4, refuse={"/abort_request"})
    assert events.index("/abort_request") < events.index("/pause_generation")
    assert all(len(o.token_ids) == 40 and set(o.token_versions) == {0, 1} for o in outs)
