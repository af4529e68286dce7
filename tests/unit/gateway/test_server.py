"""The gateway's HTTP side with the real OpenAI and Anthropic SDKs against a canned backend: answers, streams
(the same turn either way), per-session keys, closed sessions, malformed and oversized requests, and its
lifetime tied to the ServerManager's."""

from __future__ import annotations

import asyncio

import aiohttp
import anthropic
import openai
import pytest

from agentloop.gateway.config import GatewayConfig
from agentloop.gateway.messages import ChatRequest, Completion, GatewayError, ToolCall
from agentloop.gateway.server import Gateway, gateway_for
from agentloop.server_manager import ServerManager

CALL = ToolCall("call_abc", "calculator", '{"expression": "37 * 24 + 5"}')
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


class Canned:
    """A backend answering every request with one tool call (or text), recording what it got."""

    def __init__(self, content: str = "let me compute", calls: list[ToolCall] | None = None):
        self.content, self.calls = content, [CALL] if calls is None else calls
        self.requests: list[ChatRequest] = []
        self.entered = asyncio.Event()
        self.block: asyncio.Event | None = None

    async def complete(self, req: ChatRequest) -> Completion:
        self.requests.append(req)
        self.entered.set()
        if self.block is not None:
            await self.block.wait()
        return Completion(content=self.content, tool_calls=list(self.calls),
                          finish="tool_calls" if self.calls else "stop", prompt_tokens=12, completion_tokens=7,
                          id="chatcmpl-1" if req.api == "openai" else "msg_1")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_openai_sdk_answers_and_streams_the_same_turn():
    async def main():
        backend = Canned()
        async with Gateway() as gw:
            h = gw.open_session("3-1", backend)
            assert h.key == "3-1" and h.openai_base_url == f"{gw.url}/s/3-1/v1"
            async with openai.AsyncOpenAI(base_url=h.openai_base_url, api_key=h.api_key, max_retries=0) as client:
                msgs = [{"role": "user", "content": "What is 37 * 24 + 5?"}]
                plain = await client.chat.completions.create(model="any", messages=msgs, tools=TOOLS, temperature=0.3)
                stream = await client.chat.completions.create(model="any", messages=msgs, tools=TOOLS, stream=True,
                                                              stream_options={"include_usage": True})
                chunks = [c async for c in stream]
                models = await client.models.list()
        return plain, chunks, backend.requests, [m.id for m in models.data]

    plain, chunks, reqs, models = run(main())
    msg = plain.choices[0].message
    assert plain.choices[0].finish_reason == "tool_calls" and msg.content == "let me compute"
    assert [(t.id, t.function.name, t.function.arguments) for t in msg.tool_calls] == [(CALL.id, CALL.name, CALL.arguments)]
    assert plain.usage.prompt_tokens == 12 and plain.usage.completion_tokens == 7 and plain.model == "any"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert text == msg.content and calls[0].id == CALL.id and "".join(t.function.arguments or "" for t in calls) == CALL.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls" and chunks[-1].usage.total_tokens == 19
    assert [r.stream for r in reqs] == [False, True] and reqs[0].sampling == {"temperature": 0.3}
    assert models == ["agentloop-policy"]


def test_anthropic_sdk_answers_and_streams_the_same_turn():
    async def main():
        backend = Canned()
        async with Gateway() as gw:
            h = gw.open_session("e", backend)
            async with anthropic.AsyncAnthropic(base_url=h.anthropic_base_url, api_key=h.api_key, max_retries=0) as client:
                kw = dict(model="any", max_tokens=64, system="S", messages=[{"role": "user", "content": "Q"}],
                          tools=[{"name": "calculator", "input_schema": {"type": "object"}}])
                plain = await client.messages.create(**kw)
                async with client.messages.stream(**kw) as stream:
                    final = await stream.get_final_message()
        return plain, final, backend.requests

    plain, final, reqs = run(main())
    for m in (plain, final):
        assert m.stop_reason == "tool_use" and m.usage.output_tokens == 7
        assert [b.type for b in m.content] == ["text", "tool_use"] and m.content[0].text == "let me compute"
        assert (m.content[1].id, m.content[1].name, m.content[1].input) == (CALL.id, CALL.name, {"expression": "37 * 24 + 5"})
    assert reqs[0].messages[0].role == "system" and reqs[0].tools[0]["function"]["name"] == "calculator"


