"""How real harnesses render the calculator task: the tool schemas and system prompts they send, as the gateway
received them from the harnesses of examples/harnesses/ (captured from their requests). A warm start trained on
one rendering only (agentloop's) scores ~0 under the others (the Agents SDK's `"strict": true` and titles,
LangChain's key order, smolagents' system prompt); `WarmStartSpec(renderings="varied")` trains over all of them.

    Rendering     tools (OpenAI function schemas, as the chat template gets them), the system prompt (None: the
                  task's CALCULATOR_SYSTEM, which agent SDKs pass on as the agent's instructions), a user prefix
    RENDERINGS    name -> Rendering; "agentloop" is the built-in tool loop's (the only one of renderings="fixed")
    pick          the rendering of trace i (seeded; "agentloop" a third of the time, the rest evenly)

The smolagents system prompt (prompts/smolagents_tool_calling.txt) is smolagents 1.26's ToolCallingAgent prompt
(Apache-2.0) for the tools of examples/harnesses/smolagents_tool_calling.py, verbatim, so that harness's requests
are in the training distribution token for token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_PROMPTS = Path(__file__).resolve().parent / "prompts"
_DESCRIPTION = "Evaluate an arithmetic expression and return the result."
"""The docstring of the harnesses' calculator function (examples/harnesses/)."""


@dataclass(frozen=True)
class Rendering:
    name: str
    tools: list[dict[str, Any]]
    system: str | None = None
    """The system prompt; None: the task's own (CALCULATOR_SYSTEM)."""
    user_prefix: str = ""
    """Text the harness puts before the task's question."""
    extra: dict[str, Any] = field(default_factory=dict)


def _fn(parameters: dict[str, Any], *, strict: bool = False, description: str = _DESCRIPTION) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": "calculator", "description": description, "parameters": parameters}
    if strict:
        fn["strict"] = True
    return {"type": "function", "function": fn}


def _renderings() -> dict[str, Rendering]:
    from agentloop.tools.registry import get_tool

    pydantic_params = {"properties": {"expression": {"title": "Expression", "type": "string"}},
                       "required": ["expression"], "title": "calculator_args", "type": "object",
                       "additionalProperties": False}
    langchain_params = {"properties": {"expression": {"type": "string"}}, "required": ["expression"], "type": "object"}
    smol_params = {"type": "object", "properties": {"expression": {
        "type": "string", "description": "the arithmetic expression, e.g. \"37 * 24 + 5\"."}},
        "required": ["expression"]}
    final_answer = {"type": "function", "function": {
        "name": "final_answer", "description": "Provides a final answer to the given problem.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string",
                                                                   "description": "The final answer to the problem"}},
                       "required": ["answer"]}}}
    return {r.name: r for r in (
        Rendering("agentloop", [get_tool("calculator")().schema]),
        Rendering("agents_sdk_chat", [_fn(pydantic_params, strict=True)]),  # OpenAIChatCompletionsModel
        Rendering("agents_sdk_responses", [_fn(pydantic_params)]),  # Responses: the gateway drops `strict`
        Rendering("langgraph", [_fn(langchain_params)]),  # langchain-openai's key order
        Rendering("smolagents", [_fn(smol_params), final_answer],
                  system=(_PROMPTS / "smolagents_tool_calling.txt").read_text(), user_prefix="New task:\n"),
    )}


_CACHE: dict[str, Rendering] = {}


def renderings() -> dict[str, Rendering]:
    """name -> Rendering (made once)."""
    if not _CACHE:
        _CACHE.update(_renderings())
    return _CACHE


def pick(rng: random.Random) -> Rendering:
    """One trace's rendering: agentloop's a third of the time (the tool loop and the in-process agent), the
    harnesses' the rest, evenly."""
    rs = renderings()
    if rng.random() < 1 / 3:
        return rs["agentloop"]
    return rng.choice([r for n, r in rs.items() if n != "agentloop"])


__all__ = ["Rendering", "pick", "renderings"]
