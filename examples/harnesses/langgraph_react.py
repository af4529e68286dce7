"""LangGraph's prebuilt ReAct agent on the calculator task: `agent.command="ENV/bin/python
examples/harnesses/langgraph_react.py"`."""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")  # create_react_agent's deprecation notice

from _calc import calculate, task  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.errors import GraphRecursionError  # noqa: E402
from langgraph.prebuilt import create_react_agent  # noqa: E402


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result."""
    return calculate(expression)


def main() -> None:
    system, user = task(sys.stdin.read())
    llm = ChatOpenAI(model="policy", max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
    agent = create_react_agent(llm, [calculator], prompt=system)
    try:
        agent.invoke({"messages": [("user", user)]}, {"recursion_limit": 6})
    except GraphRecursionError:  # out of steps: the data_source's reward scores the last answer
        pass


if __name__ == "__main__":
    main()
