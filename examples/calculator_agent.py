"""An agent written on the OpenAI SDK: the built-in calculator task, trained with openai_agent_loop.

    agentloop rollout --loop openai_agent_loop agent.entry=examples/calculator_agent.py:run
    agentloop train --loop openai_agent_loop agent.entry=examples/calculator_agent.py:run

It offers the model the calculator tool, runs the calls it makes and sends the results back, for at
most three model turns (tool_agent_loop's tools.max_turns in the presets). It returns no reward, so the
data_source's reward scores its last assistant message.
"""

import json
import ssl

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from agentloop.tools.calculator import CalculatorTool, calculate, format_number

TOOLS = [CalculatorTool().schema]
SSL = ssl.create_default_context()  # once: a client of its own loads the CA bundle (~30 ms of CPU) per episode


def calculator(arguments: str) -> str:
    try:
        return format_number(calculate(json.loads(arguments)["expression"]))
    except Exception as e:  # the model wrote a bad call: it reads the error, as with tool_agent_loop
        return f"error: {e}"


async def run(sample, base_url, api_key):
    http = DefaultAsyncHttpxClient(verify=SSL)
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http) as client:
        messages = list(sample.messages)
        for _ in range(3):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(call.function.arguments)})
