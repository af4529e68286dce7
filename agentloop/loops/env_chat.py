"""EnvChat: one episode's conversation with a text environment (a game, an environment server), token-exact.

The loops that drive an environment library (textarena_loop, openenv_loop) share it: the model's turns are
the server's ids (mask 1, its logprobs and weight versions); each observation the environment returns is a
message (role `user`, or `tool` for a tool-style result) whose tokens are the chat template's difference
with and without it, the message's content read as plain text (mask 0: an observation that prints
"<|im_end|>" stays text), exactly as tool_agent_loop appends tool results (template.turn_segments,
env_tokens.encode_segments). The end of the assistant turn appears once (template.turn_text).

    chat = EnvChat(loop, messages, tools=None)      prompt = the chat template of `messages`
    out, text = await chat.model_turn(sample, params, turn, per_turn, budget)    None, "" when a limit binds
    limit = chat.add_observation(text, role)        None, or the finish reason when appending would reach a limit
    chat.build(finish_reason=..., reward=..., metrics=..., extra=...)

Budgets: a turn may use min(per_turn, what is left of `budget` response tokens, what is left of the context);
an observation that would reach the budget or the context ends the episode with that finish reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentloop.config import SamplingParams
from agentloop.errors import PromptTooLongError
from agentloop.loops.base import TrajectoryBuilder
from agentloop.loops.env_tokens import encode_segments
from agentloop.loops.template import turn_segments, turn_text
from agentloop.records import AgentLoopOutput, Sample, TokenOutput

if TYPE_CHECKING:
    from agentloop.loops.base import AgentLoopBase


class EnvChat:
    """See the module doc."""

    def __init__(self, loop: "AgentLoopBase", messages: list[dict[str, Any]], *, tools: list[dict] | None = None):
        self.loop = loop
        self.messages = [dict(m) for m in messages]
        self.tools = tools or None
        self.info = loop.template_info()
        self.traj = TrajectoryBuilder(loop.apply_chat_template(self.messages, tools=self.tools))
        if len(self.traj) >= loop.context_length:
            raise PromptTooLongError(f"prompt of {len(self.traj)} tokens leaves no room in the context "
                                     f"of {loop.context_length} tokens")
        self._end_text = ""
        self.limit: str | None = None
        """Why the last model_turn made nothing ("token_budget" | "context"), or the limit its cap hit."""

    def _render(self, messages: list[dict[str, Any]], tools: list[dict] | None, gen: bool) -> str:
        return self.loop.render_chat(messages, tools=tools, add_generation_prompt=gen)

    async def model_turn(self, sample: Sample, sampling_params: SamplingParams, turn: int, per_turn: int | None,
                         budget: int) -> tuple[TokenOutput | None, str]:
        """Generate the next assistant turn: (the server's output, its text without the end token). (None, "")
        when no token fits (`self.limit` says which limit)."""
        want, self.limit = self.traj.next_turn(per_turn, budget, self.loop.context_length)
        if want == 0:
            return None, ""
        params = self.loop.turn_params(sampling_params, turn).model_copy(update={"max_new_tokens": want})
        out = await self.loop.server_manager.generate(sample.episode_id, prompt_ids=self.traj.context(),
                                                      sampling_params=params)
        self.traj.add_model(out)
        content, self._end_text = turn_text(self.loop.decode, out.token_ids, out.finish_reason, self.info)
        self.messages.append({"role": "assistant", "content": content})
        return out, content

    def add_observation(self, text: str, role: str, budget: int) -> str | None:
        """Append the environment's `text` as a `role` message (mask 0). Returns None, or the finish reason
        ("token_budget" | "context") when it would reach a limit (then nothing is appended)."""
        msg = {"role": role, "content": text}
        segments = turn_segments(self._render, self.messages, [msg], self.tools,
                                 prefix=self.info.turn_suffix[len(self._end_text):], cache_key=self.loop.template_key())
        ids = encode_segments(self.loop.tokenizer, segments)
        limit = self.traj.env_limit(ids, budget, self.loop.context_length)
        if limit is not None:
            return limit
        self.messages.append(msg)
        self.traj.add_env(ids)
        return None

    def build(self, **kwargs: Any) -> AgentLoopOutput:
        extra = dict(kwargs.pop("extra", {}) or {})
        extra.setdefault("response_text", self.loop.decode(self.traj.response_ids))
        extra.setdefault("messages", self.messages)
        return self.traj.build(extra=extra, **kwargs)


__all__ = ["EnvChat"]
