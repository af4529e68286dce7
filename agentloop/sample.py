"""The typed data row a loop receives (verl row format, plus its identity in the run)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Sample(BaseModel):
    """One episode's input: a verl-format row plus its index and repeat index."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    index: int
    """Row index in the data set (stable across runs)."""
    repeat: int = 0
    """Repeat index within the group of episodes of this row."""
    data_source: str
    """verl `data_source`: selects the reward function."""
    messages: list[dict[str, Any]]
    """verl `prompt`: chat messages ({role, content, ...}) given to the chat template."""
    ground_truth: Any = None
    """verl `reward_model.ground_truth`."""
    extra_info: dict[str, Any] = Field(default_factory=dict)
    """verl `extra_info` (free-form; `tools_kwargs` may live here)."""
    tools_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Per-tool creation kwargs for this row (verl's `tools_kwargs`), keyed by tool name."""
    ability: str | None = None
    """verl `ability` (informational)."""

    @property
    def episode_id(self) -> str:
        """`<index>-<repeat>`: unique within a run, the key for sticky routing."""
        return f"{self.index}-{self.repeat}"

    def with_repeat(self, repeat: int) -> "Sample":
        return self.model_copy(update={"repeat": repeat})
