"""The calculator tool the harnesses offer (no agentloop import: a harness env has its own packages)."""

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.Mod: operator.mod, ast.FloorDiv: operator.floordiv, ast.USub: operator.neg,
        ast.UAdd: operator.pos}


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers and + - * / ** % // are allowed")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or the error the model reads."""
    try:
        value = _eval(ast.parse(str(expression), mode="eval"))
    except Exception as e:  # noqa: BLE001 - the model reads the error
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def task(raw: str) -> tuple[str, str]:
    """(system prompt, user message) of the task agentloop sends on stdin."""
    import json

    sample = json.loads(raw)
    system = "\n".join(m["content"] for m in sample["messages"] if m["role"] == "system")
    user = "\n".join(m["content"] for m in sample["messages"] if m["role"] == "user")
    return system, user
