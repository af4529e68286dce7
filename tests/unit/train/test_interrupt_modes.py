"""Interrupt modes meet weight updates on every sync path (agentloop.interrupt), against the scripted server
playing SGLang 0.5.17's and 0.5.23's flush rules (tests/fakes/fake_sglang.py `flush_model`).

A request is held mid-generation by the pause. No path may ask the server for a flush it must refuse: on
0.5.17 that assertion kills the server (in_place and retract crashed the GPU runs this way). The held call
ends with tokens of both versions; retract's prefix cache is flushed after the update (directly, or by
aborting the retracted requests and flushing once they answered); in_place never flushes and salts the cache
per version instead.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from agentloop.config import ManagerConfig, load_config
from agentloop.interrupt import INTERRUPT_MODES, interrupt_policy
from agentloop.server_manager import ServerManager
from agentloop.train.handle.mailbox import LearnerMailbox, MailboxClient
from agentloop.train.handle.protocol import PushOrder, WeightsOnDisk
from agentloop.train.orchestrator.loop import Trainer
from agentloop.train.weights import tensor as wt
from tests.fakes.fake_sglang import FakeSGLang

SP = {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 5}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def test_policy_table():
    abort, retract, in_place = (interrupt_policy(m) for m in ("abort", "retract", "in_place"))
    assert INTERRUPT_MODES == ("abort", "retract", "in_place")
    # abort: the server is idle at the update (every call aborted and drained), so the update flushes
    assert (abort.pause_mode, abort.flush_in_update, abort.flush_after, abort.cache_salt) == ("abort", True, False, False)
    # retract: requests wait in the queue, which 0.5.17 counts as busy: flushed after the update, never in it
    assert (retract.pause_mode, retract.flush_in_update, retract.flush_after, retract.cache_salt) == \
        ("retract", False, True, False)
    # in_place: requests keep running, nothing can flush: a per-version cache key instead
    assert (in_place.pause_mode, in_place.flushes, in_place.cache_salt) == ("in_place", False, True)
    with pytest.raises(ValueError, match="abort"):
        interrupt_policy("drop")


def _trainer(mode: str, sm: ServerManager, tmp_path: Path) -> Trainer:
    cfg = load_config(None, [f"train.interrupt={mode}", "server.urls=[\"http://127.0.0.1:1\"]"])
    return Trainer(cfg, tmp_path, sm, None, None, None, None, [])  # a disk load needs cfg and sm only


async def _push_midway(mode: str, flush_model: str, tmp_path: Path):
    fake = await FakeSGLang(token_delay_s=0.01, flush_model=flush_model).start()
    try:
        async with ServerManager([fake.url], ManagerConfig(health_interval_s=60), initial_version=0,
                                 cache_salt=interrupt_policy(mode).cache_salt) as sm:
            trainer = _trainer(mode, sm, tmp_path)
            gen = asyncio.create_task(sm.generate("e-0", prompt_ids=[5, 6, 7], sampling_params=SP))
            await fake.started.wait()  # the call is producing tokens when the push comes
            await trainer.weights.load(WeightsOnDisk(str(tmp_path / "w1")), 1)
            out = await gen
            after = await sm.generate("e-1", prompt_ids=[5, 6, 7], sampling_params=SP)
            return out, after, fake, sm.gauges()
    finally:
        await fake.stop()


@pytest.mark.parametrize("flush_model", ["0.5.17", "0.5.23"])
@pytest.mark.parametrize("mode", INTERRUPT_MODES)
def test_disk_push_in_every_mode_keeps_the_server_alive(mode, flush_model, tmp_path):
    out, after, fake, g = run(_push_midway(mode, flush_model, tmp_path))
    assert not fake.crashed, f"{mode} asked {flush_model} for a flush it asserts on"
    assert len(out.token_ids) == 40 and out.token_versions[0] == 0 and out.token_versions[-1] == 1
    assert out.token_versions == sorted(out.token_versions)
    assert after.token_versions == [1] * 40
    updates = [b for p, b in fake.admin if p == "/update_weights_from_disk"]
    flushes = [p for p, _ in fake.admin if p == "/flush_cache"]
    assert len(updates) == 1 and updates[0]["flush_cache"] is interrupt_policy(mode).flush_in_update
    if mode == "abort":
        assert flushes == []  # flushed by the update itself (idle after the abort-and-drain)
    elif mode == "retract":
        refused = flush_model == "0.5.17"  # 0.5.17 counts the retracted request as busy; 0.5.23 does not
        assert g["server/flushes_refused"] == float(refused)
        assert len(flushes) == 1 + refused
        if refused:  # the retracted call was aborted and continued under the new weights
            assert ("/abort_request", {"rid": "", "abort_all": True}) in fake.admin
            assert g["server/interrupted_calls"] == 1 and g["server/continued_calls"] == 1
    else:
        assert flushes == [] and g["server/flushes_refused"] == 0
        keys = [r.get("extra_key") for r in fake.requests]
        assert keys[0] == "agentloop-v0" and keys[-1] == "agentloop-v1", keys


def test_unflushable_server_is_ejected_not_left_with_stale_cache(tmp_path):
    """retract on a server whose flush is refused even once the retracted calls answered, for all of
    manager.flush_timeout_s: ejected (its cache holds the old weights' KV)."""
    async def main():
        fake = await FakeSGLang(token_delay_s=0.01, flush_model="0.5.17").start()
        fake.refuse.add("/flush_cache")
        try:
            lines: list[str] = []
            async with ServerManager([fake.url], ManagerConfig(health_interval_s=60, flush_timeout_s=0.5), initial_version=0,
                                     on_event=lines.append) as sm:
                await sm.pause("retract")
                await sm.finish_update(interrupt_policy("retract"))
                return sm.router.servers[0].healthy, lines
        finally:
            await fake.stop()

    healthy, lines = run(main())
    assert not healthy and any("kept its prefix cache" in ln for ln in lines), lines


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.proj = torch.nn.Linear(8, 8)


@pytest.mark.parametrize("mode", INTERRUPT_MODES)
def test_tensor_push_payloads_follow_the_mode(mode, monkeypatch):
    """The learner's tensor payloads flush only where the mode allows, so a request held in place or retracted
    on 0.5.17 survives the push (before: flush_cache true on the last bucket, whatever the mode)."""
    monkeypatch.setattr(wt, "serialize_cuda_bucket", lambda flat, meta: "payload")

    async def main():
        fake = await FakeSGLang(token_delay_s=0.01, flush_model="0.5.17").start()
        try:
            async with ServerManager([fake.url], ManagerConfig(health_interval_s=60), initial_version=0) as sm:
                policy = interrupt_policy(mode)
                gen = asyncio.create_task(sm.generate("e-0", prompt_ids=[5, 6, 7], sampling_params=SP))
                await fake.started.wait()
                await sm.pause(policy.pause_mode)
                sync = wt.TensorSync(bucket_bytes=50 * 8 * 2, timeout_s=10)
                await asyncio.to_thread(sync.push, Tiny(), dtype=torch.bfloat16, device=torch.device("cpu"), rank=0,
                                        urls=[fake.url], version="1", flush_cache=policy.flush_in_update)
                await sm.finish_update(policy)
                sm.mark_updated(1, [fake.url])
                sm.expect_version(1)
                await sm.resume()
                return await gen, fake
        finally:
            await fake.stop()

    out, fake = run(main())
    assert not fake.crashed
    bodies = [b for p, b in fake.admin if p == "/update_weights_from_tensor"]
    assert len(bodies) >= 2
    assert [b["flush_cache"] for b in bodies] == [False] * (len(bodies) - 1) + [mode == "abort"]
    assert len(out.token_ids) == 40 and out.token_versions[-1] == 1


def test_the_mode_travels_with_the_push(tmp_path):
    """The PushOrder (sync.go) carries the mode; the learner's flush follows it (no mode: no flush, the safe
    side)."""
    client, box = MailboxClient(tmp_path, poll_s=0.01), LearnerMailbox(tmp_path)
    for step, mode in enumerate(INTERRUPT_MODES, start=1):
        box.request_sync(step, "tensor")
        client.allow_sync(PushOrder(step, ("http://a",), mode))
        order = box.ask_push(step, "tensor", 5)
        assert order == PushOrder(step, ("http://a",), mode)
        assert order.flush_cache is interrupt_policy(mode).flush_in_update
    assert PushOrder.from_json({"urls": ["http://a"]}).flush_cache is False
    with pytest.raises(ValueError):
        _ = PushOrder(1, (), "drop").flush_cache
