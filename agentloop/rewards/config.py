"""Reward settings mounted in the config tree (`reward.code`, `reward.tools`): plain pydantic, no imports of ours."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class CodeRewardConfig(BaseModel):
    """Settings of the code reward (mount as `reward.code`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    mode: Literal["pass_rate", "all_or_nothing"] = "pass_rate"
    """pass_rate: score = passed / total tests; all_or_nothing: 1.0 only when every test passes."""
    timeout_s: float = Field(default=10.0, gt=0)
    """Wall-clock limit of one answer's whole test run (replaces the sandbox's timeout_s)."""
    per_test_timeout_s: float = Field(default=2.0, gt=0)
    """Deadline of loading the solution, of each function test and of each stdin/stdout run; a test past it
    fails and the solution process is replaced for the next test."""
    max_concurrent: int = Field(default=4, ge=1)
    """Test runs at once in this process (per event loop), over all episodes."""
    max_message_chars: int = Field(default=200, ge=0)
    """Length kept of the first failure's message in the reward info."""
    max_output_bytes: int = Field(default=1 << 20, ge=1024)
    """Largest value one call may return (as JSON) and largest stdout of a stdin/stdout test; more fails it."""


class ToolRewardConfig(BaseModel):
    """How the tool loop's penalty and tool rewards enter the episode reward (mount as `reward.tools`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    penalty_weight: float = Field(default=1.0, ge=0)
    """Multiplier of extra['tool_penalty'] (0 ignores the penalty)."""
    tool_reward_weight: float = Field(default=1.0, ge=0)
    """Multiplier of the summed tool rewards (0 ignores them)."""
    tool_reward_names: list[str] | None = None
    """Tools whose rewards count; None: every tool that reported one."""
    min_reward: float | None = None
    """Lower clip of the combined reward (None: no clip)."""
    max_reward: float | None = None
    """Upper clip of the combined reward (None: no clip)."""

    @model_validator(mode="after")
    def _bounds(self) -> "ToolRewardConfig":
        if self.min_reward is not None and self.max_reward is not None and self.min_reward > self.max_reward:
            raise ValueError(f"min_reward {self.min_reward} > max_reward {self.max_reward}")
        return self
