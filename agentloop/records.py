"""Typed records: what a server call returns, what a loop returns, what the engine writes.

    Sample           one episode's input: a verl-format row plus its identity in the run
    TokenOutput      one /generate call's result (token ids + logprobs, never text)
    AgentLoopOutput  one episode as a loop builds it; invariants checked on construction
    EpisodeRecord    AgentLoopOutput + identity and timing, one JSON line per episode

A learner reads EpisodeRecord lines; `read_records` is the one reader. `extra` must hold JSON data
(`json_problem` names the first value that is not), so every record can be written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

FinishReason = Literal["stop", "length", "abort"]

_JSON_SCALARS = (str, int, float, bool, type(None))


def json_problem(value: Any, where: str = "extra") -> str | None:
    """None when `value` is JSON data (dicts with str keys, lists/tuples, str, int, float, bool, None),
    else where it stops being so, e.g. "extra['tools'][2] is a set, not JSON data". Sets are refused
    too: their order is not stable, so a record holding one would not be reproducible."""
    if isinstance(value, _JSON_SCALARS):
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{where} has the non-string key {k!r} ({type(k).__name__}); JSON keys are strings"
            bad = json_problem(v, f"{where}[{k!r}]")
            if bad:
                return bad
        return None
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            bad = json_problem(v, f"{where}[{i}]")
            if bad:
                return bad
        return None
    return f"{where} is a {type(value).__name__}, not JSON data (str, number, bool, None, list or dict)"


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class Sample(BaseModel):
    """One episode's input: a verl-format row plus its index and repeat index."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    index: int
    """Row index in the data set (stable across runs)."""
    repeat: int = 0
    """Repeat index within the group of episodes of this row."""
    uid: int | None = None
    """Identity of this dispatch of the row: its data-cursor position in training (so the same row in
    two epochs, or twice in one step, is two prompts), the row index in eval rollouts (None: `index`).
    Seed, episode id and GRPO group key derive from it."""
    attempt: int = 0
    """Dispatch attempt of this uid: 0, or n when a group cancelled as too stale is dispatched again
    (fresh seeds, same prompt)."""
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
    def group_uid(self) -> int:
        """The GRPO group key: `uid`, or the row index when no uid was given."""
        return self.index if self.uid is None else self.uid

    @property
    def episode_id(self) -> str:
        """`<uid>-<repeat>` (`<uid>.<attempt>-<repeat>` for a re-dispatch): unique within a run, the key
        for sticky routing."""
        a = f".{self.attempt}" if self.attempt else ""
        return f"{self.group_uid}{a}-{self.repeat}"

    def with_repeat(self, repeat: int) -> "Sample":
        return self.model_copy(update={"repeat": repeat})


class TokenOutput(Record):
    token_ids: list[int]
    """Ids the server sampled, exactly as returned (never re-tokenized)."""
    logprobs: list[float]
    """Log-probability of each sampled token under the server's weights (same length as token_ids)."""
    finish_reason: FinishReason
    """stop: EOS or stop string/token; length: max_new_tokens or context; abort: the server aborted it."""
    weight_version: str | None = None
    """The server's weight version when this call finished."""
    token_versions: list[int | None] = Field(default_factory=list)
    """Per sampled token: the weight version that sampled it (stamped when each request was submitted,
    refined by the server's per-token spans when it reports them); None where unknown. Empty: unknown."""
    interrupted: int = 0
    """Times this call was interrupted by a weight update and continued (prompt + partial re-submitted)."""
    cached_tokens: int = 0
    """Prompt tokens served from the server's prefix cache."""
    prompt_tokens: int = 0
    """Prompt length the server saw."""
    server: str = ""
    """URL of the server that answered."""
    latency_s: float = 0.0
    """Wall time of the successful attempt."""
    attempts: int = 1
    """Attempts made (1 = no retry)."""

    @model_validator(mode="after")
    def _same_length(self) -> "TokenOutput":
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"token_ids ({len(self.token_ids)}) and logprobs ({len(self.logprobs)}) differ in length"
            )
        return self


