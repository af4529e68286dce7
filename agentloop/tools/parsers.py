"""Tool-call parsers: model text in, calls and per-call errors out, never an exception.

    ToolCall        one call: name + arguments dict
    ParseResult     calls, errors (one message per malformed call), and the text outside the calls
    hermes          <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number per turn (Qwen2.5/3)
    llama3_json     {"name": ..., "parameters": {...}} objects, one per line or `;`-separated (Llama 3.x)
    qwen3_coder     <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>

To add one: write `parse(text) -> ParseResult` and `register_parser("name", fn)`. Unknown tool names
are reported by the loop (it knows the episode's tools), not by the parser.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from agentloop.errors import ConfigError


@dataclass
class ToolCall:
    name: str
    """Tool name as the model wrote it."""
    arguments: dict[str, Any]
    """Decoded arguments object."""


@dataclass
class ParseResult:
    calls: list[ToolCall] = field(default_factory=list)
    """Well-formed calls, in order."""
    errors: list[str] = field(default_factory=list)
    """One message per malformed call (given back to the model as that call's result)."""
    content: str = ""
    """The text with the tool-call blocks removed."""

    @property
    def attempted(self) -> bool:
        return bool(self.calls or self.errors)


Parser = Callable[[str], ParseResult]
_PARSERS: dict[str, Parser] = {}


def register_parser(name: str, fn: Parser, *, override: bool = False) -> Parser:
    """Register a parser function under `name` (a taken name needs override=True)."""
    old = _PARSERS.get(name)
    if old is not None and old is not fn and not override:
        raise ConfigError(f"tool-call parser {name!r} is already registered; pass override=True to replace it")
    _PARSERS[name] = fn
    return fn


def get_parser(name: str) -> Parser:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ConfigError(f"unknown tool-call parser {name!r}; registered: {sorted(_PARSERS)}") from None


def list_parsers() -> list[str]:
    return sorted(_PARSERS)


def _short(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[:n] + "..."


def _call_from_obj(obj: Any, args_keys: tuple[str, ...] = ("arguments",)) -> tuple[ToolCall | None, str | None]:
    """A ToolCall from a decoded {"name", "arguments"} object, or an error message."""
    if not isinstance(obj, dict):
        return None, f"tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, "tool call is missing a \"name\" string"
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError) as e:
            return None, f"arguments of {name!r} are a string that is not valid JSON ({e.__class__.__name__})"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None, f"arguments of {name!r} must be a JSON object, got {type(args).__name__}"
    return ToolCall(name=name, arguments=args), None


def _loads(s: str) -> tuple[Any, str | None]:
    try:
        return json.loads(s), None
    except json.JSONDecodeError as e:
        return None, f"malformed JSON in tool call: {e.msg} at position {e.pos}: {_short(s.strip())!r}"
    except RecursionError:
        return None, "malformed JSON in tool call: nested too deeply"


# ------------------------------------------------------------------ hermes

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParseResult:
    """`<tool_call>{json}</tool_call>` blocks; an unclosed last block is parsed too (length stops)."""
    res = ParseResult()
    pieces: list[str] = []
    last = 0
    for m in _HERMES.finditer(text):
        pieces.append(text[last:m.start()])
        last = m.end()
        body = m.group(1).strip()
        closed = m.group(0).endswith("</tool_call>")
        if not body:
            res.errors.append("empty <tool_call> block")
            continue
        obj, err = _loads(body)
        if err:
            res.errors.append(err if closed else err + " (the block was not closed with </tool_call>)")
            continue
        call, err = _call_from_obj(obj)
        if err:
            res.errors.append(err)
        else:
            res.calls.append(call)  # type: ignore[arg-type]
    pieces.append(text[last:])
    res.content = "".join(pieces).strip()
    return res


# ------------------------------------------------------------------ llama3_json

def parse_llama3_json(text: str) -> ParseResult:
    """Llama 3 style: the message is one or more JSON objects `{"name": ..., "parameters": {...}}`,
    separated by newlines or `;` (optionally after `<|python_tag|>`). Plain prose is not a call."""
    res = ParseResult()
    body = text.replace("<|python_tag|>", "").replace("<|eom_id|>", "").replace("<|eot_id|>", "").strip()
    if not body.startswith("{"):
        res.content = text.strip()
        return res
    decoder = json.JSONDecoder()
    i = 0
    while i < len(body):
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
        if i >= len(body):
            break
        if body[i] != "{":
            res.content = body[i:].strip()
            break
        try:
            obj, end = decoder.raw_decode(body, i)
        except json.JSONDecodeError as e:
            res.errors.append(f"malformed JSON in tool call: {e.msg}: {_short(body[i:])!r}")
            break
        except RecursionError:
            res.errors.append("malformed JSON in tool call: nested too deeply")
            break
        call, err = _call_from_obj(obj, ("parameters", "arguments"))
        if err:
            res.errors.append(err)
        else:
            res.calls.append(call)  # type: ignore[arg-type]
        i = end
    return res


# ------------------------------------------------------------------ qwen3_coder

_Q3C_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_Q3C_FUNC = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.DOTALL)
_Q3C_PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def _q3c_value(raw: str) -> Any:
    v = raw.strip("\n")
    try:
        return json.loads(v)  # numbers, booleans, lists, objects
    except (json.JSONDecodeError, RecursionError):
        return v  # plain strings are written raw


def parse_qwen3_coder(text: str) -> ParseResult:
    """Qwen3-Coder's XML-ish calls; parameter values are JSON when they parse, else raw strings."""
    res = ParseResult()
    pieces: list[str] = []
    last = 0
    for m in _Q3C_CALL.finditer(text):
        pieces.append(text[last:m.start()])
        last = m.end()
        fm = _Q3C_FUNC.search(m.group(1))
        if fm is None:
            res.errors.append("tool call has no <function=NAME> element")
            continue
        name = fm.group(1).strip()
        if not name:
            res.errors.append("tool call is missing a function name")
            continue
        args = {pm.group(1).strip(): _q3c_value(pm.group(2)) for pm in _Q3C_PARAM.finditer(fm.group(2))}
        res.calls.append(ToolCall(name=name, arguments=args))
    pieces.append(text[last:])
    res.content = "".join(pieces).strip()
    return res


register_parser("hermes", parse_hermes)
register_parser("llama3_json", parse_llama3_json)
register_parser("qwen3_coder", parse_qwen3_coder)
