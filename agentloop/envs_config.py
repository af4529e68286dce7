"""EnvsConfig: settings of the environment-library adapters (mounted as `config.envs`; `agentloop train --env
LIB:SPEC` fills them in). Vocabulary: imports pydantic only.

    envs.verifiers       a verifiers environment module run by its own rollout code in its own virtualenv
                         (verifiers_loop: agentloop.loops.verifiers_env)
    envs.reasoning_gym   reasoning-gym tasks generated as the run's rows, scored by reasoning-gym
                         (agentloop.data.reasoning_gym, agentloop.rewards.reasoning_gym)
    envs.textarena       a TextArena game (textarena_loop: agentloop.loops.textarena_env)
    envs.openenv         an OpenEnv environment server by URL (openenv_loop: agentloop.loops.openenv_env)
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class VerifiersEnvConfig(_Section):
    env: str | None = None
    """The environment: an installed module's name (`vf-my-env` / `my_env`, as verifiers' own `load_environment`
    resolves it) or a `path/to/env.py` file; either defines `load_environment(**kwargs)` returning a verifiers
    Environment (SingleTurnEnv, MultiTurnEnv, ToolEnv, StatefulToolEnv, ...)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of `load_environment` (`envs.verifiers.args.num_train_examples=500`)."""
    python: str | None = None
    """The Python interpreter of a virtualenv holding verifiers (and the environment's own dependencies). None:
    the one `agentloop envs setup verifiers` built (~/.cache/agentloop/env-venvs, or $AGENTLOOP_ENV_VENVS)."""
    split: Literal["train", "eval"] = "train"
    """Which of the environment's datasets becomes the training rows (`dataset` or `eval_dataset`); the other one,
    when the environment has it, becomes the validation rows."""
    num_examples: int | None = Field(default=None, ge=1)
    """Use the first N examples of each dataset (None: all)."""
    workers: int = Field(default=1, ge=1)
    """Long-lived worker processes running the environment (each loads it once)."""
    worker_concurrency: int = Field(default=256, ge=1)
    """Episodes one worker runs at once (its rollouts are asyncio tasks)."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Wall-time limit of one rollout (the environment's own turns and tools included)."""
    sampling_args: dict[str, Any] = Field(default_factory=dict)
    """Sampling arguments the environment's client sends (the gateway applies only max_tokens lowering the cap
    and stop strings; the policy's sampling settings always apply)."""


class ReasoningGymEnvConfig(_Section):
    tasks: list[str] = Field(default_factory=list)
    """reasoning-gym dataset names (`basic_arithmetic`, `leg_counting`, ...): with `--env reasoning_gym:A,B` the
    run's training rows are `size` entries of each (seed `seed`), its validation rows `val_size` of each (seed
    `seed` + `size`: reasoning-gym draws entry i from seed + i, so these are not training entries), generated at
    start."""
    size: int = Field(default=2000, ge=1)
    """Training entries per task."""
    val_size: int = Field(default=32, ge=0)
    """Validation entries per task (0: none)."""
    seed: int = 0
    """Seed of the training entries (validation: seed + size)."""
    config: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Per task, its dataset config's keywords (`{"basic_arithmetic": {"max_terms": 3}}`)."""
    system_prompt: str | None = "default"
    """A name of reasoning-gym's SYSTEM_PROMPTS (default, DeepSeekZero, simple, direct, chain_of_draft), any other
    text as is, or null for no system message."""
    answer_format: Literal["answer_tag", "hashes"] = "answer_tag"
    """How the reward reads the answer: answer_tag, reasoning-gym's own extract_answer (the last
    <answer>...</answer>); hashes, the number after the last `####`."""
    tools: list[str] = Field(default_factory=list)
    """Tools every row offers (tools_kwargs), e.g. [calculator] with tool_agent_loop."""


class TextArenaEnvConfig(_Section):
    env_id: str = "Wordle-v0"
    """The TextArena environment (`textarena.make(env_id)`): Wordle-v0, TicTacToe-v0, GuessTheNumber-v0, ..."""
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of `textarena.make` (the game's own options, e.g. {"hardcore": false})."""
    num_players: int = Field(default=1, ge=1)
    """Players of the game: 1 for single-player games; 2 for a two-player game against `opponent`."""
    policy_player: int = Field(default=0, ge=0)
    """Which player id the policy plays (the opponent plays the other)."""
    opponent: Literal["first_valid", "random_valid"] = "first_valid"
    """The fixed opponent of a two-player game: first_valid plays the first move the game lists as valid (its
    observation's `[n]` / `[a1b2]` moves, read off the board as TextArena prints it); random_valid one of them at
    random (seeded per episode)."""
    max_turns: int = Field(default=16, ge=1)
    """Policy turns per episode; past it the game is cut (finish reason max_turns) and scored as TextArena
    scores an unfinished game at close (its rewards, or 0 when it gives none)."""
    max_tokens_per_turn: int | None = Field(default=None, ge=1)
    """New tokens per policy turn (None: sampling.max_new_tokens)."""
    max_response_tokens: int = Field(default=2048, ge=1)
    """Response tokens of the whole episode, policy and game (mask 0) together."""
    system_prompt: str | None = None
    """A system message before the game's first observation (None: none; TextArena's observation holds the rules)."""
    action_pattern: str | None = None
    """A regular expression (Python `re`) read off each policy turn's text: the action sent to the game is its
    last match (group 1 when the pattern has a group, else the whole match), e.g. `####\\s*(\\d+)` for a model
    that answers `#### n` (TextArena's action wrapper then brackets a bare `n` as `[n]`). None: the whole turn
    text, as TextArena's own LLM agents send theirs. A turn with no match sends its whole text, so the game judges
    it as it would without the pattern (an invalid move is penalised by the game's rules). Answer extraction on
    the agent's side, as reasoning-gym's extract_answer: the game is unchanged and the model's tokens stay as
    sampled (mask 1); only the action string passed to `env.step` changes. An invalid expression is a config
    error."""
    step_timeout_s: float = Field(default=60.0, gt=0)
    """Deadline of one game call (make, reset, get_observation, step, close), run in a thread."""
    episodes: int = Field(default=512, ge=1)
    """Rows (games, each seeded by its index) when the run has no data file (`--env textarena:GAME`)."""

    @field_validator("action_pattern")
    @classmethod
    def _pattern(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"envs.textarena.action_pattern {v!r} is not a valid regular expression: {e}") \
                    from None
        return v


class OpenEnvConfig(_Section):
    url: str | None = None
    """The OpenEnv server (http://host:port, as its users' EnvClient is given); its session protocol is the
    WebSocket at /ws (reset, step, state, close)."""
    action_field: str = "message"
    """The action's field that gets the model's text (the environment's Action class names it)."""
    action: dict[str, Any] = Field(default_factory=dict)
    """Further fields sent with every action."""
    observation_field: str | None = None
    """The observation's field shown to the model. None: the observation's only text field (an observation with
    none or several is an error record naming its fields)."""
    observation_role: Literal["user", "tool"] = "user"
    """The message role an observation is appended as (tool: rendered as a tool result by the chat template)."""
    reset: dict[str, Any] = Field(default_factory=dict)
    """Arguments of every reset (the row's extra_info["openenv"]["reset"] is added on top; `seed` is the episode's
    seed unless given)."""
    tools: list[str] = Field(default_factory=list)
    """Registered tools whose schemas the prompt offers (the environment, not agentloop, runs them: it gets the
    model's whole text)."""
    system_prompt: str | None = None
    """The system message of rows made for `--env openenv:URL` (None: a row is the reset observation alone)."""
    max_turns: int = Field(default=8, ge=1)
    """Steps per episode; past it the episode ends (finish reason max_turns)."""
    max_tokens_per_turn: int | None = Field(default=None, ge=1)
    """New tokens per step (None: sampling.max_new_tokens)."""
    max_response_tokens: int = Field(default=2048, ge=1)
    """Response tokens of the whole episode, model and observations (mask 0) together."""
    reward: Literal["sum", "last"] = "sum"
    """The episode's reward: the sum of the rewards of its steps, or the last one."""
    connect_timeout_s: float = Field(default=30.0, gt=0)
    """Deadline to open a session (the WebSocket handshake)."""
    message_timeout_s: float = Field(default=120.0, gt=0)
    """Deadline of one reset, step or close answer."""
    max_message_mb: float = Field(default=100.0, gt=0)
    """Largest message accepted from the server (OpenEnv's own client: 100 MB)."""
    episodes: int = Field(default=512, ge=1)
    """Rows (resets, each with seed = its index unless `reset` gives one) when the run has no data file."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"envs.openenv.url {v!r} must start with http://, https://, ws:// or wss://")
        return v.rstrip("/") if v else v


class EnvsConfig(_Section):
    verifiers: VerifiersEnvConfig = Field(default_factory=VerifiersEnvConfig)
    """A verifiers environment (verifiers_loop)."""
    reasoning_gym: ReasoningGymEnvConfig = Field(default_factory=ReasoningGymEnvConfig)
    """reasoning-gym tasks as rows and reward."""
    textarena: TextArenaEnvConfig = Field(default_factory=TextArenaEnvConfig)
    """A TextArena game (textarena_loop)."""
    openenv: OpenEnvConfig = Field(default_factory=OpenEnvConfig)
    """An OpenEnv server (openenv_loop)."""


__all__ = ["EnvsConfig", "OpenEnvConfig", "ReasoningGymEnvConfig", "TextArenaEnvConfig", "VerifiersEnvConfig"]
