"""LoRA training's requests (ManagerState.lora_adapters), against the scripted server: each /generate names its
server's adapter version (none at version 0, the base model), every token carries the version of the adapter its
request named (SGLang keeps a request on its adapter whatever the server's label says), and an abort-mode
continuation names the new adapter."""

from __future__ import annotations

import asyncio

import pytest

from agentloop.client.data_plane import LORA_ADAPTER_PREFIX
from agentloop.config import ManagerConfig
from agentloop.server_manager import ServerManager
from agentloop.train.lora import ADAPTER_PREFIX, adapter_name
from tests.fakes.fake_sglang import FakeSGLang

SP = {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 5}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def test_the_served_adapter_names_agree():
    assert LORA_ADAPTER_PREFIX == ADAPTER_PREFIX and adapter_name(4) == "agentloop-v4"


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_requests_name_their_adapter_and_tokens_carry_its_version(mode):
    async def main():
        fake = await FakeSGLang(token_delay_s=0.01).start()
        try:
            async with ServerManager([fake.url], ManagerConfig(health_interval_s=60), initial_version=0) as sm:
                sm.state.lora_adapters = True
                base = await sm.generate("e-0", prompt_ids=[5, 6, 7], sampling_params={**SP, "max_new_tokens": 4})
                sm.mark_updated(2, [fake.url])
                fake.started.clear()  # set by the base call
                gen = asyncio.create_task(sm.generate("e-1", prompt_ids=[5, 6, 7], sampling_params=SP))
                await fake.started.wait()
                during = dict(sm.state.adapter_inflight)  # what lora_servers reads before unloading an adapter
                await sm.pause(mode=mode)
                # the server's label moves to 3 (its spans say so) while the request still runs on adapter 2
                await sm.update_weights_from_disk("/w", weight_version=3, flush_cache=False)
                await sm.resume()
                out = await gen
                assert during == {(fake.url, 2): 1} and not sm.state.adapter_inflight
                return base, out, list(fake.requests)
        finally:
            await fake.stop()

    base, out, reqs = run(main())
    assert "lora_path" not in reqs[0] and base.token_versions == [0] * 4  # version 0: the base model
    assert reqs[1]["lora_path"] == "agentloop-v2"
    if mode == "abort":  # cut and continued under the new adapter, named
        k = out.token_versions.index(3)
        assert out.token_versions == [2] * k + [3] * (40 - k) and reqs[2]["lora_path"] == "agentloop-v3"
    else:  # retract, in_place: SGLang kept the request on adapter 2: every token is 2's, whatever the spans said
        assert len(reqs) == 2 and out.token_versions == [2] * 40 and out.weight_version == "2"


def test_an_adapter_name_an_earlier_load_left_taken_is_unloaded_and_loaded_again():
    """A server keeps the adapters of a killed (or finished) run under their names; loading version v again (a
    resumed run, a new run on the same servers) is answered HTTP 400 "already loaded" by SGLang 0.5.23: the stale
    adapter is unloaded and the new one loaded, not the step failed."""
    from types import SimpleNamespace

    from agentloop.errors import FatalRequestError
    from agentloop.train.weights.lora_servers import LoraHalf

    calls: list[tuple[str, dict]] = []
    taken = {"agentloop-v3"}

    async def admin_post(url, path, body, **kw):
        calls.append((path, body))
        if path == "/load_lora_adapter" and body["lora_name"] in taken:
            raise FatalRequestError(f'{url}{path} answered HTTP 400: {{"success":false,"error_message":"Failed to '
                                    f'load LoRA adapter {body["lora_name"]} because it is already loaded"}}',
                                    server=url, status=400)
        if path == "/unload_lora_adapter":
            taken.discard(body["lora_name"])
        return {"success": True}

    half = LoraHalf.__new__(LoraHalf)
    half.sm = SimpleNamespace(state=SimpleNamespace(admin_post=admin_post))
    half.loaded = {}
    run(half._load_one("http://s", "/run/weights/step-000003", 3))
    assert [p for p, _ in calls] == ["/load_lora_adapter", "/unload_lora_adapter", "/load_lora_adapter",
                                     "/update_weight_version"]
    assert calls[2][1] == {"lora_name": "agentloop-v3", "lora_path": "/run/weights/step-000003"}
    assert half.loaded == {"http://s": {3}}


