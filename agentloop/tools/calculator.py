"""The built-in `calculator` tool: arithmetic through an AST walker (never eval).

Allowed: int/float literals, + - * / // % **, unary + -, parentheses, the constants pi/e/tau, and
sqrt, log (1 or 2 args), log2, log10, exp, sin, cos, tan, asin, acos, atan, abs, round, floor, ceil,
factorial, min, max. Bounds: exponents up to 10_000 (integer base) or results past 1e300 are
refused, factorial up to 1000, and expressions of at most 500 characters / 200 nodes.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from agentloop.tools.base import BaseTool, ToolResponse
from agentloop.tools.registry import register_tool

MAX_CHARS = 500
MAX_NODES = 200
MAX_EXPONENT = 10_000
MAX_MAGNITUDE = 1e300
MAX_INT_DIGITS = 4000


class CalcError(ValueError):
    """The expression is not allowed or cannot be evaluated."""


def _factorial(x: Any) -> int:
    if not (isinstance(x, int) or (isinstance(x, float) and x.is_integer())) or x < 0 or x > 1000:
        raise CalcError("factorial takes an integer from 0 to 1000")
    return math.factorial(int(x))


_FUNCS = {
    "sqrt": math.sqrt, "log": math.log, "log2": math.log2, "log10": math.log10, "exp": math.exp,
    "sin": math.sin, "cos": math.cos, "tan": math.tan, "asin": math.asin, "acos": math.acos, "atan": math.atan,
    "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil, "factorial": _factorial,
    "min": min, "max": max,
}
_CONSTS = {"pi": math.pi, "e": math.e, "tau": math.tau}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _check(x: Any) -> Any:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise CalcError(f"result is not a number: {x!r}")
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        raise CalcError("result is not finite")
    if isinstance(x, int) and x.bit_length() > MAX_INT_DIGITS * 3.33:
        raise CalcError("result is too large")
    if isinstance(x, float) and abs(x) > MAX_MAGNITUDE:
        raise CalcError("result is too large")
    return x


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalcError(f"only numbers are allowed, got {node.value!r}")
        return _check(node.value)
    if isinstance(node, ast.Name):
        if node.id in _CONSTS:
            return _CONSTS[node.id]
        raise CalcError(f"unknown name {node.id!r}")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > MAX_EXPONENT:
                raise CalcError(f"exponent {right} is too large (limit {MAX_EXPONENT})")
            if isinstance(left, int) and isinstance(right, int) and right > 0 and \
                    left.bit_length() * right > MAX_INT_DIGITS * 3.33:
                raise CalcError("result is too large")
            if isinstance(left, float) or isinstance(right, float):
                left, right = float(left), float(right)
        try:
            result = _BINOPS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except OverflowError:
            raise CalcError("result is too large") from None
        if isinstance(result, complex):
            raise CalcError("result is complex")
        return _check(result)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        fn = _FUNCS.get(node.func.id)
        if fn is None:
            raise CalcError(f"unknown function {node.func.id!r}; allowed: {sorted(_FUNCS)}")
        args = [_eval(a) for a in node.args]
        try:
            return _check(fn(*args))
        except (TypeError, ValueError, OverflowError) as e:
            if isinstance(e, CalcError):
                raise
            raise CalcError(f"{node.func.id}: {e}") from None
    raise CalcError(f"{type(node).__name__} is not allowed")


def calculate(expression: str) -> int | float:
    """Evaluate an arithmetic expression safely; raises CalcError with a readable message."""
    if len(expression) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    expr = expression.replace("^", "**").strip()
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise CalcError(f"syntax error: {e.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"expression has more than {MAX_NODES} parts")
    return _eval(tree)


def format_number(x: int | float) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e16:
        return str(int(x))
    return repr(x) if isinstance(x, float) else str(x)


@register_tool("calculator")
class CalculatorTool(BaseTool):
    """Evaluates one arithmetic expression."""

    name = "calculator"
    idempotent = True  # a pure function of its arguments: a call cut by a kill is simply run again
    description = ("Evaluate an arithmetic expression: numbers, + - * / // % ** (or ^), parentheses, "
                   "pi, e, and sqrt, log, exp, sin, cos, tan, abs, round, floor, ceil, factorial, min, max.")
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "For example: (3 + 4) * sqrt(2)"}},
        "required": ["expression"],
        "additionalProperties": False,
    }

    async def execute(self, instance: Any, arguments: dict[str, Any]) -> ToolResponse:
        try:
            return ToolResponse(text=format_number(calculate(arguments["expression"])))
        except CalcError as e:
            return ToolResponse(text=f"error: {e}", error=str(e))
