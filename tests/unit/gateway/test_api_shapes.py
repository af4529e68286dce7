"""The two APIs' request parsing and answer shapes (pure functions, no server)."""

from __future__ import annotations

import json

import pytest

from agentloop.gateway import anthropic_api, openai_api
from agentloop.gateway.messages import Completion, GatewayError, Message, ToolCall

CALL = ToolCall("call_1", "calculator", '{"expression": "1 + 2"}')


def completion(content: str = "", calls: list[ToolCall] | None = None, finish: str = "stop", **kw) -> Completion:
    return Completion(content=content, tool_calls=calls or [], finish=finish, prompt_tokens=10, completion_tokens=5,
                      id="x-1", **kw)


def test_openai_request_becomes_canonical_messages():
    req = openai_api.parse_request({
        "model": "m", "max_tokens": 9, "stop": "END", "stream": True, "stream_options": {"include_usage": True},
        "temperature": 0.2, "logprobs": True,
        "tools": [{"type": "function", "function": {"name": "calculator", "parameters": {}}}],
        "messages": [
            {"role": "developer", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression":"1 + 2"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"}]})
    assert req.messages == [Message("system", "S"), Message("user", "ab"),
                            Message("assistant", "", (ToolCall("call_1", "calculator", '{"expression":"1 + 2"}'),)),
                            Message("tool", "3", tool_call_id="call_1")]
    # arguments re-serialized by a harness (other spacing) still match the call the gateway answered
    assert req.messages[2].key() == Message("assistant", "", (CALL,)).key()
    assert (req.max_tokens, req.stop, req.stream, req.include_usage) == (9, ["END"], True, True)
    assert req.sampling == {"temperature": 0.2} and req.ignored == ["logprobs"]


@pytest.mark.parametrize("body,field", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search"}]}, "tools[0]"),
])
def test_openai_bad_requests_name_the_field(body, field):
    with pytest.raises(GatewayError) as e:
        openai_api.parse_request(body)
    assert e.value.status == 400 and e.value.param == field and field.split("[")[0] in e.value.message


def test_openai_answer_and_stream_carry_the_same_turn():
    c = completion("", [CALL], "tool_calls")
    body = openai_api.completion_body(c, "m", 1)
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": CALL.arguments}}]}
    assert body["choices"][0]["finish_reason"] == "tool_calls" and body["usage"]["total_tokens"] == 15
    text = completion("x" * 70, finish="length")
    events = openai_api.stream_chunks(text, "m", 1, include_usage=True)
    assert events[-1] == b"data: [DONE]\n\n" and all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"]) == "x" * 70
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 5


def test_anthropic_request_maps_blocks_to_canonical_messages():
    req = anthropic_api.parse_request({
        "model": "m", "max_tokens": 32, "system": [{"type": "text", "text": "S"}], "stop_sequences": ["END"],
        "top_k": 5, "tools": [{"name": "calculator", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"},
        "messages": [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": [{"type": "text", "text": "let me"},
                                              {"type": "tool_use", "id": "call_1", "name": "calculator",
                                               "input": {"expression": "1 + 2"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                          "content": [{"type": "text", "text": "3"}]},
                                         {"type": "text", "text": "go on"}]}]})
    assert req.messages == [Message("system", "S"), Message("user", "Q"),
                            Message("assistant", "let me", (ToolCall("call_1", "calculator", '{"expression": "1 + 2"}'),)),
                            Message("tool", "3", tool_call_id="call_1"), Message("user", "go on")]
    assert req.tools == [{"type": "function", "function": {"name": "calculator", "description": "d",
                                                            "parameters": {"type": "object"}}}]
    assert (req.max_tokens, req.stop, req.tool_choice, req.sampling) == (32, ["END"], "required", {"top_k": 5})


@pytest.mark.parametrize("body,field", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages[0]"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305",
                                                                                  "name": "web_search"}]}, "tools[0]"),
])
def test_anthropic_bad_requests_name_the_field(body, field):
    with pytest.raises(GatewayError) as e:
        anthropic_api.parse_request(body)
    assert e.value.status == 400 and e.value.param == field
    assert anthropic_api.error_body(e.value) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                            "message": e.value.message}}


def test_anthropic_answer_and_event_stream_carry_the_same_turn():
    c = completion("let me", [CALL], "tool_calls")
    body = anthropic_api.message_body(c, "m")
    assert body["content"] == [{"type": "text", "text": "let me"},
                               {"type": "tool_use", "id": "call_1", "name": "calculator", "input": {"expression": "1 + 2"}}]
    assert body["stop_reason"] == "tool_use" and body["usage"] == {"input_tokens": 10, "output_tokens": 5}
    events = anthropic_api.stream_events(c, "m")
    kinds = [e.split(b"\n")[0].decode() for e in events]
    assert kinds == ["event: message_start", "event: content_block_start", "event: content_block_delta",
                     "event: content_block_stop", "event: content_block_start", "event: content_block_delta",
                     "event: content_block_stop", "event: message_delta", "event: message_stop"]
    data = [json.loads(e.split(b"\ndata: ", 1)[1]) for e in events]
    assert json.loads(data[5]["delta"]["partial_json"]) == {"expression": "1 + 2"}
    assert data[7]["delta"]["stop_reason"] == "tool_use"
    stopped = anthropic_api.message_body(completion("abc", stop_sequence="END"), "m")
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")
