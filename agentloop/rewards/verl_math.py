"""verl's MATH reward (the Hendrycks MATH normalization), written here from its rules, under verl's names.

Registered as data_source `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500`
(verl's `math_reward.compute_score`). Text: the response decoded without special tokens.

    boxed     if the text contains "\\boxed " (with a space): "\\boxed " + what follows its LAST occurrence,
              up to the first "$"; else the LAST "\\boxed" (or, without one, the last "\\fbox") up to the
              "}" that brings the brace count back to zero (none: no answer)
    unbox     "\\boxed X" -> X; "\\boxed{X}" -> X; anything else (e.g. \\fbox{...}) is an error -> 0.0
    equal     both strings normalized (below) and compared; if normalizing raises, the raw strings compared
    score     1.0 when equal, else 0.0

Normalization, in this order: drop newlines and "\\!"; "\\\\" -> "\\"; tfrac/dfrac -> frac; drop "\\left",
"\\right", "^{\\circ}", "^\\circ", "\\$"; if "\\text{ " occurs, keep what precedes it (more than one
occurrence is an error); drop "\\\\%" and "\\%"; " ." -> " 0.", "{." -> "{0."; a leading "." gets a "0";
"k=..." with at most two characters before a single "=" keeps the right side; "\\sqrt3" -> "\\sqrt{3}";
spaces dropped; "\\frac12" / "\\frac1b" -> "\\frac{1}{2}" / "\\frac{1}{b}"; "0.5" -> "\\frac{1}{2}"; "a/b" of
two plain integers -> "\\frac{a}{b}".

Our own, more forgiving variant (`boxed.py`: numeric equality, units, \\text unwrapping) is registered as
`agentloop/math` and `boxed_math`.
"""

from __future__ import annotations

from typing import Any

from agentloop.rewards.scoring import solution_view

VERL_MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")


def last_boxed(text: str) -> str | None:
    """The last boxed expression, including its command (see the module docstring), or None."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def unbox(boxed: str) -> str:
    """The content of a boxed expression; ValueError when it is not `\\boxed X` or `\\boxed{X}`."""
    if "\\boxed " in boxed:
        if not boxed.startswith("\\boxed "):
            raise ValueError("not a \\boxed expression")
        return boxed[len("\\boxed "):]
    if not boxed.startswith("\\boxed{") or not boxed.endswith("}"):
        raise ValueError("not a \\boxed{} expression")
    return boxed[len("\\boxed{"):-1]


def _units(s: str) -> str:
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise ValueError("several \\text{ groups")
    return parts[0]


def _sqrt(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    head, *rest = s.split("\\sqrt")
    out = [head]
    for part in rest:
        # part[0] of an empty part raises IndexError, as the rules do
        out.append("\\sqrt" + part if part[0] == "{" else "\\sqrt{" + part[0] + "}" + part[1:])
    return "".join(out)


def _fracs(s: str) -> str:
    head, *rest = s.split("\\frac")
    out = head
    for part in rest:
        out += "\\frac"
        if part[0] == "{":  # an empty part raises IndexError, as the rules do
            out += part
            continue
        if len(part) < 2:
            return s
        a, b, tail = part[0], part[1], part[2:]
        out += "{" + a + "}" + (b if b == "{" else "{" + b + "}") + tail
    return out


def _slash(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return "\\frac{" + str(a) + "}{" + str(b) + "}" if s == f"{a}/{b}" else s


def normalize(s: str) -> str:
    """The normalized answer string (may raise, see `is_equiv`)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    s = _units(s)
    s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _sqrt(s).replace(" ", "")
    s = _fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash(s)


def is_equiv(a: str | None, b: str | None) -> bool:
    """Normalized strings equal; if normalizing either raises, the raw strings equal."""
    if a is None or b is None:
        return a is None and b is None
    try:
        return normalize(a) == normalize(b)
    except Exception:  # noqa: BLE001 - the rules fall back to raw equality on any failure
        return a == b


def verl_math_score(solution_str: str, ground_truth: Any) -> float:
    """verl's `math_reward.compute_score`: 1.0 when the last boxed answer is equivalent, else 0.0."""
    try:
        boxed = last_boxed(solution_str)
        return 1.0 if boxed is not None and is_equiv(unbox(boxed), ground_truth) else 0.0
    except Exception:  # noqa: BLE001 - the rules score any failure 0.0
        return 0.0


@solution_view("response")
def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl's reward for its MATH data sources."""
    return verl_math_score(solution_str, ground_truth)
