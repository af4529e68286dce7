"""The built-in rewards and the names they are registered under.

    name / data_source                      reward
    agentloop/arithmetic, openai/gsm8k,     gsm8k.compute_score (strict `####`)
      gsm8k
    gsm8k_flexible                          gsm8k.compute_score_flexible (last number fallback)
    lighteval/MATH, DigitalLearningGmbH/    boxed.compute_score (\\boxed{} math)
      MATH-lighteval, math, boxed_math
    countdown                               countdown.compute_score (TinyZero)
    exact_match                             exact.compute_score
    agentloop/code                          code.compute_score (async: tests in the python tool's sandbox)
    agentloop/search_qa                     qa.compute_score (last <answer>...</answer>, SQuAD-normalized)
"""

from __future__ import annotations

from agentloop.rewards import boxed, code, countdown, exact, gsm8k, qa
from agentloop.rewards.registry import register_reward
from agentloop.rewards.scoring import RewardCallable

BUILTIN_REWARDS: dict[str, RewardCallable] = {
    "agentloop/arithmetic": gsm8k.compute_score,
    "agentloop/calculator": gsm8k.compute_score,
    "openai/gsm8k": gsm8k.compute_score,
    "gsm8k": gsm8k.compute_score,
    "gsm8k_flexible": gsm8k.compute_score_flexible,
    "lighteval/MATH": boxed.compute_score,
    "DigitalLearningGmbH/MATH-lighteval": boxed.compute_score,
    "math": boxed.compute_score,
    "boxed_math": boxed.compute_score,
    "countdown": countdown.compute_score,
    "exact_match": exact.compute_score,
    "agentloop/code": code.compute_score,
    "agentloop/search_qa": qa.compute_score,
}


def register_builtin_rewards() -> None:
    """Register every built-in reward (idempotent)."""
    for name, fn in BUILTIN_REWARDS.items():
        register_reward(name, fn)
