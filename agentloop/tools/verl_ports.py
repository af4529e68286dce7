"""Our own implementations of verl's example tool classes, used for their `class_name` in a verl tool config
when verl itself is not installed (verl's classes need verl and Ray), so verl's own example configs load:

    verl.tools.search_tool.SearchTool   SearchTool here: verl's search tool config
                                        (examples/sglang_multiturn/config/tool_config/search_tool_config.yaml)
    verl.tools.gsm8k_tool.Gsm8kTool     Gsm8kTool here: verl's gsm8k tool config

Each has verl's tool API (`__init__(config, tool_schema)`, `create`, `execute`, `calc_reward`, `release`) and
verl's behaviour (verl b178a3cd, verl/tools/search_tool.py + tools/utils/search_r1_like_utils.py, and
verl/tools/gsm8k_tool.py): the same arguments read, the same response text, step reward and instance life
cycle. Differences, both in the transport: the search request goes through agentloop.tools.retrieval (retried
on connection errors and HTTP 5xx within `timeout` seconds in all, where verl waits `timeout` per attempt over
up to 10 attempts), and `num_workers` / `rate_limit` become one cap on requests in flight per tool instance
(verl: a Ray pool and a global token bucket).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any
from uuid import uuid4

from agentloop.errors import ConfigError

PORTS: dict[str, str] = {
    "verl.tools.search_tool.SearchTool": "agentloop.tools.verl_ports.SearchTool",
    "verl.tools.gsm8k_tool.Gsm8kTool": "agentloop.tools.verl_ports.Gsm8kTool",
}
"""verl class name -> the class used for it when verl is not installed."""


class Response:
    """verl's ToolResponse shape (text only)."""

    def __init__(self, text: str | None = None):
        self.text = text


class _VerlShaped:
    def __init__(self, config: dict, tool_schema: Any):
        self.config = config
        self.tool_schema = tool_schema
        self.name = tool_schema.function.name if tool_schema is not None else ""
        self._instance_dict: dict[str, dict[str, Any]] = {}

    def get_openai_tool_schema(self) -> Any:
        return self.tool_schema

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instance_dict.pop(instance_id, None)


def _passages(items: list[Any]) -> str:
    """verl's _passages2string: 'Doc i (Title: t)\\ntext' per passage, blank-line separated."""
    from agentloop.tools.retrieval import document_of

    out = ""
    for i, item in enumerate(items):
        content = str(document_of(item).get("contents", ""))
        lines = content.split("\n")
        out += f"Doc {i + 1} (Title: {lines[0]})\n" + "\n".join(lines[1:]) + "\n\n"
    return out.strip()


class SearchTool(_VerlShaped):
    """verl's SearchTool: `query_list` -> one POST to a Search-R1 retrieval service -> '{"result": ...}'."""

    def __init__(self, config: dict, tool_schema: Any):
        if tool_schema is None:
            raise ConfigError("verl's SearchTool needs a tool_schema in the tool config")
        super().__init__(config, tool_schema)
        self.retrieval_service_url = config.get("retrieval_service_url")
        if not self.retrieval_service_url:
            raise ConfigError("verl's SearchTool config must include 'retrieval_service_url'")
        self.topk = int(config.get("topk", 3))
        self.timeout = float(config.get("timeout", 30))
        self._slots = asyncio.Semaphore(int(config.get("rate_limit", 120)))

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, Response]:
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "reward": []}
        return instance_id, Response()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[Response, float, dict]:
        from agentloop.tools.retrieval import RetrievalError, retrieve

        queries = parameters.get("query_list") if isinstance(parameters, dict) else None
        if not queries or not isinstance(queries, list):
            msg = "Error: 'query_list' is missing, empty, or not a list in parameters."
            return Response(json.dumps({"result": msg})), 0.0, {}
        try:
            async with self._slots:
                results = await retrieve(self.retrieval_service_url, queries, self.topk, timeout_s=self.timeout)
        except RetrievalError as e:
            text = json.dumps({"result": f"Search error: API Call Failed: {e}"}, ensure_ascii=False)
            return Response(text), 0.0, {"query_count": len(queries), "status": "api_error", "total_results": 0}
        if not results or not any(results):
            text = json.dumps({"result": "No search results found."}, ensure_ascii=False)
            return Response(text), 0.0, {"query_count": len(queries), "status": "no_results", "total_results": 0}
        final = "\n---\n".join(_passages(r) for r in results)
        self._instance_dict.setdefault(instance_id, {"reward": []})["reward"].append(final.strip())
        metrics = {"query_count": len(queries), "status": "success", "total_results": sum(len(r) for r in results)}
        return Response(json.dumps({"result": final}, ensure_ascii=False)), 0.0, metrics

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> Any:
        return self._instance_dict.get(instance_id, {}).get("reward", [])


class Gsm8kTool(_VerlShaped):
    """verl's Gsm8kTool: `answer` (any type, made a string) scored '#### answer' with verl's flexible GSM8K
    rule; step reward 0.0 when the score rose, else -0.05."""

    async def create(self, instance_id: str | None = None, ground_truth: Any = None,
                     **kwargs: Any) -> tuple[str, Response]:
        instance_id = instance_id or str(uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth", None)
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, Response()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[Response, float, dict]:
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        state = self._instance_dict[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return Response(f"Current parsed {answer=} {reward=}"), tool_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float | int:
        state = self._instance_dict[instance_id]
        found = flexible_answer(state["response"])
        if found is None:
            return 0  # verl returns the int 0 here (it shows in the response text as reward=0)
        return 1.0 if found == state["ground_truth"] else 0.0


_NUMBER_RUN = re.compile(r"(-?[0-9.,]+)")


def flexible_answer(text: str) -> str | None:
    """verl's GSM8K `flexible` extraction (the rule agentloop.rewards.verl_gsm8k documents; tools sit below
    rewards, so it is written here again and a test holds the two equal): in the last 300 characters, the
    last run of -/digits/dots/commas that is not "." (all "." -> the first run), commas kept."""
    found = _NUMBER_RUN.findall(text[-300:])
    if not found:
        return None
    for run in reversed(found):
        if run != ".":
            return run
    return found[0]


__all__ = ["Gsm8kTool", "PORTS", "SearchTool"]
