"""AgentLoopBase, the one class a loop author subclasses, and its helpers.

    AgentLoopBase        constructed per episode by the engine; write `async run(sample, sampling_params)`;
                         `effect` / `tool_call` journal an outside action so a resumed episode replays it
                         (agentloop.journal.tape), `resumable` / `restore` say whether the loop can be replayed
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
import weakref
from abc import ABC, abstractmethod
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

from agentloop.config import Config, SamplingParams, derive_seed
from agentloop.errors import ConfigError, PromptTooLongError
from agentloop.loops.env_tokens import encode_env_text
from agentloop.loops.template import TemplateInfo, template_info
from agentloop.records import AgentLoopOutput, Sample, TokenOutput
from agentloop.util.pacing import step_gate

if TYPE_CHECKING:
    from agentloop.server_manager import ServerManager


_WATCHED: contextvars.ContextVar[list["TrajectoryBuilder"] | None] = contextvars.ContextVar(
    "agentloop_trajectories", default=None)


_PROMPT_CACHE_SIZE = 4096
_PROMPT_CACHES: "weakref.WeakKeyDictionary[Any, OrderedDict[bytes, array]]" = weakref.WeakKeyDictionary()


def _prompt_cache(tokenizer: Any) -> "OrderedDict[bytes, array] | None":
    """Templated prompt ids by (messages, tools) for this tokenizer: a GRPO group's n episodes render and
    tokenize their prompt once (an LRU of the last `_PROMPT_CACHE_SIZE` prompts; None: not cacheable)."""
    try:
        cache = _PROMPT_CACHES.get(tokenizer)
        if cache is None:
            cache = _PROMPT_CACHES[tokenizer] = OrderedDict()
        return cache
    except TypeError:  # a tokenizer that cannot be weakly referenced
        return None


def watch_trajectories() -> list["TrajectoryBuilder"]:
    """From now on, every TrajectoryBuilder made in this task (and in tasks it starts) is appended to the
    returned list. The engine calls it per episode: when the episode's timeout cancels the loop, the
    last builder holds the turns it finished (whole generate calls and environment tokens), which are
    trained at the failure score rather than lost."""
    built: list[TrajectoryBuilder] = []
    _WATCHED.set(built)
    return built


_NO_VERSION = -(2 ** 63)
"""Stands for "version unknown" in a builder's per-token version buffer."""


