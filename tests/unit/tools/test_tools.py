"""Tool layer: registry, argument validation, calculator, search, config."""

from __future__ import annotations

import asyncio
import json

import pytest

import agentloop.tools as tools_pkg
from agentloop.errors import ConfigError, DataError
from agentloop.tools import (
    BaseTool,
    ToolResponse,
    ToolsConfig,
    get_tool,
    list_tools,
    register_tool,
)
from agentloop.tools.calculator import CalcError, calculate
from agentloop.tools.schema import validate
from agentloop.tools.search import BM25Index, SearchTool, load_corpus
from tests.unit.api_check import assert_public_api


def test_public_api():
    assert_public_api(tools_pkg)


def test_config_fields_documented():
    from agentloop.tools.config import PythonToolConfig, SearchToolConfig

    for model in (ToolsConfig, PythonToolConfig, SearchToolConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"
    with pytest.raises(ValueError):
        ToolsConfig(nmes=["x"])


def test_registry():
    assert {"python", "calculator", "search"} <= set(list_tools())

    class Echo(BaseTool):
        name = "echo_test"
        description = "Echo."

        async def execute(self, instance, arguments):
            return ToolResponse(text=json.dumps(arguments))

    register_tool("echo_test", Echo)
    register_tool("echo_test", Echo)  # same class: no-op
    assert get_tool("echo_test") is Echo

    class Other(Echo):
        pass

    with pytest.raises(ConfigError, match="already registered"):
        register_tool("echo_test", Other)
    register_tool("echo_test", Other, override=True)
    assert get_tool("echo_test") is Other
    with pytest.raises(ConfigError, match="unknown tool"):
        get_tool("no_such_tool")
    with pytest.raises(ConfigError, match="not a subclass"):
        register_tool("bad", dict)
    schema = Echo().schema
    assert schema["type"] == "function" and schema["function"]["name"] == "echo_test"


SCHEMA = {
    "type": "object",
    "properties": {
        "q": {"type": "string", "minLength": 1},
        "k": {"type": "integer", "minimum": 1, "maximum": 5},
        "mode": {"type": "string", "enum": ["a", "b"]},
        "x": {"type": "number"},
        "flag": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["q"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("args,expect", [
    ({"q": "hi"}, None),
    ({"q": "hi", "k": 3, "mode": "a", "x": 1.5, "flag": True, "tags": ["t"]}, None),
    ({"q": "hi", "x": 2}, None),
    ({}, "missing required property 'q'"),
    ({"q": 3}, "arguments.q must be of type string"),
    ({"q": "hi", "k": True}, "arguments.k must be of type integer"),
    ({"q": "hi", "k": 1.5}, "arguments.k must be of type integer"),
    ({"q": "hi", "k": 9}, "arguments.k must be <= 5"),
    ({"q": "hi", "mode": "c"}, "must be one of"),
    ({"q": "hi", "zzz": 1}, "unexpected property 'zzz'"),
    ({"q": "hi", "tags": ["a", 2]}, "arguments.tags[1] must be of type string"),
    ({"q": ""}, "at least 1 characters"),
    ([1], "arguments must be of type object"),
])
def test_schema_validator(args, expect):
    errors = validate(args, SCHEMA)
    if expect is None:
        assert errors == []
    else:
        assert any(expect in e for e in errors), errors


@pytest.mark.parametrize("expr,value", [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("7 // 2", 3), ("7 % 4", 3), ("2 ** 10", 1024), ("2 ^ 3", 8),
    ("-3 + +4", 1), ("sqrt(16)", 4.0), ("log(8, 2)", 3.0), ("max(1, 5, 3)", 5), ("factorial(5)", 120),
    ("round(pi, 2)", 3.14), ("10 / 4", 2.5),
])
def test_calculator_values(expr, value):
    assert calculate(expr) == pytest.approx(value)


@pytest.mark.parametrize("expr,msg", [
    ("__import__('os').system('x')", "not allowed"), ("__import__('os')", "unknown function"), ("().__class__", "not allowed"), ("a + 1", "unknown name"),
    ("1 / 0", "division by zero"), ("9 ** 9 ** 9", "too large"), ("2 ** 100000", "too large"),
    ("10.0 ** 400", "too large"), ("factorial(5000)", "factorial"), ("'a' * 3", "only numbers"),
    ("1 +", "syntax error"), ("1" * 600, "longer than"), ("+".join(["1"] * 150), "more than"),
    ("sqrt(-1)", "sqrt"), ("(-8) ** 0.5", "complex"), ("lambda: 1", "not allowed"),
])
def test_calculator_rejects(expr, msg):
    with pytest.raises(CalcError, match=msg):
        calculate(expr)


def test_calculator_tool():
    tool = get_tool("calculator")()
    ok = asyncio.run(tool.execute(None, {"expression": "6 * 7"}))
    assert ok.text == "42" and ok.error is None
    bad = asyncio.run(tool.execute(None, {"expression": "open('x')"}))
    assert bad.text.startswith("error:") and bad.error


def test_bm25_ranks():
    docs = [{"id": "1", "title": "cats", "text": "cats purr and sleep"},
            {"id": "2", "title": "dogs", "text": "dogs bark loudly at cats"},
            {"id": "3", "title": "fish", "text": "fish swim"}]
    idx = BM25Index(docs)
    hits = idx.search("do cats purr", 3)
    assert [d["id"] for _, d in hits] == ["1", "2"]
    assert idx.search("zebra", 3) == []


def test_search_tool_demo_corpus():
    tool = SearchTool()
    assert len(tool.index().docs) >= 40
    r = asyncio.run(tool.execute(None, {"query": "capital of Australia", "top_k": 2}))
    assert r.text.startswith("Doc 1(Title: Canberra)") and r.text.count("\nDoc ") == 1
    r = asyncio.run(tool.execute(None, {"query": "qwxzzy"}))
    assert r.text == "No results found."


def test_search_custom_corpus(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"id": "a", "title": "T", "text": "unique walrus fact"}) + "\n\n")
    cfg = ToolsConfig(search={"corpus_path": str(p), "top_k": 1})
    r = asyncio.run(SearchTool(cfg).execute(None, {"query": "walrus"}))
    assert r.text == "Doc 1(Title: T) unique walrus fact"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    with pytest.raises(DataError, match="bad.jsonl:1"):
        load_corpus(bad)
