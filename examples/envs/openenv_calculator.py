"""An OpenEnv environment as OpenEnv's users write one (openenv-core's Environment, Action, Observation and
create_app; nothing from agentloop): the calculator task, served over OpenEnv's HTTP/WebSocket protocol.

    reset(seed)    a problem "What is 37 * 24 + 5?" (two operations on two-digit numbers, from `seed`)
    step(message)  the model's whole text: a hermes tool call <tool_call>{"name": "calculator", "arguments":
                   {"expression": "..."}}</tool_call> is evaluated and its result observed (not done); else the
                   number after the last `####` is the answer: done, reward 1.0 if right, else 0.0

Run it:  python examples/envs/openenv_calculator.py --port 8011   (MAX_CONCURRENT_ENVS, default 4096 sessions)
Train on it:  agentloop train --env openenv:http://127.0.0.1:8011 envs.openenv.observation_role=tool \
              envs.openenv.tools=[calculator] envs.openenv.system_prompt="..."   (docs/environments.md)
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import random
import re
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_ANSWER = re.compile(r"####[\s*$]*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class CalculatorAction(Action):
    message: str = Field(..., description="The assistant's whole turn")


class CalculatorObservation(Observation):
    text: str = Field(default="", description="The question, or the calculator's result")


def evaluate(expression: str) -> str:
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")

    try:
        value = ev(ast.parse(expression, mode="eval"))
    except SyntaxError as e:
        return f"error: syntax error: {e.msg}"
    except (ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6g}"


class CalculatorEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._answer = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None) -> CalculatorObservation:
        rng = random.Random(seed)
        a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(2, 99)
        form = rng.randint(0, 3)
        expr = [f"{a} * {b} + {c}", f"{a} * {b} - {c}", f"{a} + {b} * {c}", f"({a} + {b}) * {c}"][form]
        self._answer = [a * b + c, a * b - c, a + b * c, (a + b) * c][form]
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return CalculatorObservation(text=f"What is {expr}?", done=False, reward=None)

    def step(self, action: CalculatorAction) -> CalculatorObservation:  # type: ignore[override]
        self._state.step_count += 1
        call = _CALL.search(action.message)
        if call:
            try:
                req = json.loads(call.group(1))
                result = evaluate(str(req["arguments"]["expression"]))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                result = f"error: could not parse tool call: {type(e).__name__}: {e}"
            return CalculatorObservation(text=result, done=False, reward=0.0)
        found = _ANSWER.findall(action.message)
        right = bool(found) and float(found[-1].replace(",", "")) == self._answer
        return CalculatorObservation(text="", done=True, reward=1.0 if right else 0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(CalculatorEnvironment, CalculatorAction, CalculatorObservation, env_name="calculator",
                 max_concurrent_envs=int(os.environ.get("MAX_CONCURRENT_ENVS", "4096")))


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", ws_max_size=100 * 1024 * 1024)
