"""Agents for the gateway's integration tests (agent.entry=tests/integration/gateway_agents.py:NAME).

Each does the calculator task the way examples/calculator_agent.py does (at most three model turns, the
calculator run on every call), through a different route:

    streaming_agent   the OpenAI SDK with stream=True, the answer assembled from the chunks
    anthropic_agent   the Anthropic Messages route with a plain aiohttp client (tool_use / tool_result blocks)
    compaction_agent  the OpenAI SDK; after the first tool result it "compacts": the next request is a fresh
                      system + user history summarising the work so far (not an extension: a second segment)
    long_agent        one SDK request for `max_tokens` tokens (with sampling.ignore_eos, a long generation)
"""

from __future__ import annotations

import json
import ssl

import aiohttp
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from agentloop.tools.calculator import CalculatorTool, calculate, format_number

TOOLS = [CalculatorTool().schema]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
SSL = ssl.create_default_context()


def calculator(arguments: str | dict) -> str:
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
        return format_number(calculate(args["expression"]))
    except Exception as e:  # noqa: BLE001 - the model reads the error
        return f"error: {e}"


def _client(base_url: str, api_key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=DefaultAsyncHttpxClient(verify=SSL))


async def streaming_agent(sample, base_url, api_key):
    async with _client(base_url, api_key) as client:
        messages = list(sample.messages)
        for _ in range(3):
            stream = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True,
                                                          stream_options={"include_usage": True})
            content, calls, finish, usage = "", {}, None, None
            async for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    for tc in choice.delta.tool_calls or []:
                        call = calls.setdefault(tc.index, {"id": "", "type": "function",
                                                           "function": {"name": "", "arguments": ""}})
                        call["id"] = tc.id or call["id"]
                        if tc.function is not None:
                            call["function"]["name"] += tc.function.name or ""
                            call["function"]["arguments"] += tc.function.arguments or ""
                    finish = choice.finish_reason or finish
            assert finish in ("stop", "length", "tool_calls") and usage is not None and usage.completion_tokens > 0
            message = {"role": "assistant", "content": content or None}
            if calls:
                message["tool_calls"] = [calls[k] for k in sorted(calls)]
            messages.append(message)
            if not calls:
                break
            for call in message["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": calculator(call["function"]["arguments"])})


async def anthropic_agent(sample, base_url, api_key):
    base = base_url[:-len("/v1")]  # ANTHROPIC_BASE_URL: the SDKs add /v1/messages themselves
    system = "".join(m["content"] for m in sample.messages if m["role"] == "system")
    messages = [{"role": m["role"], "content": m["content"]} for m in sample.messages if m["role"] != "system"]
    async with aiohttp.ClientSession(headers={"x-api-key": api_key, "anthropic-version": "2023-06-01"}) as http:
        for _ in range(3):
            body = {"model": "policy", "max_tokens": 1024, "system": system, "messages": messages,
                    "tools": ANTHROPIC_TOOLS}
            async with http.post(f"{base}/v1/messages", json=body, timeout=aiohttp.ClientTimeout(total=300)) as r:
                answer = await r.json()
                assert r.status == 200, answer
            assert answer["type"] == "message" and answer["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
            messages.append({"role": "assistant", "content": answer["content"]})
            uses = [b for b in answer["content"] if b["type"] == "tool_use"]
            if not uses:
                break
            assert answer["stop_reason"] == "tool_use"
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b["id"], "content": calculator(b["input"])} for b in uses]})


async def compaction_agent(sample, base_url, api_key):
    """Turn 1 as usual; if it called the calculator, the history is then compacted into a new user message
    holding the result, and the model answers from that (a second segment)."""
    async with _client(base_url, api_key) as client:
        messages = list(sample.messages)
        first = (await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)).choices[0].message
        if not first.tool_calls:
            return None
        result = calculator(first.tool_calls[0].function.arguments)
        question = sample.messages[-1]["content"]
        compacted = [sample.messages[0], {"role": "user", "content": f"{question}\nThe calculator says: {result}"}]
        await client.chat.completions.create(model="policy", messages=compacted, tools=TOOLS)
        return {"reward": 1.0, "compacted": True}


async def long_agent(sample, base_url, api_key):
    async with _client(base_url, api_key) as client:
        reply = await client.chat.completions.create(model="policy", messages=list(sample.messages), max_tokens=600)
        return float(reply.usage.completion_tokens)
