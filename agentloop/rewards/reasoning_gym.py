"""reasoning-gym's own scoring: rows of data_source `reasoning_gym` (agentloop.data.reasoning_gym) are scored by
the `score_answer` of the entry's task, on the answer read as reasoning-gym reads it.

    compute_score(data_source, solution_str, ground_truth, extra_info)
        entry = extra_info["reasoning_gym"]["entry"]  (question, answer, metadata as the dataset made them)
        answer = extract_answer(solution_str)          reasoning-gym's: the last <answer>...</answer>, stripped
                 (answer_format "hashes": the number after the last `####`, agentloop's GSM8K reading)
        score = reasoning_gym.get_score_answer_fn(entry["metadata"]["source_dataset"])(answer, entry)
        -> {"score": score, "task": ..., "answer_found": bool}

An answer that is not found is scored as reasoning-gym scores None (0.0 for its tasks). The text scored is the
loop's response (`solution_view` loop): for `openai_agent_loop` / verifiers the last assistant message. A row
without the entry (not made by `agentloop data prepare reasoning_gym`) is a RewardError naming what is missing.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Callable

from agentloop.errors import RewardError
from agentloop.rewards.gsm8k import extract_gsm8k_answer
from agentloop.rewards.scoring import solution_view


@lru_cache(maxsize=None)
def score_fn(task: str) -> Callable[[Any, dict[str, Any]], float]:
    """reasoning-gym's scorer of `task` (imported once per process)."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise RewardError(f"reasoning-gym is not installed (pip install 'agentloop[envs]'): {e}") from None
    return reasoning_gym.get_score_answer_fn(task)


def extract(solution_str: str, answer_format: str) -> str | None:
    """The answer in `solution_str` as `answer_format` reads it (None: none found)."""
    if answer_format == "answer_tag":
        from reasoning_gym.utils import extract_answer

        return extract_answer(solution_str)
    if answer_format == "hashes":
        return extract_gsm8k_answer(solution_str)
    raise RewardError(f"reasoning_gym: unknown answer_format {answer_format!r}")


def row_entry(extra_info: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
    """(the reasoning-gym entry, the answer format) stored in a prepared row's extra_info."""
    raw = (extra_info or {}).get("reasoning_gym")
    if raw is None:
        raise RewardError("reasoning_gym: the row has no extra_info['reasoning_gym'] (its entry); make rows with "
                          "`agentloop data prepare reasoning_gym`")
    info = json.loads(raw) if isinstance(raw, str) else raw
    entry = info.get("entry") if isinstance(info, dict) else None
    if not isinstance(entry, dict) or "answer" not in entry:
        raise RewardError(f"reasoning_gym: extra_info['reasoning_gym'] holds no entry with an answer: {str(raw)[:200]}")
    return entry, info.get("answer_format", "answer_tag")


@solution_view("loop")
def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    entry, answer_format = row_entry(extra_info)
    task = (entry.get("metadata") or {}).get("source_dataset") or (extra_info or {}).get("task")
    if not task:
        raise RewardError("reasoning_gym: the entry names no task (metadata.source_dataset)")
    answer = extract(solution_str, answer_format)
    score = score_fn(task)(answer, entry)
    return {"score": float(score), "task": task, "answer_found": answer is not None}


__all__ = ["compute_score", "extract", "row_entry", "score_fn"]