class TrajectoryBuilder:
    """Response tokens in order, each with its mask and logprob, built where tokens are made.

    Model tokens (`add_model`) carry mask 1, the server's logprobs and the weight version that
    sampled each one; environment and template tokens (`add_env`) carry mask 0, logprob 0.0 and no version.
    Tokenize environment text for `add_env` with `AgentLoopBase.encode_env` (plain text: no control
    tokens can come out of it).

    Buffers are compact while the episode runs (prompt and response ids in one `array('i')`, masks in a
    bytearray, logprobs in an `array('d')`: 21 bytes per token instead of ~84 as lists of Python objects);
    `context()` is the next call's input without a copy. The list properties (`all_ids`, `prompt_ids`,
    `response_ids`, ...) are copies, and `build` makes the output's lists once, at the end.
    """

    def __init__(self, prompt_ids: Sequence[int], *, watch: list["TrajectoryBuilder"] | None = None):
        """`watch`: the list of the episode's builders to join (the engine's, see watch_trajectories); by
        default the one the current task's context holds. Code that serves an episode from another task
        context (the gateway's handlers) passes the episode's list explicitly."""
        self._ids = array("i", prompt_ids)  # prompt + response: the next call's input
        self._n_prompt = len(self._ids)
        self._mask = bytearray()
        self._lps = array("d")
        self._vers = array("q")
        self._any_version = False
        self.weight_versions: list[str | None] = []
        self.interrupted_calls = 0
        self.num_turns = 0
        watched = watch if watch is not None else _WATCHED.get()
        if watched is not None:
            watched.append(self)

    def add_model(self, out: TokenOutput) -> None:
        ids = out.token_ids
        n = len(ids)
        self._ids.extend(ids)
        self._mask.extend(b"\x01" * n)
        self._lps.extend(out.logprobs)
        self.weight_versions.append(out.weight_version)
        tv = out.token_versions
        if len(tv) == n and any(v is not None for v in tv):
            self._any_version = True
            self._vers.extend(_NO_VERSION if v is None else v for v in tv)
        else:
            self._vers.extend(array("q", (_NO_VERSION,)) * n)
        self.interrupted_calls += out.interrupted > 0
        self.num_turns += 1

    def add_env(self, token_ids: Sequence[int]) -> None:
        n = len(token_ids)
        self._ids.extend(token_ids)
        self._mask.extend(bytes(n))
        self._lps.extend(array("d", (0.0,)) * n)
        self._vers.extend(array("q", (_NO_VERSION,)) * n)

    @property
    def response_len(self) -> int:
        return len(self._ids) - self._n_prompt

    def __len__(self) -> int:
        """Prompt plus response tokens so far."""
        return len(self._ids)

    def next_turn(self, per_turn: int | None, max_response_tokens: int, context_length: int) -> tuple[int, str]:
        """How many tokens the next generation may make, and the limit that binds it ("length" |
        "token_budget" | "context"); `per_turn` None: no cap of its own (what is left of the budget and the
        context, verl's rule). (0, limit) when nothing is left: the limit is then the finish reason."""
        left = max_response_tokens - self.response_len
        room = context_length - len(self._ids)
        if left < 1 or room < 1:
            return 0, "token_budget" if left < 1 else "context"
        want = min(left, room) if per_turn is None else min(per_turn, left, room)
        return want, "length" if want == per_turn else ("token_budget" if want == left else "context")

    def env_limit(self, token_ids: Sequence[int], max_response_tokens: int, context_length: int) -> str | None:
        """The finish reason ("token_budget" | "context") if appending `token_ids` would reach a limit, else None."""
        if self.response_len + len(token_ids) >= max_response_tokens:
            return "token_budget"
        if len(self._ids) + len(token_ids) >= context_length:
            return "context"
        return None

    def context(self) -> array:
        """Prompt plus response so far, the next call's input_ids, without a copy (do not change it)."""
        return self._ids

    @property
    def all_ids(self) -> list[int]:
        """Prompt plus response so far (a list copy; `context()` is the same without one)."""
        return self._ids.tolist()

    @property
    def prompt_ids(self) -> list[int]:
        return self._ids[:self._n_prompt].tolist()

    @property
    def response_ids(self) -> list[int]:
        return self._ids[self._n_prompt:].tolist()

    @property
    def response_mask(self) -> list[int]:
        return list(self._mask)

    @property
    def response_logprobs(self) -> list[float]:
        return self._lps.tolist()

    @property
    def token_versions(self) -> list[int | None]:
        """Per response token (None: unknown); empty when no token's version is known."""
        if not self._any_version:
            return []
        return [None if v == _NO_VERSION else v for v in self._vers]

    @property
    def num_model_tokens(self) -> int:
        return self._mask.count(1)

    def build(self, **kwargs: Any) -> AgentLoopOutput:
        """The episode's output. The token fields are made here from buffers that hold the output's invariants
        by construction (equal lengths, masks 0/1, mask-0 logprobs 0.0 and versions None), so they are not
        validated again token by token; the other fields (`kwargs`) are."""
        if self.interrupted_calls:  # calls a weight update cut and the server manager continued
            kwargs["metrics"] = {**kwargs.get("metrics", {}), "interrupted_calls": float(self.interrupted_calls)}
        out = AgentLoopOutput(prompt_ids=[], response_ids=[], response_mask=[], response_logprobs=[], token_versions=[],
                              num_turns=self.num_turns, weight_versions=self.weight_versions, **kwargs)
        out.__dict__.update(prompt_ids=self.prompt_ids, response_ids=self.response_ids,
                            response_mask=self.response_mask, response_logprobs=self.response_logprobs,
                            token_versions=self.token_versions)
        return out