def test_keys_sessions_and_bad_requests_are_refused_in_the_apis_shape():
    async def main():
        backend = Canned()
        async with Gateway(GatewayConfig(max_request_mb=0.01)) as gw:
            h = gw.open_session("e", backend)
            out = {}
            async with openai.AsyncOpenAI(base_url=h.openai_base_url, api_key="wrong", max_retries=0) as bad:
                with pytest.raises(openai.AuthenticationError) as e:
                    await bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
                out["401"] = e.value.message
            async with openai.AsyncOpenAI(base_url=h.openai_base_url, api_key=h.api_key, max_retries=0) as client:
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=3)
                out["400"] = e.value.body
            async with aiohttp.ClientSession(headers={"x-api-key": h.api_key}) as http:
                async with http.post(f"{h.anthropic_base_url}/v1/messages", data=b"{not json") as r:
                    out["not json"] = (r.status, await r.json())
                async with http.post(f"{h.openai_base_url}/chat/completions", json={"messages": ["x" * 20000]}) as r:
                    out["413"] = (r.status, await r.json())
            gw.close_session(h.key)
            async with openai.AsyncOpenAI(base_url=h.openai_base_url, api_key=h.api_key, max_retries=0) as client:
                with pytest.raises(openai.NotFoundError) as e:
                    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
                out["404"] = e.value.message
            return out, gw.gauges(), backend.requests

    out, gauges, reqs = run(main())
    assert "wrong or missing API key" in out["401"] and reqs == []
    assert out["400"]["param"] == "n" and "one choice per request" in out["400"]["message"]
    assert out["not json"][0] == 400 and out["not json"][1]["type"] == "error" and "not JSON" in out["not json"][1]["error"]["message"]
    assert out["413"][0] == 413 and "max_request_mb" in out["413"][1]["error"]["message"]
    assert "no open session 'e'" in out["404"]
    assert gauges["gateway/client_errors"] == 5 and gauges["gateway/open_sessions"] == 0


def test_closing_a_session_cancels_its_running_request():
    async def main():
        backend = Canned()
        backend.block = asyncio.Event()
        async with Gateway() as gw:
            h = gw.open_session("e", backend)
            async with openai.AsyncOpenAI(base_url=h.openai_base_url, api_key=h.api_key, max_retries=0) as client:
                call = asyncio.create_task(client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}]))
                await backend.entered.wait()
                gw.close_session(h.key)
                with pytest.raises(openai.APIStatusError) as e:
                    await call
        return e.value

    err = run(main())
    assert err.status_code == 503 and "session closed" in err.message


def test_backend_refusals_and_failures_reach_the_harness():
    class Refusing(Canned):
        async def complete(self, req):
            if req.messages[-1].content == "long":
                raise GatewayError(400, "the conversation is 9000 tokens", code="context_length_exceeded")
            raise RuntimeError("generation exploded")

    async def main():
        async with Gateway() as gw:
            h = gw.open_session("e", Refusing())
            async with openai.AsyncOpenAI(base_url=h.openai_base_url, api_key=h.api_key, max_retries=0) as client:
                with pytest.raises(openai.BadRequestError) as a:
                    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "long"}])
                with pytest.raises(openai.InternalServerError) as b:
                    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        return a.value, b.value

    a, b = run(main())
    assert a.code == "context_length_exceeded" and b.status_code == 500 and "RuntimeError: generation exploded" in b.message