class AgentLoopOutput(Record):
    prompt_ids: list[int]
    """Token ids of the templated prompt (the part the learner conditions on)."""
    response_ids: list[int]
    """Everything after the prompt: model tokens and tool/environment tokens, in order."""
    response_mask: list[int]
    """Per response token: 1 = sampled by the model (trained on), 0 = tool/environment/template tokens."""
    response_logprobs: list[float]
    """Per response token: the server's logprob for mask-1 tokens, 0.0 for mask-0 tokens."""
    num_turns: int = Field(default=1, ge=0)
    """Assistant turns (generate calls) in the episode."""
    reward: float | None = None
    """Scalar reward; None until scored (the engine scores it if the loop did not)."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Numeric per-episode metrics (tool calls, turn counts, timings...)."""
    finish_reason: str = "stop"
    """Why the episode ended: stop, length, abort, a loop-specific limit name, or error."""
    error: str | None = None
    """`Type: message` when the episode failed; the record is still kept and counted."""
    weight_versions: list[str | None] = Field(default_factory=list)
    """Weight version that produced each turn (one entry per generate call; the version at its end)."""
    token_versions: list[int | None] = Field(default_factory=list)
    """Per response token: the weight version that sampled it (None for mask-0 tokens and where the
    server did not say). Empty when unknown (e.g. records of older runs)."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Anything else JSON-serializable a loop wants to keep (e.g. decoded text, tool trace)."""

    @model_validator(mode="after")
    def _invariants(self) -> "AgentLoopOutput":
        n = len(self.response_ids)
        if len(self.response_mask) != n or len(self.response_logprobs) != n:
            raise ValueError(
                f"response_ids ({n}), response_mask ({len(self.response_mask)}) and "
                f"response_logprobs ({len(self.response_logprobs)}) must have the same length"
            )
        for i, m in enumerate(self.response_mask):
            if m not in (0, 1):
                raise ValueError(f"response_mask[{i}] = {m!r}; mask values must be 0 or 1")
        for i, (m, lp) in enumerate(zip(self.response_mask, self.response_logprobs)):
            if m == 0 and lp != 0.0:
                raise ValueError(f"response_logprobs[{i}] = {lp!r} for a mask-0 token; it must be 0.0")
        if self.token_versions:
            if len(self.token_versions) != n:
                raise ValueError(f"token_versions ({len(self.token_versions)}) and response_ids ({n}) differ in length")
            for i, (m, v) in enumerate(zip(self.response_mask, self.token_versions)):
                if m == 0 and v is not None:
                    raise ValueError(f"token_versions[{i}] = {v!r} for a mask-0 token; it must be None")
        bad = json_problem(self.extra)
        if bad:
            raise ValueError(bad)
        return self

    @property
    def oldest_version(self) -> int | None:
        """The oldest weight version among the sampled tokens (None when unknown): what staleness judges."""
        vs = [v for v in self.token_versions if v is not None]
        return min(vs) if vs else None

    @property
    def num_model_tokens(self) -> int:
        return sum(self.response_mask)


class EpisodeRecord(AgentLoopOutput):
    episode_id: str
    """Unique id within a run: `<uid>-<repeat>` (see Sample.episode_id)."""
    index: int
    """Index of the data row."""
    uid: int | None = None
    """The dispatched prompt's uid (data-cursor position in training): the GRPO group key. None in
    records of older runs (the group key is then `index`)."""
    repeat: int
    """Repeat index of this episode within its group (0..n_samples-1)."""
    data_source: str
    """The row's data_source (selects the reward)."""
    loop: str
    """Registered name of the agent loop that ran it."""
    seed: int
    """Sampling seed of the episode."""
    ground_truth: Any = None
    """The row's reward_model.ground_truth, kept so a learner or re-scorer needs no data file."""
    reward_info: dict[str, Any] = Field(default_factory=dict)
    """Extra fields a reward function returned besides the score."""
    wall_s: float = 0.0
    """Wall time of the episode."""
    step: int | None = None
    """Training step that produced it (None for eval-only rollouts)."""


def write_record(fh, record: BaseModel) -> None:
    fh.write(record.model_dump_json() + "\n")


def read_records(path: str | Path) -> Iterator[EpisodeRecord]:
    """Read EpisodeRecord JSON lines; a bad line raises ValueError naming file and line."""
    p = Path(path)
    with p.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield EpisodeRecord.model_validate(json.loads(line))
            except Exception as e:  # noqa: BLE001 - re-raised with location
                raise ValueError(f"{p}:{lineno}: not a valid episode record: {e}") from None
