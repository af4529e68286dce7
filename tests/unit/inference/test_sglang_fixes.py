"""agentloop.inference.sglang_fixes: the LoRA count of a request aborted in SGLang's queue ends (SGLang 0.5.17's
tokenizer manager left it, so the adapter's unload, holding the LoRA lock, waited forever). Driven against SGLang's
own LoRARegistry with a handler that does what 0.5.17's does: finish the request's state, end no count."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from http import HTTPStatus
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentloop.inference.launcher import LocalServer
from agentloop.inference.sglang_fixes import releasing_abort_handler


def _old_handler(self, recv_obj):  # 0.5.17's _handle_abort_req, as far as the count goes
    state = self.rid_to_state.get(recv_obj.rid)
    if state is None:
        return
    del self.rid_to_state[recv_obj.rid]
    state.finished = True


async def _abort_queued_then_unload(handler, status: int | None = None) -> bool:
    """A request under adapter "a" aborted while queued, then the adapter unloaded: did the unload's wait end?"""
    from sglang.srt.lora.lora_registry import LoRARef, LoRARegistry

    registry = LoRARegistry()
    ref = LoRARef(lora_name="a", lora_path="/a")
    await registry.register(ref)
    obj = SimpleNamespace(rid="r1", lora_path="a", lora_id=await registry.acquire("a"))
    manager = SimpleNamespace(rid_to_state={"r1": SimpleNamespace(obj=obj)}, enable_lora=True,
                              lora_registry=registry)
    reason = {"type": "abort", "status_code": status} if status else None
    handler(manager, SimpleNamespace(rid="r1", finished_reason=reason))
    assert "r1" not in manager.rid_to_state
    lora_id = await registry.unregister("a")
    try:
        await asyncio.wait_for(registry.wait_for_unload(lora_id), timeout=0.5)
        return True
    except asyncio.TimeoutError:
        return False


def test_a_request_aborted_in_the_queue_no_longer_holds_its_adapter():
    assert asyncio.run(_abort_queued_then_unload(_old_handler)) is False  # the bug, as 0.5.17 has it
    assert asyncio.run(_abort_queued_then_unload(releasing_abort_handler(_old_handler))) is True


def test_an_abort_whose_waiter_ends_the_count_is_not_counted_twice():
    """0.5.17's waiter ends the count of a 503/500 abort itself: the fix leaves those alone (a count ended twice
    would go below zero and let an unload pass a request still running)."""
    fixed = releasing_abort_handler(_old_handler)
    assert asyncio.run(_abort_queued_then_unload(fixed, HTTPStatus.SERVICE_UNAVAILABLE)) is False
    assert asyncio.run(_abort_queued_then_unload(fixed, HTTPStatus.BAD_REQUEST)) is True


def test_the_fix_stays_out_of_an_sglang_that_has_its_own(monkeypatch):
    """install() leaves a tokenizer manager that has `_release_lora_once` as it is, patches one without it once; the
    installed SGLang's own source is read for the method, not imported (importing the tokenizer manager takes ~20 s
    and sets uvloop as asyncio's policy for every later test of this process). Every CPU server agentloop starts
    runs install() on the real module (launch_server.prepare)."""
    from agentloop.inference import sglang_fixes

    class WithFix:
        def _release_lora_once(self): ...

        def _handle_abort_req(self, recv_obj): ...

    class WithoutFix:
        def _handle_abort_req(self, recv_obj): ...

    module = "sglang.srt.managers.tokenizer_manager"
    spec = importlib.util.find_spec("sglang")  # found, not imported (its package imports thousands of modules)
    source = None if spec is None else Path(spec.submodule_search_locations[0]) / "srt" / "managers" / "tokenizer_manager.py"
    for cls, applied in ((WithFix, []), (WithoutFix, ["lora_abort_release"]), (WithoutFix, [])):
        before = cls._handle_abort_req
        monkeypatch.setitem(sys.modules, module, SimpleNamespace(TokenizerManager=cls))
        assert sglang_fixes.install() == applied
        assert (cls._handle_abort_req is before) == (not applied)
    if source is None or "def _release_lora_once" not in source.read_text():
        pytest.skip("this SGLang lacks the upstream fix")


def test_a_gpu_lora_server_starts_through_the_fixes():
    lora = LocalServer("/m", device="cuda", port=30001, extra_args=["--enable-lora"])
    assert lora.command()[1:3] == ["-m", "agentloop.inference.sglang_fixes"]
    root = Path(__file__).resolve().parents[3]  # the checkout: agentloop importable in the server's process
    assert lora.environment()["PYTHONPATH"].split(os.pathsep)[0] == str(root)
    assert LocalServer("/m", device="cuda", port=30001).command()[1:3] == ["-m", "sglang.launch_server"]
