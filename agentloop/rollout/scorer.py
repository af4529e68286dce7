"""Scoring an episode: which reward function applies (custom, code, or by data_source), the text it sees,
and where it runs: synchronous functions in the reward pool's worker processes (agentloop.rewards.pool),
async ones on the loop, each call under `reward.timeout_s` (the code reward keeps its own deadlines)."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable

from agentloop.config import Config
from agentloop.errors import RewardError
from agentloop.records import AgentLoopOutput, Sample
from agentloop.rewards import get_reward, load_custom_reward
from agentloop.rewards.code import make_code_reward
from agentloop.rewards.pool import RewardPool, RewardTimeout
from agentloop.rewards.scoring import (
    RewardCallable,
    SolutionView,
    call_reward,
    normalize_reward,
    view_of,
)


class Scorer:
    """Chooses and calls the reward function of an episode (custom one, or by data_source)."""

    def __init__(self, cfg: Config, *, on_note: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.custom = load_custom_reward(cfg.reward.custom) if cfg.reward.custom else None
        # Rewards that need run config (sandbox limits) are built here rather than registered globally.
        # They bound their own runs (reward.code.timeout_s from when a sandbox slot is free), so
        # reward.timeout_s, which would also count the wait for a slot, is not applied to them.
        self.overrides = {"agentloop/code": make_code_reward(cfg.reward.code, limits=cfg.tools.python)}
        self.pool = RewardPool(cfg.reward.workers, cfg.reward.timeout_s, cfg.reward.executor, on_note=on_note)

    async def close(self) -> None:
        """Stop the reward workers."""
        await self.pool.close()

    def reward_fn(self, sample: Sample) -> RewardCallable:
        """The function that scores `sample`: the custom one, a run-configured one, or the registry's."""
        return (self.custom or self.overrides.get(sample.data_source)
                or get_reward(sample.data_source, default=self.cfg.reward.default))

    def view(self, sample: Sample) -> SolutionView:
        """Which text the sample's reward expects (reward.custom_view for a custom reward)."""
        return self.cfg.reward.custom_view if self.custom else view_of(self.reward_fn(sample))

    def solution_text(self, sample: Sample, out: AgentLoopOutput, tokenizer: Any) -> str:
        """The solution_str for `sample`'s reward, built from the episode's tokens as its framework does."""
        return solution_text(out, tokenizer, self.view(sample))

    async def score(self, sample: Sample, solution_str: str,
                    extra_info: dict[str, Any] | None = None) -> tuple[float, dict[str, Any]]:
        """(score, info) of one episode; the reward gets `extra_info` (`reward_extra_info(sample, out)`), else
        the row's. RewardTimeout past `reward.timeout_s`; RewardError when the function raised or returned
        something unusable, or when no reward applies to the sample."""
        fn = self.reward_fn(sample)
        args = {"data_source": sample.data_source, "solution_str": solution_str,
                "ground_truth": sample.ground_truth,
                "extra_info": sample.extra_info if extra_info is None else extra_info}
        if not inspect.iscoroutinefunction(fn):
            result = await self.pool.score(fn, args)
            return result.score, result.info
        own_deadline = fn is self.overrides.get(sample.data_source)
        try:
            raw = await asyncio.wait_for(call_reward(fn, args), None if own_deadline else self.cfg.reward.timeout_s)
        except asyncio.TimeoutError:
            raise RewardTimeout(f"reward for {sample.data_source!r} ran past reward.timeout_s="
                                f"{self.cfg.reward.timeout_s:g}s") from None
        except RewardError:
            raise
        except Exception as e:  # noqa: BLE001 - named and re-raised as a reward failure
            raise RewardError(f"reward for {sample.data_source!r} raised {type(e).__name__}: {e}") from e
        result = normalize_reward(raw, sample.data_source)
        return result.score, result.info


def reward_extra_info(sample: Sample, out: AgentLoopOutput) -> dict[str, Any]:
    """The `extra_info` a reward function receives: a copy of the row's, plus what verl's reward managers add
    (verl b178a3cd: naive/reward-loop managers and the tool agent loop's extra fields), so a verl reward that
    reads them finds them:

        num_turns              verl's count: 1 (the prompt) + assistant turns + tool-response rounds
                               (a single-turn episode: 2)
        tool_rewards           the step reward of each tool call run, in order (verl tools' own; 0.0 for
                               any other call, and for a call that failed, as verl lists it)
        turn_scores            [] (verl's interaction scores; there are no interactions here)
        rollout_reward_scores  {} (what verl passes when its rollout set none)
    """
    info = dict(sample.extra_info)
    mask = out.response_mask
    env_rounds = sum(1 for i, m in enumerate(mask) if m == 0 and i > 0 and mask[i - 1] == 1)
    trace = out.extra.get("tool_trace") or []
    info["tool_rewards"] = [float(t["step_reward"]) for t in trace if isinstance(t, dict) and "step_reward" in t]
    info["turn_scores"] = []
    info["num_turns"] = 1 + out.num_turns + env_rounds
    info["rollout_reward_scores"] = {}
    return info


def solution_text(out: AgentLoopOutput, tokenizer: Any, view: SolutionView = "loop") -> str:
    """The text a reward sees (agentloop.rewards.scoring explains the views).

    A loop that sets `extra["solution_str"]` has said what to score: that text, whatever the view. Else
    loop: the loop's `response_text` if given, else the decoded response; response: the response decoded
    without special tokens (verl); prompt_response: prompt + response decoded with special tokens
    (TinyZero, Search-R1)."""
    explicit = out.extra.get("solution_str")
    if isinstance(explicit, str):
        return explicit
    if view == "response":
        return tokenizer.decode(out.response_ids, skip_special_tokens=True)
    if view == "prompt_response":
        return tokenizer.decode(list(out.prompt_ids) + list(out.response_ids), skip_special_tokens=False)
    for key in ("solution_str", "response_text"):
        v = out.extra.get(key)
        if isinstance(v, str):
            return v
    return tokenizer.decode(out.response_ids, skip_special_tokens=True)
