"""TinyZero's countdown reward, written here from its documented rules (registered as data_source `countdown`).

Under TinyZero's name we score exactly as TinyZero does (its `utils/reward_score/countdown.py`):

    text      PROMPT + response decoded with special tokens kept (TinyZero's reward manager; see
              `solution_view`): the rules below split on the prompt's own text
    answer    the text after the FIRST "Assistant:" (else after the first "<|im_start|>assistant"; neither:
              no answer), then only its LAST LINE, then the last `<answer>...</answer>` on that line
              (non-greedy, no newlines), stripped. An answer followed by a newline is not seen.
    numbers   every run of digits in the answer, as integers, must be the given numbers (each exactly
              once, any order): `= 24` at the end adds 24, `2.5` is 2 and 5
    value     only digits, + - * / ( ) . and whitespace allowed; evaluated with Python's arithmetic
              (`**` and `//` included, true division, floats); any error (syntax, division by zero)
              means no value
    score     no answer -> 0.0; wrong numbers, no value, a value not within 1e-5 of the target, or a
              value that cannot be compared (e.g. `()`) -> format_score (0.1); else score (1.0).
              So ANY extracted answer, even empty, earns the format score.

The expression is evaluated by walking its syntax tree with Python's own operators (never `eval`):
the same parser and the same arithmetic, so the same values. One deliberate difference: a power whose
result would exceed `MAX_POW_BITS` bits counts as an error (format score) instead of running for
minutes, which changes a score only if such a power cancels out exactly later in the expression.

Our lenient variant (whole response searched, `eq = target` accepted, exact fractions, malformed
answers 0) lives in `countdown.py` under `agentloop/countdown`.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import Any

from agentloop.rewards.scoring import solution_view

FORMAT_SCORE = 0.1
"""TinyZero's score of an extracted but wrong answer."""

MAX_POW_BITS = 100_000
"""An integer power larger than this many bits is treated as an evaluation error (see the docstring)."""

_ANSWER = re.compile(r"<answer>(.*?)</answer>")
_ALLOWED = re.compile(r"^[\d+\-*/().\s]+$")
_DIGITS = re.compile(r"\d+")
_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class _NoValue(Exception):
    """The expression has no value under TinyZero's rules (any error of the evaluation)."""


def extract_solution(solution_str: str) -> str | None:
    """The equation TinyZero's rules read from prompt + response, or None."""
    for marker in ("Assistant:", "<|im_start|>assistant"):
        if marker in solution_str:
            text = solution_str.split(marker, 1)[1]
            break
    else:
        return None
    last_line = text.split("\n")[-1]
    found = _ANSWER.findall(last_line)
    return found[-1].strip() if found else None


def validate_equation(equation: str, numbers: Any) -> bool:
    """Every digit run of the equation, as an int, is one of `numbers`, each used exactly once."""
    try:
        return sorted(int(n) for n in _DIGITS.findall(equation)) == sorted(numbers)
    except Exception:  # noqa: BLE001 - TinyZero: any failure is "not valid"
        return False


def _pow(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1:
        if b * math.log2(abs(a)) > MAX_POW_BITS:
            raise _NoValue("power too large")
    return operator.pow(a, b)


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        a, b = _value(node.left), _value(node.right)
        return _pow(a, b) if isinstance(node.op, ast.Pow) else _BIN[type(node.op)](a, b)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.Tuple):
        return tuple(_value(e) for e in node.elts)
    # A call such as `(1)(2)`: Python raises TypeError (an int is not callable); so do we.
    raise _NoValue(f"{type(node).__name__} has no value")


def evaluate_equation(equation: str) -> Any:
    """The expression's value under Python's arithmetic, or None for any error (as TinyZero's eval)."""
    if not _ALLOWED.match(equation):
        return None
    try:
        return _value(ast.parse(equation, mode="eval"))
    except Exception:  # noqa: BLE001 - TinyZero: any error of the evaluation is "no value"
        return None


def tinyzero_countdown_score(solution_str: str, ground_truth: Any, format_score: float = FORMAT_SCORE,
                             score: float = 1.0) -> float:
    """TinyZero's `countdown.compute_score` with its defaults."""
    target, numbers = ground_truth["target"], ground_truth["numbers"]
    equation = extract_solution(solution_str)
    if equation is None:
        return 0.0
    if not validate_equation(equation, numbers):
        return float(format_score)
    try:
        result = evaluate_equation(equation)
        if result is None:
            return float(format_score)
        return float(score) if abs(result - target) < 1e-5 else float(format_score)
    except Exception:  # noqa: BLE001 - TinyZero: a value that cannot be compared earns the format score
        return float(format_score)


@solution_view("prompt_response")
def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """TinyZero's countdown reward for data_source `countdown` (format score 0.1, score 1.0)."""
    if not isinstance(ground_truth, dict) or "target" not in ground_truth or "numbers" not in ground_truth:
        raise ValueError(f"countdown ground truth must be {{'target': int, 'numbers': [...]}}, got {ground_truth!r}")
    return tinyzero_countdown_score(solution_str, ground_truth)
