"""Tool-call parsers: well-formed, malformed, and a fuzz run that must never raise."""

from __future__ import annotations

import json
import random

import pytest

from agentloop.errors import ConfigError
from agentloop.tools.parsers import (
    ParseResult,
    get_parser,
    list_parsers,
    parse_hermes,
    parse_llama3_json,
    parse_qwen3_coder,
    register_parser,
)


def test_registry():
    assert {"hermes", "llama3_json", "qwen3_coder"} <= set(list_parsers())
    assert get_parser("hermes") is parse_hermes
    with pytest.raises(ConfigError, match="unknown tool-call parser"):
        get_parser("nope")
    with pytest.raises(ConfigError, match="already registered"):
        register_parser("hermes", lambda s: ParseResult())
    register_parser("hermes", parse_hermes)  # same function again: a no-op


def test_hermes_several_calls_and_string_arguments():
    text = ('I will look.\n<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>\n'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+2\\"}"}</tool_call>')
    r = parse_hermes(text)
    assert [(c.name, c.arguments) for c in r.calls] == [("search", {"query": "x"}),
                                                       ("calculator", {"expression": "1+2"})]
    assert r.errors == [] and r.content == "I will look."


def test_hermes_no_call():
    r = parse_hermes("The answer is 4.")
    assert not r.attempted and r.content == "The answer is 4."


@pytest.mark.parametrize("body,expect", [
    ("{not json}", "malformed JSON"),
    ('{"arguments": {}}', "missing a \"name\""),
    ('{"name": "", "arguments": {}}', "missing a \"name\""),
    ('["search"]', "must be a JSON object"),
    ('{"name": "s", "arguments": [1]}', "must be a JSON object"),
    ('{"name": "s", "arguments": "{bad"}', "not valid JSON"),
    ("", "empty"),
])
def test_hermes_errors(body, expect):
    r = parse_hermes(f"<tool_call>{body}</tool_call>")
    assert r.calls == [] and len(r.errors) == 1 and expect in r.errors[0]


def test_hermes_mixed_and_unclosed():
    r = parse_hermes('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{oops</tool_call>'
                     '<tool_call>{"name": "b", "arguments": {"k": 1}}')
    assert [c.name for c in r.calls] == ["a", "b"] and len(r.errors) == 1
    r = parse_hermes('<tool_call>{"name": "a", "argu')
    assert r.calls == [] and "not closed" in r.errors[0]


def test_llama3_json():
    r = parse_llama3_json('<|python_tag|>{"name": "search", "parameters": {"query": "q"}}; '
                          '{"name": "calc", "arguments": {"e": "1"}}')
    assert [(c.name, c.arguments) for c in r.calls] == [("search", {"query": "q"}), ("calc", {"e": "1"})]
    assert not parse_llama3_json("Just prose.").attempted
    r = parse_llama3_json('{"name": "x", "parameters": {')
    assert r.calls == [] and "malformed JSON" in r.errors[0]


def test_qwen3_coder():
    text = ("Running it.\n<tool_call>\n<function=python>\n<parameter=code>\nprint(1)\nprint(2)\n</parameter>\n"
            "<parameter=timeout>\n5\n</parameter>\n</function>\n</tool_call>")
    r = parse_qwen3_coder(text)
    assert len(r.calls) == 1
    assert r.calls[0].name == "python" and r.calls[0].arguments == {"code": "print(1)\nprint(2)", "timeout": 5}
    assert r.content == "Running it."
    r = parse_qwen3_coder("<tool_call>no function here</tool_call>")
    assert r.calls == [] and "no <function=NAME>" in r.errors[0]


_PIECES = ["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"name"', '"arguments"', ":", ",", '"', "\\",
           "null", "1e999", "-", "search", "\n", " ", "<function=", "<parameter=", ">", "</parameter>",
           "</function>", "<|python_tag|>", ";", "\ud800", "\x00", "é", '"{\\"a\\": 1}"']


def _valid_call(rng: random.Random) -> str:
    obj = {"name": rng.choice(["search", "python", "calc"]),
           "arguments": {"q": rng.choice(["x", 1, None, [1, 2], {"n": "y"}])}}
    return "<tool_call>\n" + json.dumps(obj) + "\n</tool_call>"


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "qwen3_coder"])
def test_fuzz_never_raises(name):
    parse = get_parser(name)
    rng = random.Random(1234)
    for i in range(3000):
        kind = i % 3
        if kind == 0:  # random soup of syntax pieces
            s = "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 40)))
        elif kind == 1:  # valid calls truncated at a random point
            s = "".join(_valid_call(rng) for _ in range(rng.randint(1, 3)))
            s = s[:rng.randint(0, len(s))]
        else:  # valid calls with random characters replaced
            chars = list("".join(_valid_call(rng) for _ in range(rng.randint(1, 3))))
            for _ in range(rng.randint(1, 5)):
                chars[rng.randrange(len(chars))] = rng.choice(_PIECES)
            s = "".join(chars)
        r = parse(s)
        assert isinstance(r, ParseResult)
        for c in r.calls:
            assert isinstance(c.name, str) and c.name and isinstance(c.arguments, dict)
        assert all(isinstance(e, str) for e in r.errors)
    deep = "<tool_call>" + "[" * 100_000 + "</tool_call>"
    assert isinstance(parse(deep), ParseResult)
