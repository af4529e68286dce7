"""AgentLoopBase, the one class a loop author subclasses, and its helpers.

    AgentLoopBase        constructed per episode by the engine; write `async run(sample, sampling_params)`
    TrajectoryBuilder    accumulates response tokens with masks/logprobs where they are made
    watch_trajectories   the engine's hook: the builders an episode makes, so one cut by its timeout
                         still has the turns it finished

A loop talks to servers only through `self.generate(...)` (token ids in, token ids out),
so everything it returns is exactly what the model sampled or what the environment added.
Environment text (tool output, observations) is tokenized with `self.encode_env(text)`: as plain
text, so a control token's string in it (say "<|im_end|>") can never become the real token
(agentloop.loops.env_tokens); template glue around it comes from the chat template.
"""

from __future__ import annotations

import contextvars
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from agentloop.config import Config, SamplingParams, derive_seed
from agentloop.errors import ConfigError, PromptTooLongError
from agentloop.loops.env_tokens import encode_env_text
from agentloop.records import AgentLoopOutput, Sample, TokenOutput

if TYPE_CHECKING:
    from agentloop.server_manager import ServerManager


_WATCHED: contextvars.ContextVar[list["TrajectoryBuilder"] | None] = contextvars.ContextVar(
    "agentloop_trajectories", default=None)


def watch_trajectories() -> list["TrajectoryBuilder"]:
    """From now on, every TrajectoryBuilder made in this task (and in tasks it starts) is appended to the
    returned list. The engine calls it per episode: when the episode's timeout cancels the loop, the
    last builder holds the turns it finished (whole generate calls and environment tokens), which are
    trained at the failure score rather than lost."""
    built: list[TrajectoryBuilder] = []
    _WATCHED.set(built)
    return built


class TrajectoryBuilder:
    """Response tokens in order, each with its mask and logprob, built where tokens are made.

    Model tokens (`add_model`) carry mask 1, the server's logprobs and the weight version that
    sampled each one; environment and template tokens (`add_env`) carry mask 0, logprob 0.0 and no version.
    Tokenize environment text for `add_env` with `AgentLoopBase.encode_env` (plain text: no control
    tokens can come out of it).
    """

    def __init__(self, prompt_ids: list[int]):
        self.prompt_ids = list(prompt_ids)
        self.response_ids: list[int] = []
        self.response_mask: list[int] = []
        self.response_logprobs: list[float] = []
        self.weight_versions: list[str | None] = []
        self.token_versions: list[int | None] = []
        self.interrupted_calls = 0
        self.num_turns = 0
        watched = _WATCHED.get()
        if watched is not None:
            watched.append(self)

    def add_model(self, out: TokenOutput) -> None:
        self.response_ids.extend(out.token_ids)
        self.response_mask.extend([1] * len(out.token_ids))
        self.response_logprobs.extend(float(x) for x in out.logprobs)
        self.weight_versions.append(out.weight_version)
        tv = out.token_versions if len(out.token_versions) == len(out.token_ids) else [None] * len(out.token_ids)
        self.token_versions.extend(tv)
        self.interrupted_calls += out.interrupted > 0
        self.num_turns += 1

    def add_env(self, token_ids: list[int]) -> None:
        self.response_ids.extend(token_ids)
        self.response_mask.extend([0] * len(token_ids))
        self.response_logprobs.extend([0.0] * len(token_ids))
        self.token_versions.extend([None] * len(token_ids))

    def next_turn(self, per_turn: int | None, max_response_tokens: int, context_length: int) -> tuple[int, str]:
        """How many tokens the next generation may make, and the limit that binds it ("length" |
        "token_budget" | "context"); `per_turn` None: no cap of its own (what is left of the budget and the
        context, verl's rule). (0, limit) when nothing is left: the limit is then the finish reason."""
        left = max_response_tokens - len(self.response_ids)
        room = context_length - len(self.all_ids)
        if left < 1 or room < 1:
            return 0, "token_budget" if left < 1 else "context"
        want = min(left, room) if per_turn is None else min(per_turn, left, room)
        return want, "length" if want == per_turn else ("token_budget" if want == left else "context")

    def env_limit(self, token_ids: list[int], max_response_tokens: int, context_length: int) -> str | None:
        """The finish reason ("token_budget" | "context") if appending `token_ids` would reach a limit, else None."""
        if len(self.response_ids) + len(token_ids) >= max_response_tokens:
            return "token_budget"
        if len(self.all_ids) + len(token_ids) >= context_length:
            return "context"
        return None

    @property
    def all_ids(self) -> list[int]:
        """Prompt plus response so far: the next call's input_ids."""
        return self.prompt_ids + self.response_ids

    @property
    def num_model_tokens(self) -> int:
        return sum(self.response_mask)

    def build(self, **kwargs: Any) -> AgentLoopOutput:
        if self.interrupted_calls:  # calls a weight update cut and the server manager continued
            kwargs["metrics"] = {**kwargs.get("metrics", {}), "interrupted_calls": float(self.interrupted_calls)}
        return AgentLoopOutput(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            response_mask=self.response_mask,
            response_logprobs=self.response_logprobs,
            num_turns=self.num_turns,
            weight_versions=self.weight_versions,
            token_versions=self.token_versions if any(v is not None for v in self.token_versions) else [],
            **kwargs,
        )


