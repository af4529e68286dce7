"""The OpenAI Agents SDK on the calculator task, as its users run it: `agent.command="ENV/bin/python
examples/harnesses/agents_sdk.py"` (Responses API, the SDK's default) or with AGENT_API=chat (chat completions).
Tracing is off: by default the SDK posts every run (its key and conversation) to its vendor."""

import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _calc import calculate, task
from agents import (
    Agent,
    MaxTurnsExceeded,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

set_tracing_disabled(True)


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result."""
    return calculate(expression)


async def main() -> None:
    system, user = task(sys.stdin.read())
    client = AsyncOpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY: the episode's gateway session
    if os.environ.get("AGENT_API", "responses") == "chat":
        model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    else:
        model = OpenAIResponsesModel(model="policy", openai_client=client)
    agent = Agent(name="calculator", instructions=system, tools=[calculator], model=model)
    try:
        await Runner.run(agent, user, max_turns=3)
    except MaxTurnsExceeded:  # out of turns: the data_source's reward scores the last answer
        pass


if __name__ == "__main__":
    asyncio.run(main())
