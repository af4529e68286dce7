"""OpenAI Responses API (POST /v1/responses), as the gateway speaks it: the default model path of the OpenAI
Agents SDK, served from the same exact-token sessions as Chat Completions.

    parse_request    POST /v1/responses body -> ChatRequest (GatewayError 400 naming the field)
    response_body    Completion -> the `response` JSON object
    stream_events    Completion -> the SSE events (`event: response.created` ... `response.completed`)

Input. `instructions` becomes the first system message; `input` is a string (one user message) or a list of
items: messages ({role, content}: a string or input_text / output_text parts; `developer` is `system`),
`function_call` ({call_id, name, arguments}) and `function_call_output` ({call_id, output}). An assistant
message and the function calls that follow it are one assistant turn (the canonical Message the session
answered), so a harness that sends the output items back extends its segment token for token. Tools are
function tools ({type: function, name, description, parameters, strict}); `strict` cannot be enforced on a
sampled policy and is dropped. The gateway keeps no state between requests: `previous_response_id` and
`conversation` are refused (400; send the whole input, `store` is ignored).

Output: a message item (output_text) when the turn has text, then one `function_call` item per call; status
`incomplete` (reason max_output_tokens) when the token cap cut the turn. Streaming sends the turn once it is
generated whole, as the API's events with sequence numbers, `response.completed` last.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from agentloop.gateway.messages import ChatRequest, Completion, Message, ToolCall, bad_request, text_of

SAMPLING_KEYS = ("temperature", "top_p", "top_logprobs")
"""Request fields that would change the sampling distribution: compared with the policy's, never applied."""

IGNORED_KEYS = ("store", "metadata", "parallel_tool_calls", "reasoning", "truncation", "include", "text", "user",
                "service_tier", "prompt_cache_key", "safety_identifier", "max_tool_calls", "background", "prompt",
                "stream_options", "extra_headers")
"""Accepted but not honoured (logged once each)."""

_PARTS = ("input_text", "output_text", "text")
_STREAM_PIECE = 32


