"""ChatSession: one episode's conversation behind the gateway, kept as exact token ids.

Map:
    ChatSession.complete   one request: find the segment it extends (or start one), build the prompt
                           ids, generate through the ServerManager, parse tool calls, commit, answer
    ChatSession._extend    the environment tokens between the segment's last turn and the new request
    ChatSession.outputs    one AgentLoopOutput per segment, oldest first
    _Segment               one token sequence: a TrajectoryBuilder plus the history it covers, as the API
                           showed it (what a request must repeat) and as the template renders it

Exactness. The ids of an assistant turn this session produced are kept as sampled (mask 1, the server's
logprobs and per-token weight versions); when the harness sends that turn back in its next request it is
recognised by what the session answered (content and tool calls as the API showed them, arguments
compared as JSON values), never re-tokenized. What the request adds after it (tool results, user turns,
system notes) is environment: the chat template's text difference, template glue read with its control
tokens and message contents read as plain text (template.env_segments + env_tokens.encode_segments, the
tool loop's rule), mask 0. The template's end of the previous turn appears once: what the model emitted
of it ("<|im_end|>") is model tokens, the rest environment (template.turn_text).

Segments. A request extends a segment when its messages start with every message of that segment's
history (the last one this session's own answer), offer the same tools and add no assistant message;
the newest such segment is extended. Any other request (the harness compacted the history, dropped a
reasoning block, edited or re-sent a message, or runs a second conversation) starts a new segment:
its prompt is the chat template of the request's messages, tokenized whole as a data row's prompt is,
with assistant turns this session produced written as the model wrote them. Segments never change
once a later one starts; each becomes a record of the episode (same reward, same group).

Requests of one session are served one at a time (a lock): two in flight would race for the same
segment. Sampling knobs in a request never apply (the episode's sampling params are the policy's; a
difference is logged once and counted); its max_tokens may only lower the per-call cap
(agent.max_tokens_per_call, else sampling.max_new_tokens); its stop strings are added to the policy's
(they end a turn without changing any token's probability). A prompt that leaves no room in the
context is answered 400 context_length_exceeded. A failed generate call (servers down, retries spent)
is answered 503 and remembered in `failure`: the loop fails the episode with it.

Policy faults. What the policy did that a harness may fail on is remembered in `policy_faults`: a
conversation that overflowed the context, a turn cut at its token cap, a tool call the parser could not
read, a call of a tool the request did not offer or with arguments its schema refuses. When the agent then
fails, the loop makes the episode the policy's failure (AgentPolicyError, with its tokens) rather than the
infrastructure's.

Builders. Each segment's TrajectoryBuilder is appended to `watch` (the engine's list of the episode's
builders), passed explicitly: the gateway's handlers run in the gateway's context, not the episode's.

Simplification: a new segment's prompt is tokenized as a whole, control tokens included, like a data
row's prompt; only tokens appended to a segment get the plain-text rule for environment content.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentloop.config import SamplingParams
from agentloop.gateway.messages import ChatRequest, Completion, GatewayError, Message, ToolCall
from agentloop.gateway.server import log_once
from agentloop.loops.base import TrajectoryBuilder
from agentloop.loops.env_tokens import encode_segments
from agentloop.loops.template import env_segments, turn_text
from agentloop.records import AgentLoopOutput
from agentloop.tools.parsers import get_parser

if TYPE_CHECKING:
    from agentloop.loops.base import AgentLoopBase

_POLICY_KNOBS = ("temperature", "top_p", "top_k", "min_p")
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1}


@dataclass
class _Segment:
    builder: TrajectoryBuilder
    keys: list[tuple[Any, ...]]
    """Message keys of the history as the API showed it (request messages + this session's answers)."""
    template: list[dict[str, Any]]
    """The same history as the chat template renders it (this session's turns as the model wrote them)."""
    tools: list[dict[str, Any]] | None
    call_names: dict[str, str] = field(default_factory=dict)
    """Tool-call id -> function name (tool messages carry the name into the template)."""
    end_text: str = ""
    """The end-of-turn text the model emitted on the segment's last turn ("" if cut off)."""
    finish: str = "stop"
    """Finish reason of the segment's last turn (stop | length | abort)."""


class ChatSession:
    """The gateway's session backend for one episode of `loop` (an AgentLoopBase giving the server manager,
    tokenizer, chat template, context length and per-turn seeds)."""

    def __init__(self, loop: "AgentLoopBase", episode_id: str, sampling_params: SamplingParams, *,
                 parser: str = "hermes", check_template: bool = True, max_tokens_per_call: int | None = None,
                 watch: list[TrajectoryBuilder] | None = None):
        self.loop = loop
        self.watch = watch
        self.policy_faults: list[str] = []
        """What the policy did that a harness may fail on (see the module doc), in order."""
        self.episode_id = episode_id
        self.sp = sampling_params
        self.parse = get_parser(parser)
        self.info = loop.template_info(check=check_template)
        self.per_call = max_tokens_per_call or sampling_params.max_new_tokens
        self.segments: list[_Segment] = []
        self.produced: dict[tuple[Any, ...], str] = {}
        """Key of every assistant message this session answered -> the model's text of it."""
        self.calls = 0
        self.failure: BaseException | None = None
        """The first failure of a generate call (the loop fails the episode with it)."""
        self.last_content: str | None = None
        """Text of the last answer (what the data_source's reward scores when the agent gives no reward)."""
        self.aborted = False
        self._lock = asyncio.Lock()
        self.m: dict[str, float] = {k: 0.0 for k in (
            "requests", "segments", "turns", "tool_calls", "tool_calls_made", "parse_errors",
            "sampling_ignored", "context_exceeded", "invalid_tool_calls", "gen_time_s")}

    # ------------------------------------------------------------------ the backend

    async def complete(self, req: ChatRequest) -> Completion:
        async with self._lock:
            self.m["requests"] += 1
            return await self._complete(req)

    async def _complete(self, req: ChatRequest) -> Completion:
        if not req.messages or req.messages[-1].role == "assistant":
            raise GatewayError(400, "the last message is an assistant message: continuing a prefilled assistant "
                                    "turn is not supported (end the history with a user or tool message)",
                               param="messages")
        self._check_sampling(req)
        seg, new = self._find(req)
        if seg is not None:
            new_t = [self._template_message(m, seg.call_names) for m in new]
            env = self._extend(seg, new_t)
            prompt = seg.builder.all_ids + env
        else:
            names = {c.id: c.name for m in req.messages for c in m.tool_calls}
            new_t = [self._template_message(m, names) for m in req.messages]
            env = []
            text = self.loop.render_chat(new_t, tools=req.tools, add_generation_prompt=True)
            prompt = list(self.loop.tokenizer.encode(text, add_special_tokens=False))
        room = self.loop.context_length - len(prompt)
        if room < 1:
            self.m["context_exceeded"] += 1
            self.policy_faults.append(f"the conversation overflowed the context ({len(prompt)} tokens > "
                                      f"{self.loop.context_length})")
            raise GatewayError(400, f"the conversation is {len(prompt)} tokens; the model's context is "
                                    f"{self.loop.context_length} tokens", code="context_length_exceeded",
                               param="messages")
        want = min(self.per_call, req.max_tokens or self.per_call, room)
        stops = list(self.sp.stop) + [s for s in req.stop if s not in self.sp.stop]
        params = self.loop.turn_params(self.sp, self.calls).model_copy(update={"max_new_tokens": want, "stop": stops})
        t0 = time.monotonic()
        try:
            out = await self.loop.server_manager.generate(self.episode_id, prompt_ids=prompt, sampling_params=params)
        except Exception as e:
            if self.failure is None:
                self.failure = e
            raise
        self.m["gen_time_s"] += time.monotonic() - t0
        raw, end_text = turn_text(self.loop.decode, out.token_ids, out.finish_reason, self.info)
        completion = self._answer(req, raw, end_text, out.finish_reason, len(prompt), len(out.token_ids))
        # commit: nothing above changed the session, so a refused or failed request leaves it as it was
        if seg is None:
            seg = _Segment(TrajectoryBuilder(prompt, watch=self.watch), [m.key() for m in req.messages], new_t,
                           req.tools,
                           call_names={c.id: c.name for m in req.messages for c in m.tool_calls})
            self.segments.append(seg)
            self.m["segments"] += 1
        else:
            seg.builder.add_env(env)
            seg.keys += [m.key() for m in new]
            seg.template += new_t
            self.m["tool_calls"] += sum(m.role == "tool" for m in new)
        seg.builder.add_model(out)
        answer = completion.message()
        seg.keys.append(answer.key())
        seg.template.append({"role": "assistant", "content": raw})
        seg.call_names.update({c.id: c.name for c in completion.tool_calls})
        seg.end_text = end_text
        seg.finish = out.finish_reason
        self.produced[answer.key()] = raw
        self.last_content = completion.content
        self.calls += 1
        self.m["turns"] += 1
        self.m["tool_calls_made"] += len(completion.tool_calls)
        if out.finish_reason == "length":  # SDKs refuse a cut turn (the Responses API's status "incomplete")
            self.policy_faults.append(f"a turn cut at its token cap ({len(out.token_ids)} tokens)")
        if out.finish_reason == "abort":
            self.aborted = True
            raise GatewayError(503, "the inference server aborted this generation", kind="overloaded_error")
        return completion

    def _find(self, req: ChatRequest) -> tuple[_Segment | None, list[Message]]:
        """The newest segment the request extends, and the messages it adds (see the module doc)."""
        keys = [m.key() for m in req.messages]
        for seg in reversed(self.segments):
            n = len(seg.keys)
            if seg.tools == req.tools and len(keys) > n and keys[:n] == seg.keys \
                    and all(m.role != "assistant" for m in req.messages[n:]):
                return seg, req.messages[n:]
        return None, req.messages

    def _extend(self, seg: _Segment, new_t: list[dict[str, Any]]) -> list[int]:
        """Environment ids from the end of the segment's last model turn to the new generation prompt."""
        segments = env_segments(self._render, seg.template, new_t, seg.tools,
                                prefix=self.info.turn_suffix[len(seg.end_text):])
        return encode_segments(self.loop.tokenizer, segments)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict] | None, gen: bool) -> str:
        return self.loop.render_chat(messages, tools=tools, add_generation_prompt=gen)

    def _template_message(self, m: Message, names: dict[str, str]) -> dict[str, Any]:
        if m.role == "assistant":
            raw = self.produced.get(m.key())
            if raw is not None:
                return {"role": "assistant", "content": raw}
            msg: dict[str, Any] = {"role": "assistant", "content": m.content}
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments_value()}}
                                     for c in m.tool_calls]
            return msg
        if m.role == "tool":
            return {"role": "tool", "name": names.get(m.tool_call_id or "", ""), "content": m.content,
                    "tool_call_id": m.tool_call_id}
        return {"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}

    def _answer(self, req: ChatRequest, raw: str, end_text: str, finish: str, prompt_tokens: int,
                completion_tokens: int) -> Completion:
        """What the harness gets: tool calls parsed from the model's text (unless tool_choice is none or no
        tools were offered), the text outside them, the finish reason in the API's terms."""
        content, calls, stop_seq = raw, [], None
        if req.tools and req.tool_choice != "none":
            parsed = self.parse(raw)
            self.m["parse_errors"] += len(parsed.errors)
            if parsed.errors:
                self.policy_faults.append(f"a tool call that could not be parsed: {parsed.errors[0]}")
            for c in parsed.calls:
                problem = _call_problem(c.name, c.arguments, req.tools)
                if problem:
                    self.m["invalid_tool_calls"] += 1
                    self.policy_faults.append(problem)
            if parsed.calls:
                prefix = "toolu_" if req.api == "anthropic" else "call_"
                calls = [ToolCall(f"{prefix}{uuid.uuid4().hex[:24]}", c.name,
                                  json.dumps(c.arguments, ensure_ascii=False)) for c in parsed.calls]
                content = parsed.content
        if not calls and finish == "stop" and not end_text:
            stop_seq = next((s for s in req.stop if raw.endswith(s)), None)
            if stop_seq is not None:  # APIs leave the matched stop string out of the text
                content = raw[:len(raw) - len(stop_seq)]
        api_finish = "tool_calls" if calls else ("length" if finish == "length" else "stop")
        cid = {"openai": "chatcmpl-", "responses": "resp_"}.get(req.api, "msg_") + uuid.uuid4().hex[:24]
        return Completion(content=content, tool_calls=calls, finish=api_finish, prompt_tokens=prompt_tokens,
                          completion_tokens=completion_tokens, id=cid, stop_sequence=stop_seq)

    def _check_sampling(self, req: ChatRequest) -> None:
        policy = {k: getattr(self.sp, k) for k in _POLICY_KNOBS}
        differ = []
        for k, v in req.sampling.items():
            if k in policy:
                same = v == policy[k] or (k == "top_k" and v in (0, -1) and policy[k] in (0, -1))
            else:
                same = _NEUTRAL.get(k) == v
            if not same:
                differ.append(f"{k}={v!r}")
                knobs = ", ".join(f"{a}={b}" for a, b in policy.items())
                log_once(f"sampling:{k}", f"openai_agent_loop: a request sets {k}={v!r}; the training policy's "
                                          f"sampling ({knobs}) is used: requests never override it (logged once "
                                          "per setting)")
        if differ:
            self.m["sampling_ignored"] += 1

    # ------------------------------------------------------------------ results

    def outputs(self) -> list[AgentLoopOutput]:
        """One output per segment, oldest first (metrics and reward are the loop's to add)."""
        return [seg.builder.build(finish_reason=seg.finish,
                                  extra={"messages": seg.template,
                                         "response_text": self.loop.decode(seg.builder.response_ids)})
                for seg in self.segments]


def _call_problem(name: str, arguments: Any, tools: list[dict[str, Any]]) -> str | None:
    """Why a harness would refuse this parsed call (no such tool offered, arguments not an object or
    missing a required key), or None."""
    schema = next((t.get("function", {}) for t in tools if t.get("function", {}).get("name") == name), None)
    if schema is None:
        return f"a call of tool {name!r}, which the request did not offer"
    if not isinstance(arguments, dict):
        return f"a call of {name!r} whose arguments are not a JSON object"
    params = schema.get("parameters") or {}
    missing = [k for k in params.get("required") or [] if k not in arguments]
    if missing:
        return f"a call of {name!r} without its required argument(s) {missing}"
    return None


__all__ = ["ChatSession"]
