"""Short-answer QA (Search-R1 style): exact match of the last <answer>...</answer> against any alias.

Rule: take the text inside the last `<answer>` ... `</answer>` pair of the response (no tag: 0.0);
normalize it and each alias the SQuAD way (lower case, punctuation removed, the articles a/an/the
dropped, whitespace collapsed); 1.0 if it equals any alias, else 0.0.

Ground truth: `{"target": [aliases]}`, a list of aliases, or one string.
"""

from __future__ import annotations

import re
import string
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lower case, no punctuation, no articles, single spaces."""
    s = text.lower().translate(_PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def extract_answer_tag(text: str) -> str | None:
    """The content of the last <answer>...</answer>, or None."""
    found = _ANSWER.findall(text)
    return found[-1] if found else None


def _aliases(ground_truth: Any) -> list[str]:
    if isinstance(ground_truth, dict):
        ground_truth = ground_truth.get("target", [])
    if isinstance(ground_truth, str):
        return [ground_truth]
    return [str(g) for g in ground_truth]


def qa_exact_match(solution_str: str, ground_truth: Any) -> float:
    """1.0 when the last <answer> matches an alias after normalization, else 0.0."""
    answer = extract_answer_tag(solution_str)
    if answer is None:
        return 0.0
    pred = normalize_answer(answer)
    return 1.0 if pred and any(pred == normalize_answer(a) for a in _aliases(ground_truth)) else 0.0


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl-signature short-answer exact match (see the module docstring)."""
    return qa_exact_match(solution_str, ground_truth)
