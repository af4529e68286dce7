"""Tool-use aware rewards: fold what the tool loop reports into the task reward.

`tool_agent_loop` leaves two things in an episode's `extra` (it never changes the reward itself):

    extra["tool_penalty"]   tools.excess_call_penalty * max(0, tool_calls - tools.free_calls)  (>= 0)
    extra["tool_rewards"]   {tool name: the tool's own `reward()`}, only tools that had an opinion

The rule of `combine_tool_reward` (with ToolRewardConfig `cfg`):

    reward = score
             - cfg.penalty_weight * tool_penalty                      (when the episode reports one)
             + cfg.tool_reward_weight * sum(tool_rewards of the tools in cfg.tool_reward_names,
                                            or of every tool when that is None)
    then clipped to [cfg.min_reward, cfg.max_reward] (each bound optional)

An episode without those keys (e.g. single_turn_agent_loop) keeps its score unchanged and adds no
info; otherwise the info dict (merged into the record's `reward_info`) holds `task_score`,
`tool_penalty` and `tool_reward`, so the parts stay visible after they are summed.
"""

from __future__ import annotations

import math
from typing import Any

from agentloop.rewards.config import ToolRewardConfig


def _finite(x: Any, what: str) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, got {x!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{what} must be finite, got {v}")
    return v


def combine_tool_reward(score: float, extra: dict[str, Any], cfg: ToolRewardConfig | None = None
                        ) -> tuple[float, dict[str, float]]:
    """(reward, info): `score` with the tool penalty and tool rewards applied (rule in the module docstring).

    Pure: reads `extra`, changes nothing. A malformed penalty or tool reward raises ValueError.
    """
    cfg = cfg or ToolRewardConfig()
    has_penalty = "tool_penalty" in extra
    rewards = extra.get("tool_rewards")
    if not has_penalty and not rewards:
        return score, {}
    penalty = _finite(extra.get("tool_penalty", 0.0), "extra['tool_penalty']")
    total_tool = 0.0
    if rewards:
        if not isinstance(rewards, dict):
            raise ValueError(f"extra['tool_rewards'] must be a dict, got {type(rewards).__name__}")
        names = cfg.tool_reward_names
        total_tool = sum(_finite(v, f"extra['tool_rewards'][{k!r}]") for k, v in rewards.items()
                         if names is None or k in names)
    reward = score - cfg.penalty_weight * penalty + cfg.tool_reward_weight * total_tool
    if cfg.min_reward is not None:
        reward = max(cfg.min_reward, reward)
    if cfg.max_reward is not None:
        reward = min(cfg.max_reward, reward)
    return reward, {"task_score": float(score), "tool_penalty": penalty, "tool_reward": total_tool}
