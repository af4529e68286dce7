"""Exact match after light string normalization."""

from __future__ import annotations

import re
import unicodedata
from typing import Any

_SPACES = re.compile(r"\s+")
_QUOTES = "\"'`"


def normalize_text(text: str) -> str:
    """NFKC, case-folded, whitespace collapsed, surrounding quotes and a final period removed."""
    s = unicodedata.normalize("NFKC", text).casefold()
    s = _SPACES.sub(" ", s).strip()
    while len(s) >= 2 and s[0] == s[-1] and s[0] in _QUOTES:
        s = s[1:-1].strip()
    s = s.rstrip(".").strip()
    return s


def _candidates(ground_truth: Any) -> list[str]:
    if isinstance(ground_truth, (list, tuple)):
        return [str(g) for g in ground_truth]
    return [str(ground_truth)]


def exact_match_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 if the whole normalized response equals the (or any listed) normalized ground truth."""
    pred = normalize_text(solution_str)
    return 1.0 if any(pred == normalize_text(g) for g in _candidates(ground_truth)) else 0.0


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl-signature exact match."""
    return exact_match_score(solution_str, ground_truth)
