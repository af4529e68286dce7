"""The built-in rewards and the names they are registered under.

Under another project's data_source name a reward scores exactly as that project does (same text, same
rules), so curves compare; our own, more lenient readings live under `agentloop/...` names.

    name / data_source                          reward                                          text
    openai/gsm8k                                verl_gsm8k (verl: `#### n`, string equality)    response
    lighteval/MATH, DigitalLearningGmbH/         verl_math (verl: last \\boxed, Hendrycks        response
      MATH-lighteval, HuggingFaceH4/MATH-500       normalization)
    countdown                                   tinyzero_countdown (TinyZero, 0.1 format score) prompt+response
    nq, triviaqa, popqa, hotpotqa,              search_r1_qa.compute_score (Search-R1 qa_em)    prompt+response
      2wikimultihopqa, musique, bamboogle
    searchR1_nq, ... (verl's names)             search_r1_qa.compute_score_verl (verl's port)   response
    agentloop/gsm8k, gsm8k, agentloop/          gsm8k.compute_score (last `####`, numeric:      loop
      arithmetic, agentloop/calculator            `####72`, `$72`, `72.00` count)
    agentloop/gsm8k_flexible, gsm8k_flexible    gsm8k.compute_score_flexible (last number too)  loop
    agentloop/math, boxed_math                  boxed.compute_score (\\boxed{}, numeric, units)  loop
    agentloop/countdown                         countdown.compute_score (exact fractions,       loop
                                                  `eq = target` ok, malformed 0)
    agentloop/search_qa                         qa.compute_score (last <answer>, response only) loop
    agentloop/code                              code.compute_score (tests in the sandbox)       loop
    reasoning_gym                               reasoning_gym.compute_score (the task's own     loop
                                                  score_answer, reasoning-gym's extraction)
    verifiers, textarena, openenv               environment.compute_score: the environment      -
                                                  loop sets the reward (rubric, game, server)
    exact_match                                 exact.compute_score                             loop

`text` is the reward's `solution_view` (agentloop.rewards.scoring). Which to choose: the project's name
when you compare with (or continue) a verl / TinyZero / Search-R1 run; ours when you want an answer
that is right to count as right (`72.00`, `####72`, `24 = 24`).
"""

from __future__ import annotations

from agentloop.rewards import (
    boxed,
    code,
    countdown,
    environment,
    exact,
    gsm8k,
    qa,
    reasoning_gym,
    search_r1_qa,
    tinyzero_countdown,
    verl_gsm8k,
    verl_math,
)
from agentloop.rewards.registry import register_reward
from agentloop.rewards.scoring import RewardCallable

BUILTIN_REWARDS: dict[str, RewardCallable] = {
    # other projects' names: their rules
    "openai/gsm8k": verl_gsm8k.compute_score,
    **{name: verl_math.compute_score for name in verl_math.VERL_MATH_SOURCES},
    "countdown": tinyzero_countdown.compute_score,
    **{name: search_r1_qa.compute_score for name in search_r1_qa.SEARCH_R1_SOURCES},
    **{name: search_r1_qa.compute_score_verl for name in search_r1_qa.VERL_SEARCH_R1_SOURCES},
    # our names: our rules
    "agentloop/gsm8k": gsm8k.compute_score,
    "gsm8k": gsm8k.compute_score,
    "agentloop/arithmetic": gsm8k.compute_score,
    "agentloop/calculator": gsm8k.compute_score,
    "agentloop/gsm8k_flexible": gsm8k.compute_score_flexible,
    "gsm8k_flexible": gsm8k.compute_score_flexible,
    "agentloop/math": boxed.compute_score,
    "boxed_math": boxed.compute_score,
    "agentloop/countdown": countdown.compute_score,
    "agentloop/search_qa": qa.compute_score,
    "agentloop/code": code.compute_score,
    "exact_match": exact.compute_score,
    "reasoning_gym": reasoning_gym.compute_score,
    **{name: environment.compute_score for name in environment.LOOPS},
}


def register_builtin_rewards() -> None:
    """Register every built-in reward (idempotent)."""
    for name, fn in BUILTIN_REWARDS.items():
        register_reward(name, fn)
