"""Rewards: verl-signature scoring functions selected by data_source.

A reward function is `compute_score(data_source, solution_str, ground_truth, extra_info=None)`
returning a float (or bool) or a dict with "score" plus extra info. To add one:

    from agentloop.rewards import register_reward
    register_reward("my/data_source", compute_score)

or point `reward.custom` at `path/to/file.py:function` (see `load_custom_reward`).

Under verl's, TinyZero's and Search-R1's data_source names the built-ins score exactly as those projects
do (verl_gsm8k, verl_math, tinyzero_countdown, search_r1_qa); our lenient readings are registered under
`agentloop/...` names (the table is in builtin.py). A reward marks the text it expects with
`@solution_view("loop" | "response" | "prompt_response")` (scoring.py).
`score_episode` calls a function and normalizes its result into a `RewardResult`;
anything unusable is a RewardError naming the data source.

May import: the vocabulary, util and tools (the code reward runs tests in the tools' sandbox).
"""

from agentloop.rewards.boxed import (
    boxed_math_score,
    extract_boxed,
    is_equiv,
    normalize_math,
)
from agentloop.rewards.builtin import BUILTIN_REWARDS, register_builtin_rewards
from agentloop.rewards.countdown import (
    COUNTDOWN_FORMAT_SCORE,
    countdown_score,
    make_countdown_reward,
)
from agentloop.rewards.exact import exact_match_score, normalize_text
from agentloop.rewards.gsm8k import extract_gsm8k_answer, gsm8k_score
from agentloop.rewards.registry import (
    get_reward,
    list_rewards,
    load_custom_reward,
    register_reward,
)
from agentloop.rewards.scoring import (
    SOLUTION_VIEWS,
    RewardFn,
    RewardResult,
    SolutionView,
    call_reward,
    normalize_reward,
    score_episode,
    solution_view,
    view_of,
)

register_builtin_rewards()

__all__ = [
    "BUILTIN_REWARDS",
    "COUNTDOWN_FORMAT_SCORE",
    "RewardFn",
    "RewardResult",
    "SOLUTION_VIEWS",
    "SolutionView",
    "boxed_math_score",
    "call_reward",
    "countdown_score",
    "exact_match_score",
    "extract_boxed",
    "extract_gsm8k_answer",
    "get_reward",
    "gsm8k_score",
    "is_equiv",
    "list_rewards",
    "load_custom_reward",
    "make_countdown_reward",
    "normalize_math",
    "normalize_reward",
    "normalize_text",
    "register_builtin_rewards",
    "register_reward",
    "score_episode",
    "solution_view",
    "view_of",
]
