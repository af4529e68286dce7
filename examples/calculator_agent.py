"""An agent written on the OpenAI SDK: the built-in calculator task, trained with openai_agent_loop.

    agentloop rollout --loop openai_agent_loop agent.entry=examples/calculator_agent.py:run
    agentloop train --loop openai_agent_loop agent.entry=examples/calculator_agent.py:run

It offers the model the calculator tool, runs the calls it makes and sends the results back, for at most
three model turns (tools.max_turns of tool_agent_loop in the presets), and returns no reward, so the
data_source's reward scores its last assistant message. The code below is the README's example.
"""

import json
import ssl

from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from agentloop.tools.calculator import CalculatorTool, calculate, format_number

TOOLS = [CalculatorTool().schema]
SSL = ssl.create_default_context()  # made once: a client making its own loads the CA bundle (~30 ms of CPU)

async def run(sample, base_url, api_key):
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=DefaultAsyncHttpxClient(verify=SSL)) as client:
        messages = list(sample.messages)
        for _ in range(3):
            message = (await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)).choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or []:
                try:
                    result = format_number(calculate(json.loads(call.function.arguments)["expression"]))
                except Exception as e:
                    result = f"error: {e}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            if not message.tool_calls:
                return None  # no reward given: the data_source's reward scores the last assistant message
