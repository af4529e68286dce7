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

    async def score(self, sample: Sample, solution_str: str) -> tuple[float, dict[str, Any]]:
        """(score, info) of one episode. RewardTimeout past `reward.timeout_s`; RewardError when the function
        raised or returned something unusable, or when no reward applies to the sample."""
        fn = self.reward_fn(sample)
        args = {"data_source": sample.data_source, "solution_str": solution_str,
                "ground_truth": sample.ground_truth, "extra_info": sample.extra_info}
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
