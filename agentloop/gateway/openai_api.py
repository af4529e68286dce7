"""OpenAI Chat Completions, as the gateway speaks it.

    parse_request    POST /v1/chat/completions body -> ChatRequest (GatewayError 400 naming the field)
    completion_body  Completion -> the `chat.completion` JSON object
    stream_chunks    Completion -> `data: {chat.completion.chunk}` SSE events, then `data: [DONE]`
    error_body       GatewayError -> {"error": {message, type, param, code}}
    models_body      GET /v1/models

Streaming: the turn is generated whole, then sent as chunks (role, content in pieces, each tool call
with its arguments, the finish reason, the usage chunk when `stream_options.include_usage`); the
session records the same tokens either way.
Not supported (400): n != 1, non-text content parts, the legacy `function` role. Sampling knobs
(temperature, top_p, penalties, seed, logit_bias, ...) are read only to be compared with the policy's.
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

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "logit_bias")
"""Request fields that would change the sampling distribution: compared with the policy's, never applied."""

IGNORED_KEYS = ("logprobs", "top_logprobs", "response_format", "parallel_tool_calls", "reasoning_effort",
                "service_tier", "store", "metadata", "user", "modalities", "prediction", "audio",
                "web_search_options", "functions", "function_call")
"""Accepted but not honoured (logged once each)."""

_STREAM_PIECE = 32
"""Characters of content per streamed chunk."""


def _messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out: list[Message] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", where)
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"{where}.role must be system, developer, user, assistant or tool; got {role!r}",
                              f"{where}.role")
        content = text_of(m.get("content"), f"{where}.content")
        name = m.get("name") if isinstance(m.get("name"), str) and role in ("system", "user") else None
        if role == "assistant":
            out.append(Message("assistant", content, _tool_calls(m.get("tool_calls"), where)))
        elif role == "tool":
            tcid = m.get("tool_call_id")
            if not isinstance(tcid, str) or not tcid:
                raise bad_request(f"{where}.tool_call_id must name the call it answers", f"{where}.tool_call_id")
            out.append(Message("tool", content, tool_call_id=tcid))
        else:
            out.append(Message(role, content, name=name))
    return out


def _tool_calls(raw: Any, where: str) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad_request(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    calls = []
    for j, c in enumerate(raw):
        w = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(c.get("id"), str):
            raise bad_request(f"{w} must be {{id, type: function, function: {{name, arguments}}}}", w)
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(c["id"], fn["name"], args))
    return tuple(calls)


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list of function tools", "tools")
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}] must be {{type: function, function: {{name, description, parameters}}}}",
                              f"tools[{i}]")
    return raw


def _tool_choice(raw: Any) -> str:
    if raw is None:
        return "auto"
    if raw in ("auto", "none", "required"):
        return raw
    if isinstance(raw, dict) and isinstance(raw.get("function"), dict) and isinstance(raw["function"].get("name"), str):
        return raw["function"]["name"]
    raise bad_request(f"tool_choice must be auto, none, required or {{type: function, function: {{name}}}}; "
                      f"got {raw!r}", "tool_choice")


def _positive_int(body: dict[str, Any], *keys: str) -> int | None:
    for k in keys:
        v = body.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise bad_request(f"'{k}' must be a positive integer, got {v!r}", k)
        return v
    return None


def stop_list(raw: Any, key: str) -> list[str]:
    if raw is None:
        return []
    if isinstance(raw, str):
        return [raw] if raw else []
    if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
        return [s for s in raw if s]
    raise bad_request(f"'{key}' must be a string or a list of strings", key)


def parse_request(body: Any) -> ChatRequest:
    """A Chat Completions request body as a ChatRequest; GatewayError 400 naming what is wrong."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    n = body.get("n", 1)
    if n != 1:
        raise bad_request(f"n={n!r}: the gateway samples one choice per request (an episode is one trajectory)", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    return ChatRequest(
        api="openai",
        messages=_messages(body.get("messages")),
        tools=_tools(body.get("tools")),
        tool_choice=_tool_choice(body.get("tool_choice")),
        max_tokens=_positive_int(body, "max_completion_tokens", "max_tokens"),
        stop=stop_list(body.get("stop"), "stop"),
        stream=stream,
        include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
        model=str(body.get("model") or ""),
        sampling={k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None},
        ignored=[k for k in IGNORED_KEYS if body.get(k) not in (None, False, [], {})],
    )


def _message_json(c: Completion) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": c.content if c.content or not c.tool_calls else None}
    if c.tool_calls:
        msg["tool_calls"] = [{"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                             for t in c.tool_calls]
    return msg


def _usage(c: Completion) -> dict[str, int]:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens}


def completion_body(c: Completion, model: str, created: int) -> dict[str, Any]:
    return {"id": c.id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": _message_json(c), "finish_reason": c.finish, "logprobs": None}],
            "usage": _usage(c)}


def stream_chunks(c: Completion, model: str, created: int, include_usage: bool) -> list[bytes]:
    """The SSE events of one answer, `data: [DONE]` last."""
    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        body = {"id": c.id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
        return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

    out = [chunk({"role": "assistant", "content": ""})]
    for i in range(0, len(c.content), _STREAM_PIECE):
        out.append(chunk({"content": c.content[i:i + _STREAM_PIECE]}))
    for k, t in enumerate(c.tool_calls):
        out.append(chunk({"tool_calls": [{"index": k, "id": t.id, "type": "function",
                                          "function": {"name": t.name, "arguments": ""}}]}))
        out.append(chunk({"tool_calls": [{"index": k, "function": {"arguments": t.arguments}}]}))
    out.append(chunk({}, c.finish))
    if include_usage:
        body = {"id": c.id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
                "usage": _usage(c)}
        out.append(b"data: " + json.dumps(body).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def error_body(e: GatewayError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


def models_body(model: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "agentloop"}]}


__all__ = ["completion_body", "error_body", "models_body", "parse_request", "stop_list", "stream_chunks",
           "GatewayError"]
