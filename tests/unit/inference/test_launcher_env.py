"""The environment agentloop's launcher gives a server (agentloop.inference.launcher.LocalServer.environment)."""

from __future__ import annotations

import pytest

from agentloop.inference.launcher import LocalServer
from agentloop.train.config import LoraConfig
from agentloop.train.lora import server_args

MALLOC = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_lora_server_keeps_freed_host_memory_and_a_users_setting_wins(device, monkeypatch):
    """A LoRA server (the flags a LoRA run's launched servers get) keeps freed host memory in its heap, so each
    step's adapter load reuses the unloaded one's pages (docs/learner.md: SGLang's load 62-67 -> 36-40 ms at 1.5B);
    other servers keep glibc's defaults, and a value the user set is left alone."""
    for k in MALLOC:
        monkeypatch.delenv(k, raising=False)
    lora = server_args(LoraConfig(enabled=True, rank=8), device)
    env = LocalServer("/m", device=device, port=30001, extra_args=lora).environment()
    assert int(env["MALLOC_MMAP_THRESHOLD_"]) == 32 << 20 and int(env["MALLOC_TRIM_THRESHOLD_"]) == 1 << 30
    plain = LocalServer("/m", device=device, port=30001).environment()
    assert not any(k in plain for k in MALLOC)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "4096")
    assert LocalServer("/m", device=device, port=30001, extra_args=lora).environment()["MALLOC_TRIM_THRESHOLD_"] == "4096"
