"""A verifiers environment as its users write one (verifiers 0.3.x: `import verifiers as vf`, a ToolEnv with a Python
tool, a Rubric; nothing from agentloop): the calculator task.

    agentloop train --env verifiers:examples/envs/verifiers_calculator.py          (docs/environments.md)
    agentloop rollout --env verifiers:examples/envs/verifiers_calculator.py:'{"num_eval_examples": 64}'

The tool's schema is written out as agentloop's calculator tool's (`tool_defs` below), so the project's tiny
warm-started model reads the prompt it was trained on; verifiers would otherwise derive one from the function
(openai-agents' function_schema: its titles and key order), a rendering that tiny model has never seen.
"""

import ast
import operator
import random
import re

import verifiers as vf
from datasets import Dataset

SYSTEM = ("You are a careful assistant. Use the calculator tool for arithmetic. "
          "Finish with the final answer on its own line as `#### <number>`.")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}
_ANSWER = re.compile(r"####[\s*$]*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)")


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers and + - * / are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    try:
        value = _eval(ast.parse(expression, mode="eval"))
    except SyntaxError as e:
        return f"error: syntax error: {e.msg}"
    except (ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def problems(n, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(2, 99)
        form = rng.randint(0, 3)
        expr = [f"{a} * {b} + {c}", f"{a} * {b} - {c}", f"{a} + {b} * {c}", f"({a} + {b}) * {c}"][form]
        value = [a * b + c, a * b - c, a + b * c, (a + b) * c][form]
        rows.append({"question": f"What is {expr}?", "answer": str(value)})
    return Dataset.from_list(rows)


def correct_answer(completion, answer) -> float:
    """1.0 when the number after the last `####` of the last assistant message is the answer."""
    text = completion[-1]["content"] if completion and isinstance(completion[-1], dict) else \
        getattr(completion[-1], "content", "") if completion else ""
    found = _ANSWER.findall(text or "")
    return 1.0 if found and float(found[-1].replace(",", "")) == float(answer) else 0.0


def load_environment(num_train_examples: int = 4096, num_eval_examples: int = 64, seed: int = 12345,
                     max_turns: int = 3, tools: bool = True) -> vf.Environment:
    if not tools:  # the same task without the tool: a SingleTurnEnv, the answer in the model's one turn
        return vf.SingleTurnEnv(dataset=problems(num_train_examples, seed),
                                eval_dataset=problems(num_eval_examples, seed + 1), system_prompt=SYSTEM,
                                rubric=vf.Rubric(funcs=[correct_answer]))
    env = vf.ToolEnv(
        dataset=problems(num_train_examples, seed),
        eval_dataset=problems(num_eval_examples, seed + 1),
        system_prompt=SYSTEM,
        tools=[calculator],
        max_turns=max_turns,
        rubric=vf.Rubric(funcs=[correct_answer]),
    )
    env.tool_defs = [vf.Tool(
        name="calculator",
        description="Evaluate an arithmetic expression: numbers, + - * / // % ** (or ^), parentheses, pi, e, and sqrt, "
                    "log, exp, sin, cos, tan, abs, round, floor, ceil, factorial, min, max.",
        parameters={"type": "object", "properties": {"expression": {"type": "string",
                                                                    "description": "For example: (3 + 4) * sqrt(2)"}},
                    "required": ["expression"], "additionalProperties": False})]
    return env
