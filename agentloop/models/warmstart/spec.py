"""What the warm start is built from: `WarmStartSpec` (its hash names the cache entry), the reference
recipe and the records the build and its evaluation produce."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

CODE_VERSION = "1"
"""Bumped whenever the build code changes its output for an unchanged spec."""

EVAL_SEED = 3
"""Seed of the `calculator` eval set (excluded from the traces)."""
TRAIN_SEED, TRAIN_ROWS = 12345, 4096
"""Seed and size of the `calculator_train` RL set (excluded from the traces)."""
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "assets" / "warm_calculator"
"""A warm model built from `DEFAULT_SPEC` on a GPU by `benchmarks/gpu_build_warm.sh`, with its manifest."""
_COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


class WarmStartSpec(BaseModel):
    """Everything that determines the warm model's weights; its hash names the cache entry."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    n_traces: int = Field(default=16384, ge=8)
    """Synthetic conversations generated (each seen about steps * batch_size / n_traces times)."""
    tool_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """Share of traces that call the calculator; the rest answer directly with a rough estimate."""
    steps: int = Field(default=3000, ge=1)
    """Optimizer steps (copying the expression emerged between ~16k and 192k conversations seen)."""
    batch_size: int = Field(default=64, ge=1)
    """Conversations per step."""
    lr: float = Field(default=1e-3, gt=0)
    """Peak AdamW learning rate (linear warm-up, then cosine decay to `min_lr_ratio` of it)."""
    warmup_steps: int = Field(default=100, ge=0)
    """Steps of linear learning-rate warm-up."""
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    """Final learning rate as a fraction of `lr`."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW weight decay."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Global gradient-norm clip."""
    max_len: int = Field(default=512, ge=16)
    """Traces longer than this many tokens are dropped."""
    num_threads: int = Field(default=2, ge=1)
    """torch CPU threads during the build (part of the spec: float sums depend on the thread split)."""
    device: str = "cpu"
    """torch device of the SFT ("cuda" is ~100x faster; part of the hash since numerics differ)."""
    seed: int = 20240607
    """Seed of the problems, the tool/direct split, the batch order and torch."""
    renderings: Literal["fixed", "varied"] = "fixed"
    """fixed: every trace renders the task as tool_agent_loop does (the calculator's own schema, the task's
    system prompt). varied: each trace takes one of the renderings real harnesses send (renderings.py: the
    Agents SDK's strict schema, LangChain's key order, smolagents' system prompt, ...), so harnesses driven
    through the gateway start from the same skill; their traces are longer (raise `max_len`)."""

    def digest(self, base_name: str) -> str:
        """Short hash of the spec, the base model's directory name and CODE_VERSION (the cache key). Fields added
        after a model was shipped are left out at their defaults, so the shipped model keeps its digest."""
        spec = self.model_dump(mode="json")
        if spec["renderings"] == "fixed":
            del spec["renderings"]
        payload = json.dumps({"code": CODE_VERSION, "base": base_name, "spec": spec}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


DEFAULT_SPEC = WarmStartSpec(device="cuda")
"""The reference recipe: ~100 s on one GPU. Its result ships in the package (`SHIPPED_DIR`), since
the same SFT needs hours on 2 CPU cores; `ensure_warm_model()` installs it instead of training."""

VARIED_SPEC = WarmStartSpec(device="cuda", renderings="varied", max_len=2048, n_traces=24576, steps=4500)
"""The recipe over the renderings real harnesses send (built by benchmarks/gpu_build_warm_varied.sh; not shipped
yet: once built and checked, its export replaces SHIPPED_DIR and it becomes DEFAULT_SPEC)."""


class Trace(BaseModel):
    """One synthetic conversation and its tokens."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    messages: list[dict[str, Any]]
    """The chat messages (system, user, assistant, [tool, assistant])."""
    uses_tool: bool
    """True for a calculator trace, False for a direct (estimated) answer."""
    answer: int
    """The problem's exact answer."""
    ids: list[int]
    """Token ids of the whole conversation, tokenized as tool_agent_loop does."""
    mask: list[int]
    """1 where the token is the assistant's (trained on), 0 for system/user/tool/template tokens."""
    rendering: str = "agentloop"
    """How the task is rendered (a name of renderings.RENDERINGS: the tools and system prompt offered)."""


class ToolUseStats(BaseModel):
    """What `evaluate_tool_use` measured."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    n: int
    """Episodes evaluated."""
    temperature: float
    """Sampling temperature (0 = greedy)."""
    tool_call_rate: float
    """Share of first turns holding a well-formed calculator call (parses, schema-valid arguments)."""
    attempted_call_rate: float
    """Share of first turns holding any <tool_call> block, well-formed or not."""
    right_expression_rate: float
    """Share of episodes whose first call's calculator result equals the true answer."""
    accuracy: float
    """Mean reward of the final assistant message (GSM8K `#### n`, the task's reward)."""
    accuracy_with_tool: float
    """Accuracy among episodes with a well-formed call (0 when there are none)."""
    accuracy_without_tool: float
    """Accuracy among episodes without a well-formed call (0 when there are none)."""
    examples: list[str] = Field(default_factory=list)
    """The first few episodes' response texts, for eyeballing."""
