"""Scripted tool calls for benches: a parser that reads any model turn as one call of a given tool.

A tiny random model almost never calls a tool; `agentloop bench tools --bench-force-tools` and the capacity
bench against a real server use this parser so every turn runs a real tool call (only the decision to call
is scripted). Its own module so the benches that use it need not import each other.
"""

from __future__ import annotations

from typing import Any

from agentloop.tools.parsers import ParseResult, ToolCall

FORCED_CALLS: dict[str, dict[str, Any]] = {
    "calculator": {"expression": "37 * 24 + 5"},
    "python": {"code": "print(sum(i * i for i in range(1000)))"},
    "search": {"query": "capital of Australia"},
}
"""Arguments of the scripted call per tool, for --bench-force-tools."""


def forced_parser(tool: str):
    """A tool-call parser that reads any text as one call of `tool` with FORCED_CALLS[tool]."""
    arguments = FORCED_CALLS[tool]

    def parse(text: str) -> ParseResult:
        return ParseResult(calls=[ToolCall(name=tool, arguments=dict(arguments))], content=text)

    return parse
