"""Tools for the tool-service tests, loaded by `agentloop tools serve --plugin` in its own process and in the
test process (for local runs): per-instance state, a slow call, a raising call, concurrency watched."""

from __future__ import annotations

import asyncio
from typing import Any

from agentloop.tools import BaseTool, ToolResponse, register_tool

_running = 0
_peak = 0


@register_tool("echo", override=True)
class Echo(BaseTool):
    description = "Echo text back, numbered per episode."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}, "sleep_s": {"type": "number"},
                                                   "fail": {"type": "boolean"}}, "required": ["text"]}

    async def create(self, episode: Any, **kwargs: Any) -> dict[str, Any]:
        return {"n": 0, "episode": episode.episode_id, "prefix": kwargs.get("prefix", "")}

    async def execute(self, instance: dict[str, Any], arguments: dict[str, Any]) -> ToolResponse:
        global _running, _peak
        instance["n"] += 1
        if arguments.get("fail"):
            raise ValueError(f"failed on purpose at call {instance['n']}")
        _running += 1
        _peak = max(_peak, _running)
        try:
            if arguments.get("sleep_s"):
                await asyncio.sleep(float(arguments["sleep_s"]))
        finally:
            _running -= 1
        return ToolResponse(text=f"{instance['prefix']}#{instance['n']}: {arguments['text']}",
                            metrics={"peak_running": float(_peak)})

    async def reward(self, instance: dict[str, Any]) -> float | None:
        return float(instance["n"])