def test_the_push_order_names_the_adapters_no_server_holds_any_more():
    """LoraHalf.order (weight_sync tensor): a version the learner pushed is reported released once every server
    that loaded it unloaded it, and only once; the order survives its JSON trip (mailbox, Ray)."""
    from types import SimpleNamespace

    from agentloop.train.handle.protocol import PushOrder
    from agentloop.train.weights.lora_servers import LoraHalf

    half = LoraHalf.__new__(LoraHalf)
    half.policy = SimpleNamespace(mode="retract")
    half.loaded, half.handed = {"http://a": {1, 2}, "http://b": {2}}, {1, 2}
    assert half.order(3, ["http://a", "http://b"]).released == ()
    half.loaded["http://a"].discard(1)  # b never loaded 1, a unloaded it
    order = half.order(3, ["http://a", "http://b"])
    assert order == PushOrder(3, ("http://a", "http://b"), "retract", released=(1,))
    assert PushOrder.from_json(order.to_json()) == order
    assert half.order(3, ["http://a"]).released == () and half.handed == {2}
    half.loaded = {"http://a": set(), "http://b": set()}
    assert half.order(4, ["http://a"]).released == (2,)


def _half_with_sglang_lock(inflight: dict, never_ends: set[str] = frozenset(), limit_s: float = 5.0):
    """A LoraHalf whose admin calls follow SGLang's LoRA lock: an unload answers once no request names the adapter
    (`inflight`, the client's count, stands for the server's), a name in `never_ends` never does."""
    from collections import Counter
    from types import SimpleNamespace

    from agentloop.client.state import ManagerState
    from agentloop.train.weights.lora_servers import LoraHalf

    calls: list[tuple[str, str]] = []
    freed = asyncio.Event()

    async def admin_post(url, path, body, **kw):
        calls.append((path, body["lora_name"]))
        if path == "/unload_lora_adapter":
            if body["lora_name"] in never_ends:
                await asyncio.Event().wait()
            while state.adapter_inflight.get((url, int(body["lora_name"].rsplit("v", 1)[1]))):
                await freed.wait()
        return {"success": True}

    state = SimpleNamespace(admin_post=admin_post, adapter_inflight=Counter(inflight), background=set(),
                            cfg=SimpleNamespace(admin_timeout_s=limit_s), say=print)
    state.spawn = lambda coro, name: ManagerState.spawn(state, coro, name)
    half = LoraHalf.__new__(LoraHalf)
    half.sm = SimpleNamespace(state=state)
    half.loaded, half.unloading = {}, {}
    return half, calls, freed


def test_an_adapter_a_call_still_names_is_not_unloaded_until_a_later_push_finds_it_free():
    """SGLang's unload holds its LoRA lock until the last request naming the adapter ends, and every load takes
    that lock: an unload sent while a request under the old adapter runs, then frozen by the next pause (in_place,
    retract), held the next push forever. Only adapters no call names are unloaded; the others wait."""
    async def main():
        half, calls, _freed = _half_with_sglang_lock({("http://s", 2): 1})
        half.loaded = {"http://s": {1, 2, 3}}
        half._start_unloads(["http://s"], 3)
        await half._settle_unloads()
        first = list(calls)
        half.sm.state.adapter_inflight.clear()  # the request under adapter 2 ended
        half.loaded["http://s"].add(4)
        half._start_unloads(["http://s"], 4)
        await half._settle_unloads()
        return first, calls[len(first):], half.loaded

    first, later, loaded = run(main())
    assert first == [("/unload_lora_adapter", "agentloop-v1")]
    assert later == [("/unload_lora_adapter", "agentloop-v2"), ("/unload_lora_adapter", "agentloop-v3")]
    assert loaded == {"http://s": {4}}


def test_an_unload_that_never_ends_fails_the_push_with_its_cause_not_a_hang():
    """Before a pause, the unloads started after the last push have ended; one that has not within
    manager.admin_timeout_s (an old SGLang's leaked count) fails the push naming the server and the cause."""
    from agentloop.train.weights.servers import TransportError

    async def main():
        half, _calls, _freed = _half_with_sglang_lock({}, never_ends={"agentloop-v1"}, limit_s=0.2)
        half.loaded = {"http://s": {1, 2}}
        half._start_unloads(["http://s"], 2)
        with pytest.raises(TransportError, match=r"http://s.*has not ended.*admin_timeout_s"):
            await half._settle_unloads()
        for t in list(half.sm.state.background):
            t.cancel()

    run(main())
