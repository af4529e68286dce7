"""Fixes for bugs of older SGLang releases that agentloop's runs meet, applied in the servers agentloop starts.

`python -m agentloop.inference.sglang_fixes <sglang.launch_server args>` installs them and runs SGLang's own launcher
unchanged (the GPU launcher uses it for LoRA servers; the CPU entry, agentloop.inference.sglang_cpu.launch_server,
installs them too). Each fix checks for the release's own and does nothing where SGLang has it.

lora_abort_release
    A LoRA request counts as using its adapter until it ends; an unload waits for the count to reach zero while it
    holds the tokenizer manager's LoRA lock, which every load takes. SGLang 0.5.17's tokenizer manager ends a request
    aborted while waiting in the scheduler's queue (the AbortReq echo, `_handle_abort_req`) without ending its count,
    so after an abort-mode pause with requests queued the old adapter's unload waits forever, and the next load with
    it (measured: an H200 `agentloop train` with LoRA r32, tensor sync, hung at step 3's push). Later releases end
    the count there (`TokenizerManager._release_lora_once`); the fix does what they do.
"""

from __future__ import annotations

import asyncio
import runpy
import sys
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

_HANDLED_BY_WAITER = (HTTPStatus.SERVICE_UNAVAILABLE, HTTPStatus.INTERNAL_SERVER_ERROR)
"""Abort statuses whose count the request's own waiter ends (0.5.17's `_handle_abort_finish_reason`)."""


def releasing_abort_handler(original: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """`_handle_abort_req` that also ends the LoRA count of the request it finishes, once (module doc). Pure over
    the manager's `rid_to_state`, `enable_lora` and `lora_registry`, so a test can drive it without a server."""
    tasks: set[asyncio.Task] = set()

    def handle(self: Any, recv_obj: Any) -> None:
        state = self.rid_to_state.get(recv_obj.rid)
        original(self, recv_obj)
        if state is None or self.rid_to_state.get(recv_obj.rid) is state:
            return  # not this handler's request, or not finished by it
        obj = state.obj
        if not (getattr(self, "enable_lora", False) and getattr(obj, "lora_path", None)):
            return
        reason = getattr(recv_obj, "finished_reason", None) or {}
        if reason.get("type") == "abort" and reason.get("status_code") in _HANDLED_BY_WAITER:
            return
        if getattr(state, "agentloop_lora_released", False):
            return
        state.agentloop_lora_released = True
        task = asyncio.get_running_loop().create_task(self.lora_registry.release(obj.lora_id))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    handle.agentloop_fix = True  # type: ignore[attr-defined]
    return handle


def install() -> list[str]:
    """Apply the fixes this SGLang needs; the names of those applied."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    applied = []
    if not hasattr(TokenizerManager, "_release_lora_once") and not getattr(
            TokenizerManager._handle_abort_req, "agentloop_fix", False):
        TokenizerManager._handle_abort_req = releasing_abort_handler(TokenizerManager._handle_abort_req)
        applied.append("lora_abort_release")
    return applied


def main(argv: list[str] | None = None) -> None:
    applied = install()
    if applied:
        print(f"agentloop: SGLang fixes applied: {', '.join(applied)}", flush=True)
    sys.argv = ["sglang.launch_server", *(sys.argv[1:] if argv is None else argv)]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
