"""smolagents' ToolCallingAgent on the calculator task: `agent.command="ENV/bin/python
examples/harnesses/smolagents_tool_calling.py"`. smolagents uses its own system prompt (the task's is not
passed); it ends with its final_answer tool."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _calc import calculate, task
from smolagents import OpenAIServerModel, ToolCallingAgent, tool


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: the arithmetic expression, e.g. "37 * 24 + 5".
    """
    return calculate(expression)


def main() -> None:
    _, user = task(sys.stdin.read())
    model = OpenAIServerModel(model_id="policy", api_base=os.environ["OPENAI_BASE_URL"],
                              api_key=os.environ["OPENAI_API_KEY"], client_kwargs={"max_retries": 0})
    agent = ToolCallingAgent(tools=[calculator], model=model, max_steps=3, verbosity_level=0)
    agent.run(user)


if __name__ == "__main__":
    main()