class AgentLoopBase(ABC):
    """Base class of agent loops. Subclass it, write `run`, register it with `register_agent_loop`.

    The engine constructs one instance per episode with keyword arguments
    `server_manager`, `tokenizer`, `config` (and `tools` for tool loops), then awaits
    `run(sample, sampling_params)` once. Exceptions raised by `run` become error records.
    """

    name: ClassVar[str] = ""
    """Registered name (set by register_agent_loop)."""
    resumable: ClassVar[bool] = False
    """Whether an episode of this loop can be continued from the journal (agentloop.journal) by replaying its
    effects: `run` is started again with the same sample and seed, and every `self.generate` /
    `self.server_manager.generate` call and every `self.effect` / `self.tool_call` is answered from the journal, in
    order, until it runs out; then the episode goes on live. True only for a loop whose run depends on nothing but
    those effects (the built-in loops). False (the default): a resumed episode restarts from scratch, counted;
    override `restore` for a loop with state elsewhere."""

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
        self.effects: Any = None
        """The episode's journal tape (agentloop.journal.tape.EpisodeTape), set by the engine when the run keeps a
        journal; None: effects simply run."""
        self.trajectories: list[TrajectoryBuilder] | None = _WATCHED.get()
        """The episode's builders (the engine sets it to its list, see watch_trajectories): code that builds
        trajectories outside the episode's task context (the gateway) appends to it explicitly."""
        ctx = config.model.context_length
        if ctx is None:
            ctx = getattr(tokenizer, "agentloop_context_length", None) or getattr(tokenizer, "model_max_length", None)
            if ctx is None or ctx > 10**7:  # HF uses a huge sentinel when unknown
                ctx = 32768
        self.context_length: int = int(ctx)

    @abstractmethod
    async def run(self, sample: Sample, sampling_params: SamplingParams) -> AgentLoopOutput:
        """Run one episode and return its output (reward may be left None for the engine to score)."""

    async def restore(self, sample: Sample, journaled: Any) -> bool:
        """Called before a journaled episode is continued (a resumed run, a dead server or rollout worker):
        return True to replay its journaled effects (see `resumable`), False to restart it from scratch. A loop that
        keeps state outside its effects (an environment of its own, files) rebuilds that state here, from
        `journaled` (agentloop.journal.reader.EpisodeLog: `replay()` lists the effects, in order), and returns True.
        Default: `resumable`."""
        return type(self).resumable

    async def effect(self, name: str, arguments: Any, run: Callable[[], Awaitable[Any]], *, idempotent: bool = False,
                     stateful: bool = False) -> Any:
        """Run an outside action (`await run()`, returning JSON data) through the journal: journaled as started
        before it runs and with its result after; replayed on a resume, its journaled result is returned without
        running it. `idempotent`: running it twice does no more than once (one running at a kill is then run
        again; otherwise the episode ends as an error record naming it). `stateful`: its result depends on
        earlier calls' (it is re-run on a replay to rebuild that state, which needs `idempotent`)."""
        if self.effects is None:
            return await run()
        return await self.effects.effect(name, arguments, run, idempotent=idempotent, stateful=stateful)

    async def tool_call(self, tool: Any, arguments: Any, run: Callable[[], Awaitable[Any]]) -> Any:
        """`effect` for a tool call: named by the tool, idempotent and stateful as its class says
        (BaseTool.idempotent, BaseTool.stateful)."""
        return await self.effect(f"tool:{tool.name}", arguments, run,
                                 idempotent=bool(getattr(tool, "idempotent", False)),
                                 stateful=bool(getattr(tool, "stateful", False)))

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
        cache = _prompt_cache(self.tokenizer)
        try:
            # the template and the render method are part of the key: a loop may override render_chat
            template = hash(getattr(self.tokenizer, "chat_template", None))
            key = orjson.dumps([messages, tools, add_generation_prompt, template,
                                f"{type(self).render_chat.__module__}.{type(self).render_chat.__qualname__}"])
        except TypeError:  # not JSON data (a loop's own message objects): rendered every time
            key = None
        ids = cache.get(key) if key is not None and cache is not None else None
        if ids is None:
            text = self.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt)
            ids = array("i", self.tokenizer.encode(text, add_special_tokens=False))
            if key is not None and cache is not None:
                cache[key] = ids
                if len(cache) > _PROMPT_CACHE_SIZE:
                    cache.popitem(last=False)
        elif cache is not None:
            cache.move_to_end(key)
        return ids.tolist()

    def raw_prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        """The single message's text tokenized without a template (no special tokens added)."""
        if tools:
            raise ConfigError("data.apply_chat_template=false sends the row's text as is, so the tools "
                              f"{[t['function']['name'] for t in tools]} cannot be offered; use the chat template")
        if len(messages) != 1 or not isinstance(messages[0].get("content"), str):
            raise ConfigError(f"data.apply_chat_template=false needs a prompt of exactly one text message, "
                              f"got {len(messages)} messages")
        return list(self.tokenizer.encode(messages[0]["content"], add_special_tokens=False))

    def template_info(self, *, check: bool = True) -> TemplateInfo:
        """The chat template's turn suffix, measured once per template (with `check`, the template is also
        verified append-only for tool turns: ConfigError if not). Multi-turn loops need it to splice turns."""
        key = self.template_key()

        def render(messages: list[dict[str, Any]], tools: list[dict] | None, gen: bool) -> str:
            return self.render_chat(messages, tools=tools, add_generation_prompt=gen)

        return template_info(render, check=check, cache_key=key)

    def template_key(self) -> str:
        """Names this loop's chat template (and how it renders) in caches of measurements made on it."""
        tmpl = getattr(self.tokenizer, "chat_template", None)
        render = type(self).render_chat
        return (f"{type(self.tokenizer).__name__}:{getattr(self.tokenizer, 'name_or_path', '')}:{hash(str(tmpl))}:"
                f"{render.__module__}.{render.__qualname__}")

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

    async def generate(self, episode_id: str, prompt_ids: Sequence[int], sampling_params: SamplingParams,
                       *, max_new_tokens: int | None = None) -> TokenOutput:
        """One server call, with the context-length budget applied."""
        wanted = max_new_tokens if max_new_tokens is not None else sampling_params.max_new_tokens
        budget = self.budget(len(prompt_ids), wanted)
        params = sampling_params if budget == sampling_params.max_new_tokens else sampling_params.model_copy(
            update={"max_new_tokens": budget})
        return await self.server_manager.generate(episode_id, prompt_ids=prompt_ids, sampling_params=params)

    async def pace(self) -> None:
        """Wait, if need be, for room in this event-loop iteration before a step of CPU work (agentloop.util.pacing):
        thousands of episodes finishing the same await at once then spread over iterations instead of blocking
        the loop for all of them. ServerManager.generate already does this after every answer."""
        await step_gate().enter()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)
