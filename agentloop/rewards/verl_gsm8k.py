"""verl's GSM8K reward, written here from its documented rules (registered as data_source `openai/gsm8k`).

Under verl's name we score exactly as verl does, so a curve from agentloop and one from verl are the same
numbers. The rules (verl `utils/reward_score/gsm8k.py`, at and after its 2025-07 version):

    text      the response decoded WITHOUT special tokens (verl's reward manager; see `solution_view`)
    clip      only the last 300 characters are searched
    strict    every `#### <run of -, digits, dots, commas>` with exactly ONE space after `####`;
              the LAST one; commas removed. `####72`, `#### $72`, `#### **72**` do not match.
    flexible  every run of `-`/digits/dots/commas anywhere (`####` ignored); from the end, the first run
              that is not "."; commas kept; if every run is ".", the first one (verl's loop leaves it so)
    score     no answer -> 0.0; answer == ground truth as STRINGS -> score (1.0); else format_score (0.0).
              "72.00", "72." and "$72" are not "72"; an integer ground truth never equals a string.

Our lenient reading (numeric comparison, `####72`, `$72`, `72.00`) lives in `gsm8k.py` under
`agentloop/gsm8k`; choose it for our own data, choose this one to compare with verl.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from agentloop.rewards.scoring import solution_view

CLIP_CHARS = 300
"""verl searches only the last 300 characters of the response."""

_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_FLEXIBLE = re.compile(r"(-?[0-9.,]+)")


def extract_solution(solution_str: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The answer string verl's rules extract, or None."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    text = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(text)
        return found[-1].replace(",", "") if found else None
    found = _FLEXIBLE.findall(text)
    if not found:
        return None
    for run in reversed(found):
        if run != ".":
            return run
    return found[0]


def verl_gsm8k_score(solution_str: str, ground_truth: Any, method: Literal["strict", "flexible"] = "strict",
                     format_score: float = 0.0, score: float = 1.0) -> float:
    """verl's `gsm8k.compute_score` with its defaults: string equality with the ground truth."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)


@solution_view("response")
def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl's `default_compute_score` for `openai/gsm8k` (strict, format score 0)."""
    return verl_gsm8k_score(solution_str, ground_truth)