def test_the_gateway_of_a_server_manager_lives_and_closes_with_it():
    async def main():
        sm = ServerManager(["http://127.0.0.1:9"])
        await sm.start()
        gw = await gateway_for(sm, GatewayConfig())
        assert await gateway_for(sm, GatewayConfig()) is gw
        h = gw.open_session("e", Canned())
        await sm.close()
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.ClientConnectionError):
                await http.get(f"{h.openai_base_url}/models")
        return gw

    gw = run(main())
    assert gw.open_sessions == 0


RESPONSES_TOOLS = [{"type": "function", "name": "calculator", "description": "math", "strict": True,
                    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                   "required": ["expression"], "additionalProperties": False}}]


def test_responses_api_answers_and_streams_the_same_turn_through_the_openai_sdk():
    async def main():
        backend = Canned()
        async with Gateway() as gw:
            h = gw.open_session("e", backend)
            async with openai.AsyncOpenAI(base_url=h.openai_base_url, api_key=h.api_key, max_retries=0) as client:
                kw = dict(model="m", instructions="Be brief.", tools=RESPONSES_TOOLS, max_output_tokens=64,
                          input=[{"role": "user", "content": "What is 37 * 24 + 5?"}])
                plain = await client.responses.create(**kw)
                events = [ev async for ev in await client.responses.create(**kw, stream=True)]
                # the harness sends the output items back with the call's output: one assistant turn, one tool message
                follow = kw["input"] + [item.model_dump(exclude_none=True) for item in plain.output] + [
                    {"type": "function_call_output", "call_id": plain.output[-1].call_id, "output": "893"}]
                await client.responses.create(**{**kw, "input": follow})
        return plain, events, backend.requests

    plain, events, reqs = run(main())
    assert [o.type for o in plain.output] == ["message", "function_call"] and plain.status == "completed"
    assert plain.output[0].content[0].text == "let me compute" and plain.output_text == "let me compute"
    call = plain.output[1]
    assert (call.call_id, call.name, call.arguments) == (CALL.id, CALL.name, CALL.arguments)
    assert plain.usage.input_tokens == 12 and plain.usage.output_tokens == 7
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert [o.model_dump() for o in done.output] == [o.model_dump() for o in plain.output]
    first, _, third = reqs
    assert first.api == "responses" and [m.role for m in first.messages] == ["system", "user"]
    assert first.tools == [{"type": "function", "function": {"name": "calculator", "description": "math",
                                                             "parameters": RESPONSES_TOOLS[0]["parameters"]}}]
    assert first.max_tokens == 64
    # the assistant message and its function call came back as the one turn the session answered
    assert [m.role for m in third.messages] == ["system", "user", "assistant", "tool"]
    assert third.messages[2].key() == Completion(content="let me compute", tool_calls=[CALL], finish="tool_calls",
                                                 prompt_tokens=0, completion_tokens=0, id="x").message().key()
    assert third.messages[3].tool_call_id == CALL.id and third.messages[3].content == "893"


def test_unknown_routes_and_errors_answer_json_without_inviting_retries():
    async def main():
        class Failing(Canned):
            async def complete(self, req):
                raise RuntimeError("generation exploded")

        async with Gateway() as gw:
            h = gw.open_session("e", Failing())
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {h.api_key}"}) as http:
                async with http.post(f"{h.openai_base_url}/completions", json={"prompt": "x"}) as r:
                    unknown = (r.status, await r.json(), r.headers.get("x-should-retry"))
            async with openai.AsyncOpenAI(base_url=h.openai_base_url, api_key=h.api_key, max_retries=2) as client:
                with pytest.raises(openai.InternalServerError) as e:
                    await client.responses.create(model="m", input="x")
            return unknown, e.value, gw.gauges()

    (status, body, retry), err, gauges = run(main())
    assert status == 404 and retry == "false" and body["error"]["code"] == "unknown_route"
    assert "POST /s/e/v1/completions" in body["error"]["message"] and "POST /v1/responses" in body["error"]["message"]
    assert err.response.headers["x-should-retry"] == "false"
    assert gauges["gateway/requests"] == 1  # the SDK did not retry it (max_retries=2)
