"""The OpenAI Agents SDK as a long-lived harness worker (`agent.workers=N agent.command="ENV/bin/python
examples/harnesses/agents_sdk_worker.py"`): the SDK is imported once, and each episode agentloop sends on stdin
runs as a task of this process against its own gateway session; its result goes on AGENTLOOP_RESULT_FD.
The protocol is in agentloop/loops/agent_workers.py (and the README's "Bring your own agent")."""

import asyncio
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _calc import calculate
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
RESULTS = os.fdopen(int(os.environ["AGENTLOOP_RESULT_FD"]), "w")
os.set_inheritable(RESULTS.fileno(), False)


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result."""
    return calculate(expression)


async def episode(msg: dict) -> None:
    messages = msg["task"]["messages"]
    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    user = "\n".join(m["content"] for m in messages if m["role"] == "user")
    out: dict = {"id": msg["id"], "result": None}
    try:
        async with AsyncOpenAI(base_url=msg["openai_base_url"], api_key=msg["api_key"], max_retries=0) as client:
            if os.environ.get("AGENT_API", "responses") == "chat":
                model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
            else:
                model = OpenAIResponsesModel(model="policy", openai_client=client)
            agent = Agent(name="calculator", instructions=system, tools=[calculator], model=model)
            try:
                await Runner.run(agent, user, max_turns=3)
            except MaxTurnsExceeded:  # out of turns: the data_source's reward scores the last answer
                pass
    except asyncio.CancelledError:
        return  # agentloop cancelled it (its deadline passed): no answer is expected
    except Exception as e:  # noqa: BLE001 - the episode's failure, reported to agentloop
        out = {"id": msg["id"], "error": f"{type(e).__name__}: {e}"}
    RESULTS.write(json.dumps(out) + "\n")
    RESULTS.flush()


async def main() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    running: dict[str, asyncio.Task] = {}
    while line := await reader.readline():
        msg = json.loads(line)
        if msg["type"] == "episode":
            task = running[msg["id"]] = asyncio.create_task(episode(msg))
            task.add_done_callback(lambda _, i=msg["id"]: running.pop(i, None))
        elif msg["type"] == "cancel" and msg["id"] in running:
            running[msg["id"]].cancel()
    for task in running.values():  # stdin closed: agentloop is done with this worker
        task.cancel()


if __name__ == "__main__":
    asyncio.run(main())
