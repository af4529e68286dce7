"""GSM8K-style answers: the number after the last `####` (strict), or the last number (flexible)."""

from __future__ import annotations

import re
from typing import Any, Literal

from agentloop.rewards._numbers import parse_number

# Digits with optional thousands groups and decimals; "-" sign; no nested quantifiers.
_NUM = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_STRICT = re.compile(r"####[\s*$]*(" + _NUM + r")")
_ANY = re.compile(r"(?<![\d.])(" + _NUM + r")")

Method = Literal["strict", "flexible"]


def extract_gsm8k_answer(text: str, method: Method = "strict") -> str | None:
    """The answer string: the number after the last `####`; with "flexible", the last number if none."""
    found = _STRICT.findall(text)
    if found:
        return found[-1].replace(",", "")
    if method == "flexible":
        found = _ANY.findall(text)
        if found:
            return found[-1].replace(",", "")
    elif method != "strict":
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    return None


def _ground_truth_number(ground_truth: Any):
    if isinstance(ground_truth, bool):
        raise ValueError(f"gsm8k ground truth must be a number or a numeric string, got {ground_truth!r}")
    text = str(ground_truth)
    if "####" in text:
        text = extract_gsm8k_answer(text) or text
    value = parse_number(text)
    if value is None:
        raise ValueError(f"gsm8k ground truth {ground_truth!r} is not a number")
    return value


def gsm8k_score(
    solution_str: str,
    ground_truth: Any,
    *,
    method: Method = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` if the extracted answer equals the ground truth as a number, `format_score` if an
    answer was found but differs, 0.0 if none was found."""
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    value = parse_number(answer)
    return score if value is not None and value == _ground_truth_number(ground_truth) else format_score


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl-signature GSM8K reward, strict extraction."""
    return gsm8k_score(solution_str, ground_truth, method="strict")


def compute_score_flexible(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """verl-signature GSM8K reward, falling back to the last number when there is no `####`."""
    return gsm8k_score(solution_str, ground_truth, method="flexible")
