"""Anthropic Messages, as the gateway speaks it.

    parse_request    POST /v1/messages body -> ChatRequest (GatewayError 400 naming the field)
    message_body     Completion -> the `message` JSON object (text and tool_use blocks)
    stream_events    Completion -> message_start, content_block_start/delta/stop per block,
                     message_delta (stop_reason, usage), message_stop
    error_body       GatewayError -> {"type": "error", "error": {type, message}}

Mapping to the canonical messages (gateway/messages.py): `system` (a string or text blocks) is a first
system message; a user message's `tool_result` blocks become tool messages and its text blocks a user
message, in their order; an assistant message's text blocks are its content and its `tool_use`
blocks its tool calls. Tools ({name, description, input_schema}) are given to the chat template as
OpenAI function schemas. stop_reason: end_turn, max_tokens, tool_use, stop_sequence.
Not supported (400): image/document/thinking blocks, server tools. Streaming sends a whole generated
turn as events, like the OpenAI side.
"""

from __future__ import annotations

import json
from typing import Any

from agentloop.gateway.messages import (
    ChatRequest,
    Completion,
    GatewayError,
    Message,
    ToolCall,
    bad_request,
    text_of,
)
from agentloop.gateway.openai_api import stop_list

SAMPLING_KEYS = ("temperature", "top_p", "top_k")
IGNORED_KEYS = ("metadata", "thinking", "service_tier", "container", "mcp_servers")
_STREAM_PIECE = 32
_STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks", where)
    for i, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise bad_request(f"{where}[{i}] must be a content block with a type", f"{where}[{i}]")
    return content


def _user(content: Any, where: str) -> list[Message]:
    out: list[Message] = []
    text: list[str] = []

    def flush() -> None:
        if text:
            out.append(Message("user", "".join(text)))
            text.clear()

    for i, b in enumerate(_blocks(content, where)):
        w = f"{where}[{i}]"
        if b["type"] == "text":
            if not isinstance(b.get("text"), str):
                raise bad_request(f"{w}.text must be a string", w)
            text.append(b["text"])
        elif b["type"] == "tool_result":
            flush()
            tid = b.get("tool_use_id")
            if not isinstance(tid, str) or not tid:
                raise bad_request(f"{w}.tool_use_id must name the tool_use block it answers", w)
            out.append(Message("tool", text_of(b.get("content"), f"{w}.content"), tool_call_id=tid))
        else:
            raise bad_request(f"{w} has type {b['type']!r}; the gateway serves text and tool_result blocks in "
                              "user messages", w)
    flush()
    return out


def _assistant(content: Any, where: str) -> Message:
    text: list[str] = []
    calls: list[ToolCall] = []
    for i, b in enumerate(_blocks(content, where)):
        w = f"{where}[{i}]"
        if b["type"] == "text":
            if not isinstance(b.get("text"), str):
                raise bad_request(f"{w}.text must be a string", w)
            text.append(b["text"])
        elif b["type"] == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise bad_request(f"{w} must be {{type: tool_use, id, name, input}}", w)
            calls.append(ToolCall(b["id"], b["name"], json.dumps(b.get("input") or {}, ensure_ascii=False)))
        else:
            raise bad_request(f"{w} has type {b['type']!r}; the gateway serves text and tool_use blocks in "
                              "assistant messages", w)
    return Message("assistant", "".join(text), tuple(calls))


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list", "tools")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("type") not in (None, "custom"):
            raise bad_request(f"tools[{i}] must be a client tool {{name, description, input_schema}} (server tools "
                              "are not served)", f"tools[{i}]")
        fn: dict[str, Any] = {"name": t["name"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        fn["parameters"] = t.get("input_schema") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any) -> str:
    if raw is None:
        return "auto"
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(raw.get("name"), str):
        return raw["name"]
    raise bad_request(f"tool_choice must be {{type: auto|any|none|tool}}; got {raw!r}", "tool_choice")


def parse_request(body: Any) -> ChatRequest:
    """A Messages request body as a ChatRequest; GatewayError 400 naming what is wrong."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    mt = body.get("max_tokens")
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise bad_request(f"'max_tokens' is required and must be a positive integer, got {mt!r}", "max_tokens")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list", "messages")
    messages: list[Message] = []
    system = body.get("system")
    if system is not None:
        s = text_of(system, "system")
        if s:
            messages.append(Message("system", s))
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where} must be {{role: user|assistant, content}}", where)
        if m["role"] == "user":
            messages += _user(m.get("content"), f"{where}.content")
        else:
            messages.append(_assistant(m.get("content"), f"{where}.content"))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    return ChatRequest(
        api="anthropic", messages=messages, tools=_tools(body.get("tools")),
        tool_choice=_tool_choice(body.get("tool_choice")), max_tokens=mt,
        stop=stop_list(body.get("stop_sequences"), "stop_sequences"), stream=stream,
        model=str(body.get("model") or ""),
        sampling={k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None},
        ignored=[k for k in IGNORED_KEYS if body.get(k) not in (None, False, [], {})],
    )


def _content(c: Completion) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": c.content}] if c.content else []
    for t in c.tool_calls:
        value = t.arguments_value()
        blocks.append({"type": "tool_use", "id": t.id, "name": t.name,
                       "input": value if isinstance(value, dict) else {}})
    return blocks


def _stop_reason(c: Completion) -> str:
    return "stop_sequence" if c.stop_sequence is not None else _STOP_REASON[c.finish]


def message_body(c: Completion, model: str) -> dict[str, Any]:
    return {"id": c.id, "type": "message", "role": "assistant", "model": model, "content": _content(c),
            "stop_reason": _stop_reason(c), "stop_sequence": c.stop_sequence,
            "usage": {"input_tokens": c.prompt_tokens, "output_tokens": c.completion_tokens}}


def stream_events(c: Completion, model: str) -> list[bytes]:
    def event(kind: str, data: dict[str, Any]) -> bytes:
        return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **data}, ensure_ascii=False).encode() \
            + b"\n\n"

    start = {**message_body(c, model), "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": c.prompt_tokens, "output_tokens": 0}}
    out = [event("message_start", {"message": start})]
    for i, block in enumerate(_content(c)):
        if block["type"] == "text":
            out.append(event("content_block_start", {"index": i, "content_block": {"type": "text", "text": ""}}))
            for k in range(0, len(block["text"]), _STREAM_PIECE):
                out.append(event("content_block_delta", {"index": i, "delta": {
                    "type": "text_delta", "text": block["text"][k:k + _STREAM_PIECE]}}))
        else:
            out.append(event("content_block_start", {"index": i, "content_block": {**block, "input": {}}}))
            out.append(event("content_block_delta", {"index": i, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}))
        out.append(event("content_block_stop", {"index": i}))
    out.append(event("message_delta", {"delta": {"stop_reason": _stop_reason(c), "stop_sequence": c.stop_sequence},
                                       "usage": {"output_tokens": c.completion_tokens}}))
    out.append(event("message_stop", {}))
    return out


def error_body(e: GatewayError) -> dict[str, Any]:
    kind = {"invalid_request_error": "invalid_request_error", "authentication_error": "authentication_error",
            "not_found_error": "not_found_error", "overloaded_error": "overloaded_error"}.get(e.kind, "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


__all__ = ["error_body", "message_body", "parse_request", "stream_events"]