def _items(raw: Any, instructions: Any) -> list[Message]:
    out: list[Message] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", "instructions")
        if instructions:
            out.append(Message("system", instructions))
    if isinstance(raw, str):
        return out + [Message("user", raw)]
    if not isinstance(raw, list) or not raw:
        raise bad_request("'input' must be a string or a non-empty list of items", "input")
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = "system" if role == "developer" else role
            if role not in ("system", "user", "assistant"):
                raise bad_request(f"{where}.role must be system, developer, user or assistant; got {role!r}",
                                  f"{where}.role")
            out.append(Message(role, text_of(item.get("content"), f"{where}.content", part_types=_PARTS)))
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
                raise bad_request(f"{where} must be {{type: function_call, call_id, name, arguments}}", where)
            if not isinstance(args, str):
                args = json.dumps(args, ensure_ascii=False)
            call = ToolCall(call_id, name, args)
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":  # the calls of the turn whose text came first
                out[-1] = Message("assistant", last.content, last.tool_calls + (call,))
            else:
                out.append(Message("assistant", "", (call,)))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{where}.call_id must name the call it answers", f"{where}.call_id")
            out.append(Message("tool", text_of(item.get("output"), f"{where}.output", part_types=_PARTS),
                               tool_call_id=call_id))
        else:
            raise bad_request(f"{where} has type {kind!r}; the gateway serves message, function_call and "
                              "function_call_output items", f"{where}.type")
    return out


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str) \
                or not t["name"]:
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise bad_request(f"tools[{i}] must be {{type: function, name, description, parameters}} (got type "
                              f"{kind!r}: hosted tools are not served)", f"tools[{i}]")
        fn = {"name": t["name"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        fn["parameters"] = t.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any) -> str:
    if raw is None:
        return "auto"
    if raw in ("auto", "none", "required"):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return raw["name"]
    raise bad_request(f"tool_choice must be auto, none, required or {{type: function, name}}; got {raw!r}",
                      "tool_choice")


def parse_request(body: Any) -> ChatRequest:
    """A Responses request body as a ChatRequest; GatewayError 400 naming what is wrong."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for k in ("previous_response_id", "conversation"):
        if body.get(k) is not None:
            raise bad_request(f"'{k}' is not supported: the gateway keeps no responses; send the whole "
                              "conversation as 'input'", k)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    cap = body.get("max_output_tokens")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise bad_request(f"'max_output_tokens' must be a positive integer, got {cap!r}", "max_output_tokens")
    return ChatRequest(
        api="responses",
        messages=_items(body.get("input"), body.get("instructions")),
        tools=_tools(body.get("tools")),
        tool_choice=_tool_choice(body.get("tool_choice")),
        max_tokens=cap,
        stream=stream,
        model=str(body.get("model") or ""),
        sampling={k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None},
        ignored=[k for k in IGNORED_KEYS if body.get(k) not in (None, False, [], {})],
    )


def _output(c: Completion) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if c.content or not c.tool_calls:
        items.append({"type": "message", "id": "msg_" + c.id.removeprefix("resp_"), "status": "completed",
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": c.content, "annotations": [], "logprobs": []}]})
    for t in c.tool_calls:
        items.append({"type": "function_call", "id": "fc_" + t.id.removeprefix("call_"), "call_id": t.id,
                      "name": t.name, "arguments": t.arguments, "status": "completed"})
    return items


def response_body(c: Completion, model: str, created: int | None = None, *,
                  output: list[dict[str, Any]] | None = None, status: str | None = None) -> dict[str, Any]:
    done = c.finish != "length"
    return {
        "id": c.id, "object": "response", "created_at": created if created is not None else int(time.time()),
        "status": status or ("completed" if done else "incomplete"),
        "incomplete_details": None if done or status == "in_progress" else {"reason": "max_output_tokens"},
        "error": None, "model": model, "output": _output(c) if output is None else output,
        "instructions": None, "metadata": {}, "parallel_tool_calls": True, "temperature": None, "top_p": None,
        "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "usage": None if status == "in_progress" else {
            "input_tokens": c.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": c.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": c.prompt_tokens + c.completion_tokens},
    }


def stream_events(c: Completion, model: str, created: int) -> list[bytes]:
    """The SSE events of one answer, as the Responses API streams them."""
    seq = iter(range(1 << 30))
    out: list[bytes] = []

    def ev(kind: str, **fields: Any) -> None:
        body = {"type": kind, "sequence_number": next(seq), **fields}
        out.append(f"event: {kind}\ndata: ".encode() + json.dumps(body, ensure_ascii=False).encode() + b"\n\n")

    start = response_body(c, model, created, output=[], status="in_progress")
    ev("response.created", response=start)
    ev("response.in_progress", response=start)
    items = _output(c)
    for i, item in enumerate(items):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            ev("response.output_item.added", output_index=i, item={**item, "status": "in_progress", "content": []})
            empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            ev("response.content_part.added", item_id=item["id"], output_index=i, content_index=0, part=empty)
            for k in range(0, len(text), _STREAM_PIECE):
                ev("response.output_text.delta", item_id=item["id"], output_index=i, content_index=0,
                   delta=text[k:k + _STREAM_PIECE], logprobs=[])
            ev("response.output_text.done", item_id=item["id"], output_index=i, content_index=0, text=text,
               logprobs=[])
            ev("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
               part=item["content"][0])
        else:
            ev("response.output_item.added", output_index=i,
               item={**item, "arguments": "", "status": "in_progress"})
            ev("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
               delta=item["arguments"])
            ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
               arguments=item["arguments"], name=item["name"])
        ev("response.output_item.done", output_index=i, item=item)
    ev("response.completed", response=response_body(c, model, created, output=items))
    return out


def new_id() -> str:
    return "resp_" + uuid.uuid4().hex[:24]


__all__ = ["parse_request", "response_body", "stream_events"]
