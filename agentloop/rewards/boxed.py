"""`\\boxed{}` math answers (MATH / lighteval style) with light LaTeX normalization.

    extract_boxed      the content of the last \\boxed{...} / \\fbox{...} / `\\boxed 5`
    normalize_math     canonical string form of an answer
    is_equiv           normalized strings equal, or both parse as the same exact number
    boxed_math_score   1.0 / 0.0

Simplified on purpose: no symbolic algebra (`x+1` and `1+x` differ); a trailing \\text{...}
after a value is taken for a unit and dropped; `a/b` and `\\frac{a}{b}` match only for integers.
"""

from __future__ import annotations

import re
from typing import Any

from agentloop.rewards._numbers import parse_number

_BOX_CMD = re.compile(r"\\(?:boxed|fbox)")
_BOX_TOKEN = re.compile(r" +([^\s$]+)")


def _matching_braces(text: str) -> dict[int, int]:
    """Index of each "{" that is closed -> index of its "}", in one pass (escaped braces skipped)."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


def extract_boxed(text: str) -> str | None:
    """The content of the last well-formed `\\boxed{...}`, `\\fbox{...}` or `\\boxed 5`; None if none."""
    pairs: dict[int, int] | None = None
    for m in reversed(list(_BOX_CMD.finditer(text))):
        rest = m.end()
        if rest < len(text) and text[rest] == "{":
            if pairs is None:
                pairs = _matching_braces(text)
            close = pairs.get(rest)
            if close is not None:
                return text[rest + 1 : close]
        elif rest < len(text) and text[rest] == " ":
            token = _BOX_TOKEN.match(text, rest)
            if token:
                return token.group(1)
    return None


_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![A-Za-z])")
_SPACING = re.compile(r"\\[,:;! ]|\\q?quad(?![A-Za-z])")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree|°")
_TEXT_CMD = r"\\(?:text|textbf|textrm|mbox|mathrm)\s*"
_TEXT_CMD_RE = re.compile(_TEXT_CMD + r"(?=\{)")
_TEXT_UNWRAP = re.compile(_TEXT_CMD + r"\{([^{}]*)\}")
_DFRAC = re.compile(r"\\[dt]frac(?![A-Za-z])")
_FRAC_SHORT = re.compile(r"\\frac\s*(\{[^{}]*\}|[0-9A-Za-z])\s*(\{[^{}]*\}|[0-9A-Za-z])")
_SQRT_SHORT = re.compile(r"\\sqrt\s*([0-9A-Za-z])")
_INT_FRAC = re.compile(r"\\frac\{(-?\d+)\}\{(\d+)\}")
_TRAILING_ZEROS = re.compile(r"(?<=\d)\.0+(?!\d)")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_ASSIGNMENT = re.compile(r"^[A-Za-z]\w{0,1}=(?!=)")


def _brace(arg: str) -> str:
    return arg if arg.startswith("{") else "{" + arg + "}"


def _drop_trailing_unit(s: str) -> str:
    """`10\\text{ cm}` -> `10`: a text group ending the answer after some value is a unit."""
    matches = list(_TEXT_CMD_RE.finditer(s))
    if not matches:
        return s
    m = matches[-1]
    close = _matching_braces(s).get(m.end())
    head = s[: m.start()].strip()
    if close is not None and head and not s[close + 1 :].strip():
        return head
    return s


def normalize_math(answer: str) -> str:
    """A canonical form: no spaces, $, \\left/\\right, degrees, %, units; \\frac{a}{b} -> a/b for integers."""
    s = str(answer).strip()
    if _BOX_CMD.search(s):
        s = extract_boxed(s) or s
    s = s.replace("\\$", "").replace("$", "")
    s = _LEFT_RIGHT.sub("", s)
    s = _SPACING.sub(" ", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = _drop_trailing_unit(s)
    s = _TEXT_UNWRAP.sub(r"\1", s)
    s = _DFRAC.sub(r"\\frac", s)
    s = _FRAC_SHORT.sub(lambda m: "\\frac" + _brace(m.group(1)) + _brace(m.group(2)), s)
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    if s.count("=") == 1:
        s = _ASSIGNMENT.sub("", s)
    s = _INT_FRAC.sub(r"\1/\2", s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    s = _TRAILING_ZEROS.sub("", s)
    return s


def is_equiv(prediction: str, ground_truth: str) -> bool:
    """Normalized strings are equal, or both parse as numbers with the same exact value."""
    a, b = normalize_math(prediction), normalize_math(ground_truth)
    if a == b:
        return True
    x, y = parse_number(a), parse_number(b)
    return x is not None and y is not None and x == y


def boxed_math_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 if the last boxed answer matches the (or any listed) ground truth, else 0.0."""
    pred = extract_boxed(solution_str)
    if pred is None:
        return 0.0
    truths = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    return 1.0 if any(is_equiv(pred, str(g)) for g in truths) else 0.0


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl-signature \\boxed{} math reward."""
    return boxed_math_score(solution_str, ground_truth)
