"""TinyZero-style countdown: an equation over the given numbers that hits the target.

The answer is the last `<answer>...</answer>` in the response. It is *well-formed* when it
contains only digits, + - * / ( ) and spaces (optionally followed by `= <number>`, which is
ignored) and parses as an arithmetic expression. It is *correct* when it is well-formed, uses
each given number exactly once (as written integer literals), and evaluates exactly (with
fractions) to the target. Scores: `score` correct, `format_score` well-formed but wrong
(reused/missing numbers, wrong value, division by zero), 0.0 otherwise.

The expression is evaluated by walking its AST over an allow-list of nodes; `eval` is never used.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction
from typing import Any

COUNTDOWN_FORMAT_SCORE = 0.1
"""Default score of a well-formed but wrong answer (read at call time, so it may be changed)."""

MAX_EQUATION_CHARS = 512
"""Longer answers are not well-formed (bounds parse and evaluation cost)."""

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ALLOWED_CHARS = re.compile(r"[\d+\-*/()\s]+")
_RESULT_SUFFIX = re.compile(r"=\s*-?\d+(?:\.\d+)?\s*$")
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div)


class _NotWellFormed(ValueError):
    pass


def extract_answer(solution_str: str) -> str | None:
    """The content of the last `<answer>...</answer>`, stripped; None if there is none."""
    found = _ANSWER.findall(solution_str)
    return found[-1].strip() if found else None


def parse_equation(equation: str) -> ast.expr:
    """The expression's AST, or _NotWellFormed if it uses anything beyond integers, + - * / and ()."""
    expr = _RESULT_SUFFIX.sub("", equation).strip()
    if not expr or len(expr) > MAX_EQUATION_CHARS or not _ALLOWED_CHARS.fullmatch(expr):
        raise _NotWellFormed(f"not an arithmetic expression: {equation[:80]!r}")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise _NotWellFormed(f"does not parse: {e}") from None
    _check(tree.body)
    return tree.body


def _check(node: ast.AST, depth: int = 0) -> None:
    if depth > 100:
        raise _NotWellFormed("expression nested too deeply")
    if isinstance(node, ast.BinOp) and isinstance(node.op, _BINOPS):
        _check(node.left, depth + 1)
        _check(node.right, depth + 1)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        _check(node.operand, depth + 1)
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        pass
    else:
        raise _NotWellFormed(f"disallowed element {type(node).__name__}")


def numbers_used(node: ast.expr) -> list[int]:
    """The integer literals of a checked expression, left to right."""
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]


def evaluate(node: ast.expr) -> Fraction:
    """Exact value of a checked expression; ZeroDivisionError on division by zero."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        return -evaluate(node.operand)
    assert isinstance(node, ast.BinOp)
    a, b = evaluate(node.left), evaluate(node.right)
    if isinstance(node.op, ast.Add):
        return a + b
    if isinstance(node.op, ast.Sub):
        return a - b
    if isinstance(node.op, ast.Mult):
        return a * b
    return a / b


def _parse_ground_truth(ground_truth: Any) -> tuple[Fraction, list[int]]:
    if not isinstance(ground_truth, dict) or "target" not in ground_truth or "numbers" not in ground_truth:
        raise ValueError(f"countdown ground truth must be {{'target': int, 'numbers': [...]}}, got {ground_truth!r}")
    try:
        target = Fraction(ground_truth["target"])
        numbers = [int(n) for n in ground_truth["numbers"]]
    except (TypeError, ValueError) as e:
        raise ValueError(f"countdown ground truth {ground_truth!r} is not numeric: {e}") from None
    return target, numbers


def countdown_score(
    solution_str: str, ground_truth: Any, *, format_score: float | None = None, score: float = 1.0
) -> float:
    """`score`, `format_score` (default COUNTDOWN_FORMAT_SCORE) or 0.0, as described in the module doc."""
    if format_score is None:
        format_score = COUNTDOWN_FORMAT_SCORE
    target, numbers = _parse_ground_truth(ground_truth)
    equation = extract_answer(solution_str)
    if equation is None:
        return 0.0
    try:
        tree = parse_equation(equation)
    except _NotWellFormed:
        return 0.0
    if Counter(numbers_used(tree)) != Counter(numbers):
        return format_score
    try:
        value = evaluate(tree)
    except ZeroDivisionError:
        return format_score
    return score if value == target else format_score


def make_countdown_reward(format_score: float, score: float = 1.0):
    """A verl-signature countdown reward with its own format score (for register_reward)."""

    def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
        return countdown_score(solution_str, ground_truth, format_score=format_score, score=score)

    compute_score.__qualname__ = f"countdown_reward(format_score={format_score}, score={score})"
    return compute_score


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl-signature countdown reward with the module's COUNTDOWN_FORMAT_SCORE."""
    return countdown_score(solution_str, ground_truth)
