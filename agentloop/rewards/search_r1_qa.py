"""Search-R1's exact-match rewards, written here from their documented rules, under their own names.

Two rule sets, because the two projects differ and each user compares with their own:

    Search-R1 (`qa_em.compute_score_em`), data_source nq, triviaqa, popqa, hotpotqa, 2wikimultihopqa,
    musique, bamboogle:
        text    PROMPT + response decoded with special tokens kept (Search-R1's reward manager)
        answer  the last `<answer>...</answer>` (across newlines), stripped, but only when there are at
                least TWO such pairs in the text: the prompt's instructions hold two already
                ("<answer> and </answer>", "<answer> Beijing </answer>"), so with Search-R1's template a
                response without an answer tag is read as "Beijing"
        score   no answer -> 0.0; normalized answer equals a normalized golden answer -> 1.0; else 0.0

    verl's port (`search_r1_like_qa_em.compute_score`), data_source searchR1_nq, searchR1_triviaqa,
    searchR1_popqa, searchR1_hotpotqa, searchR1_2wikimultihopqa, searchR1_musique, searchR1_bamboogle:
        text    the response decoded without special tokens (verl's reward manager)
        answer  the last `<answer>...</answer>` (across newlines), stripped; one pair is enough
        score   no answer -> 0.0; exact match -> 1.0, but 0.25 when the text holds more than ten `<answer>`
                or more than ten `</answer>`; else 0.0

Normalization (both): lower case, every ASCII punctuation character removed, the words a/an/the replaced by
a space, whitespace collapsed. Ground truth: `{"target": [golden answers]}` (or one string).

Our own variant (`agentloop/search_qa`, `qa.py`): the response only, one tag, empty answers never match.
"""

from __future__ import annotations

import re
from typing import Any

from agentloop.rewards.qa import normalize_answer
from agentloop.rewards.scoring import solution_view

SEARCH_R1_SOURCES = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
"""Search-R1's data_source names (its FlashRAG data sets)."""

VERL_SEARCH_R1_SOURCES = tuple(f"searchR1_{name}" for name in SEARCH_R1_SOURCES)
"""verl's names for the same sets (its Search-R1-like example)."""

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _golden(ground_truth: Any) -> list[str]:
    if not isinstance(ground_truth, dict) or "target" not in ground_truth:
        raise ValueError(f"Search-R1 ground truth must be {{'target': [answers]}}, got {ground_truth!r}")
    target = ground_truth["target"]
    return [target] if isinstance(target, str) else list(target)


def em_check(prediction: str, golden_answers: list[str]) -> bool:
    """The normalized prediction equals one of the normalized golden answers."""
    pred = normalize_answer(prediction)
    return any(normalize_answer(g) == pred for g in golden_answers)


def extract_answer(text: str, min_tags: int) -> str | None:
    """The last answer, stripped, when the text holds at least `min_tags` answer pairs; else None."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if len(found) >= min_tags else None


def search_r1_em_score(solution_str: str, ground_truth: Any, format_score: float = 0.0, score: float = 1.0) -> float:
    """Search-R1's `compute_score_em` (prompt + response; at least two answer pairs)."""
    golden = _golden(ground_truth)
    answer = extract_answer(solution_str, min_tags=2)
    if answer is None:
        return 0.0
    return float(score) if em_check(answer, golden) else float(format_score)


def verl_search_r1_score(solution_str: str, ground_truth: Any, format_score: float = 0.0, score: float = 1.0) -> float:
    """verl's `search_r1_like_qa_em.compute_score` (response only; more than ten tags quarters the score)."""
    golden = _golden(ground_truth)
    answer = extract_answer(solution_str, min_tags=1)
    if answer is None:
        return 0.0
    if not em_check(answer, golden):
        return float(format_score)
    if solution_str.count("<answer>") > 10 or solution_str.count("</answer>") > 10:
        return score / 4
    return float(score)


@solution_view("prompt_response")
def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """Search-R1's reward for its data sources (nq, hotpotqa, ...)."""
    return search_r1_em_score(solution_str, ground_truth)


@solution_view("response")
def compute_score_verl(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl's Search-R1-like reward for its data sources (searchR1_nq, ...)."""
    return verl_search_r1_score(solution_str, ground_truth)