class AgentLoopBase(ABC):
    """Base class of agent loops. Subclass it, write `run`, register it with `register_agent_loop`.

    The engine constructs one instance per episode with keyword arguments
    `server_manager`, `tokenizer`, `config` (and `tools` for tool loops), then awaits
    `run(sample, sampling_params)` once. Exceptions raised by `run` become error records.
    """

    name: ClassVar[str] = ""
    """Registered name (set by register_agent_loop)."""

    def __init__(
        self,
        *,
        server_manager: "ServerManager",
        tokenizer: Any,
        config: Config,
        tools: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.config = config
        self.tools = tools or {}
        self.extra_kwargs = kwargs
        ctx = config.model.context_length
        if ctx is None:
            ctx = getattr(tokenizer, "agentloop_context_length", None) or getattr(tokenizer, "model_max_length", None)
            if ctx is None or ctx > 10**7:  # HF uses a huge sentinel when unknown
                ctx = 32768
        self.context_length: int = int(ctx)

    @abstractmethod
    async def run(self, sample: Sample, sampling_params: SamplingParams) -> AgentLoopOutput:
        """Run one episode and return its output (reward may be left None for the engine to score)."""

    # ------------------------------------------------------------ helpers for loop authors

    def render_chat(self, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """The chat template rendered as text (for diffing and display; never for generated tokens)."""
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        if tools:
            kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the chat template applied to `messages` (done once per episode); with
        `data.apply_chat_template` false, the one message's text as is (TinyZero's raw prompts)."""
        if not self.config.data.apply_chat_template:
            return self.raw_prompt_ids(messages, tools)
        text = self.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def raw_prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        """The single message's text tokenized without a template (no special tokens added)."""
        if tools:
            raise ConfigError("data.apply_chat_template=false sends the row's text as is, so the tools "
                              f"{[t['function']['name'] for t in tools]} cannot be offered; use the chat template")
        if len(messages) != 1 or not isinstance(messages[0].get("content"), str):
            raise ConfigError(f"data.apply_chat_template=false needs a prompt of exactly one text message, "
                              f"got {len(messages)} messages")
        return list(self.tokenizer.encode(messages[0]["content"], add_special_tokens=False))

    def encode_env(self, text: str) -> list[int]:
        """Token ids of environment text for `TrajectoryBuilder.add_env`: read as plain text, so a tool
        or environment that prints "<|im_end|>" (or any control token of the tokenizer and its chat
        template) adds those characters, never the token; the ids decode back to exactly `text`."""
        return encode_env_text(self.tokenizer, text)

    def budget(self, prompt_len: int, wanted: int) -> int:
        """New-token budget for a call: `wanted`, capped by what is left of the context.

        Raises PromptTooLongError when not even one new token fits.
        """
        room = self.context_length - prompt_len
        if room < 1:
            raise PromptTooLongError(
                f"prompt of {prompt_len} tokens leaves no room in the context of {self.context_length} tokens"
            )
        return max(1, min(wanted, room))

    def turn_params(self, sampling_params: SamplingParams, turn: int) -> SamplingParams:
        """Per-turn sampling params: the episode seed is re-derived per turn so turns differ yet replay."""
        if sampling_params.seed is None or turn == 0:
            return sampling_params
        return sampling_params.model_copy(update={"seed": derive_seed(sampling_params.seed, "turn", turn)})

    async def generate(self, episode_id: str, prompt_ids: list[int], sampling_params: SamplingParams,
                       *, max_new_tokens: int | None = None) -> TokenOutput:
        """One server call, with the context-length budget applied."""
        wanted = max_new_tokens if max_new_tokens is not None else sampling_params.max_new_tokens
        budget = self.budget(len(prompt_ids), wanted)
        params = sampling_params if budget == sampling_params.max_new_tokens else sampling_params.model_copy(
            update={"max_new_tokens": budget})
        return await self.server_manager.generate(episode_id, prompt_ids=prompt_ids, sampling_params=params)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)
