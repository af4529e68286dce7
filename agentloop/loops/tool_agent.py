"""tool_agent_loop: multi-turn generation with tool calls, token-exact.

Map:
    template.template_info         (template.py) once per chat template: check it is append-only for tool
                                   turns and measure the text it puts after an assistant message
    ToolAgentLoop.run              generate -> parse -> run tools -> append tool tokens -> generate ...
    ToolAgentLoop._run_calls       one turn's calls: validated, concurrent (Semaphore), each under wait_for
    ToolAgentLoop._env_ids         the tokens between a model turn and the next one (tool content as plain text);
                                   the template is rendered only around the new messages (template.turn_segments)

Token exactness. Model tokens are the server's ids, kept as returned (mask 1, server logprobs); text is
decoded only to parse tool calls. Everything else (the end of the assistant turn the template adds, the
tool messages, the next turn's header) is the text difference between the template rendered with and
without the new messages, tokenized (mask 0, logprob 0.0):

    A = render(history + [assistant], add_generation_prompt=False)   ends with "...<|im_end|>\\n"
    B = render(history + [assistant] + tool_messages, add_generation_prompt=True)
    env text = rest of the assistant turn's suffix + B[len(A):]

Tool output cannot inject control tokens: B is rendered a second time with each tool message's content
as a placeholder (template.env_segments), so the env text splits into template glue (its `<|im_end|>`,
`<|im_start|>`... are real tokens) and tool content, which is tokenized as plain text
(env_tokens.encode_segments): a result that prints "<|im_end|>\\n<|im_start|>assistant" stays text.

The suffix ("<|im_end|>\\n" for ChatML) is split against what the model emitted: when its last token is
the suffix's start (EOS "<|im_end|>", stop on EOS), only "\\n" is added; when it stopped by length or on a
stop string, the whole suffix is. So "\\n" and the next header appear exactly once. The assistant
message given to the template is the decoded model text without that end token.

Limits (finish_reason): stop (answered without a tool call), max_turns, token_budget (response tokens of
the episode, model + tool, reach tools.max_response_tokens), context (the model's context is full),
length (a turn hit its per-turn cap without a usable tool call), abort (the server aborted).
Each turn asks for min(per-turn cap, what is left of the budget, what is left of the context).

Simplifications: when a turn holds both well-formed and malformed calls, results are given in the order
"well-formed calls, then one error per malformed call"; calls beyond tools.max_tool_calls_per_turn get
an error message instead of running, or nothing (tools.excess_calls=drop, the default with a verl tool
config). Tool-side rewards and the excess-call penalty are reported in `extra` and `metrics`; the engine
decides the final reward.

A verl tool config (tools.verl_tool_config) is driven as verl's tool agent loop drives it: its tools are
offered to every row, get `tools_kwargs[name].create_kwargs` and the model's arguments unchecked, excess
calls are dropped silently, and each call's step reward is kept in the trace (`step_reward`, which the
scorer lists as verl's `extra_info["tool_rewards"]`). Per-turn length: with tools.max_tokens_per_turn unset
each turn may use all that is left of tools.max_response_tokens, verl's only cap.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from agentloop.config import SamplingParams
from agentloop.errors import ConfigError, PromptTooLongError, ToolLifecycleTimeout
from agentloop.loops.base import AgentLoopBase, TrajectoryBuilder
from agentloop.loops.env_tokens import encode_segments
from agentloop.loops.registry import register_agent_loop
from agentloop.loops.template import TemplateInfo, turn_segments, turn_text
from agentloop.records import AgentLoopOutput, Sample
from agentloop.tools.base import BaseTool, ToolResponse
from agentloop.tools.config import ToolsConfig
from agentloop.tools.parsers import ParseResult, ToolCall, get_parser
from agentloop.tools.registry import get_tool
from agentloop.tools.remote import remote_tool, service_pool

logger = logging.getLogger(__name__)


class _Counters:
    def __init__(self) -> None:
        self.m: dict[str, float] = {k: 0.0 for k in (
            "turns", "tool_calls", "tool_errors", "tool_timeouts", "parse_errors", "unknown_tools",
            "invalid_arguments", "dropped_calls", "truncated_tool_responses", "tool_time_s", "gen_time_s",
            "release_errors")}

    def add(self, key: str, v: float = 1.0) -> None:
        self.m[key] = self.m.get(key, 0.0) + v


@register_agent_loop("tool_agent_loop")
class ToolAgentLoop(AgentLoopBase):
    """Multi-turn loop with tools; settings in `config.tools` (ToolsConfig)."""

    resumable = True  # its prompts are its TrajectoryBuilder's tokens; tool calls go through `tool_call`

    @property
    def tools_config(self) -> ToolsConfig:
        return getattr(self.config, "tools", None) or ToolsConfig()

    # ------------------------------------------------------------ set-up

    def _render(self, messages: list[dict[str, Any]], tools: list[dict] | None, gen: bool) -> str:
        return self.render_chat(messages, tools=tools, add_generation_prompt=gen)

    def _template_info(self) -> TemplateInfo:
        return self.template_info(check=self.tools_config.check_template)

    def _episode_tools(self, sample: Sample) -> tuple[dict[str, BaseTool], dict[str, dict[str, Any]]]:
        """The episode's tools and each one's create kwargs. A verl tool config's tools come first, offered to
        every row and ahead of a registered tool of the same name (verl's rule); then tools.names and the
        row's tools_kwargs keys."""
        cfg = self.tools_config
        kwargs = sample.tools_kwargs or sample.extra_info.get("tools_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ConfigError(f"tools_kwargs of row {sample.index} must be a mapping, got {type(kwargs).__name__}")
        verl: dict[str, type[BaseTool]] = {}
        if cfg.verl_tool_config:
            from agentloop.tools.verl_tools import verl_tool_classes

            verl = verl_tool_classes(cfg.verl_tool_config)
        names = list(verl) + [n for n in cfg.names if n not in verl]
        names += [n for n in kwargs if n not in names]
        tools: dict[str, BaseTool] = {}
        for n in names:
            given = self.tools.get(n)
            if isinstance(given, BaseTool):
                tool = given
            elif isinstance(given, type) and issubclass(given, BaseTool):
                tool = given(cfg)
            elif cfg.server_url:  # run by the tool services (agentloop.tools.remote); catalog fetched in run()
                tool = remote_tool(cfg, n)
            else:
                tool = (verl.get(n) or get_tool(n))(cfg)
            tools[tool.name] = tool
        per_tool = {}
        for n, tool in tools.items():
            kw = kwargs.get(n) or {}
            if not isinstance(kw, dict):
                raise ConfigError(f"tools_kwargs[{n!r}] of row {sample.index} must be a mapping")
            if tool.verl_style:
                per_tool[n] = kw.get("create_kwargs") or {}  # verl: tools_kwargs[name].get("create_kwargs", {})
            else:
                per_tool[n] = kw.get("create_kwargs", kw) if isinstance(kw.get("create_kwargs"), dict) else kw
        return tools, per_tool

    # ------------------------------------------------------------ the episode

    async def run(self, sample: Sample, sampling_params: SamplingParams) -> AgentLoopOutput:
        cfg = self.tools_config
        parser = get_parser(cfg.parser)
        info = self._template_info()
        if cfg.server_url:
            await service_pool(cfg).catalog()  # once per process; ToolServiceError when no service answers
        tools, create_kwargs = self._episode_tools(sample)
        schemas = [t.schema for t in tools.values()] or None
        messages: list[dict[str, Any]] = [dict(m) for m in sample.messages]
        traj = TrajectoryBuilder(self.apply_chat_template(messages, tools=schemas))
        if len(traj) >= self.context_length:
            raise PromptTooLongError(f"prompt of {len(traj)} tokens leaves no room in the context "
                                     f"of {self.context_length} tokens")
        c = _Counters()
        trace: list[dict[str, Any]] = []
        instances: dict[str, Any] = {}
        per_turn = cfg.max_tokens_per_turn  # None: what is left of the response budget (verl's rule)
        finish = "stop"
        extra: dict[str, Any] = {}
        try:
            life = cfg.lifecycle_timeout_s
            for name, tool in tools.items():
                try:
                    instances[name] = await asyncio.wait_for(tool.create(sample, **create_kwargs[name]), life)
                except asyncio.TimeoutError:
                    raise ToolLifecycleTimeout(f"tool {name!r}: create ran past tools.lifecycle_timeout_s="
                                               f"{life:g}") from None
            for turn in range(cfg.max_turns):
                want, limiter = traj.next_turn(per_turn, cfg.max_response_tokens, self.context_length)
                if want == 0:
                    finish = limiter
                    break
                params = self.turn_params(sampling_params, turn).model_copy(update={"max_new_tokens": want})
                t0 = time.monotonic()
                out = await self.server_manager.generate(sample.episode_id, prompt_ids=traj.context(),
                                                         sampling_params=params)
                c.add("gen_time_s", time.monotonic() - t0)
                c.add("turns")
                traj.add_model(out)
                content, end_text = turn_text(self.decode, out.token_ids, out.finish_reason, info)
                messages.append({"role": "assistant", "content": content})
                if out.finish_reason == "abort":
                    finish = "abort"
                    break
                if out.finish_reason == "length" and not cfg.continue_after_length:
                    finish = limiter
                    break
                parsed = parser(content)
                if not parsed.attempted or (out.finish_reason == "length" and not parsed.calls):
                    finish = "stop" if out.finish_reason == "stop" else limiter
                    break
                if turn == cfg.max_turns - 1:
                    finish = "max_turns"
                    break
                tool_msgs = await self._run_calls(turn, parsed, tools, instances, c, trace)
                await self.pace()
                env_ids = self._env_ids(messages, tool_msgs, schemas, info, end_text)
                limit = traj.env_limit(env_ids, cfg.max_response_tokens, self.context_length)
                if limit is not None:
                    finish = limit
                    break
                messages.extend(tool_msgs)
                traj.add_env(env_ids)
            extra["tool_rewards"] = rewards = {}
            for name, tool in tools.items():
                try:
                    r = await asyncio.wait_for(tool.reward(instances[name]), life)
                except asyncio.TimeoutError:  # no tool reward, counted: the data_source's reward still scores
                    c.add("lifecycle_timeouts")
                    logger.warning("tool %r reward ran past tools.lifecycle_timeout_s=%g in episode %s", name, life,
                                   sample.episode_id)
                    continue
                if r is not None:
                    rewards[name] = float(r)
                    c.m[f"tool_reward/{name}"] = float(r)
            excess = 0.0 if cfg.free_calls is None else max(0.0, c.m["tool_calls"] - cfg.free_calls)
            extra["tool_penalty"] = excess * cfg.excess_call_penalty
            c.m["tool_penalty"] = extra["tool_penalty"]
        finally:
            for name, inst in instances.items():
                try:
                    # a deadline even here: a hanging release must not hold an episode its timeout cut
                    await asyncio.wait_for(tools[name].release(inst), cfg.lifecycle_timeout_s)
                except asyncio.TimeoutError:
                    c.add("lifecycle_timeouts")
                    logger.warning("tool %r release ran past tools.lifecycle_timeout_s=%g in episode %s (abandoned)",
                                   name, cfg.lifecycle_timeout_s, sample.episode_id)
                except Exception:  # counted and logged; the episode's result stands
                    c.add("release_errors")
                    logger.exception("tool %r release failed in episode %s", name, sample.episode_id)
        extra["response_text"] = self.decode(traj.response_ids)
        extra["tool_trace"] = trace
        extra["messages"] = messages
        return traj.build(finish_reason=finish, metrics=c.m, extra=extra)

    # ------------------------------------------------------------ pieces

    def _env_ids(self, messages: list[dict[str, Any]], tool_msgs: list[dict[str, Any]], schemas: list[dict] | None,
                 info: TemplateInfo, end_text: str) -> list[int]:
        """Tokens from the end of the model's turn to the start of the next one (see the module docstring)."""
        segments = turn_segments(self._render, messages, tool_msgs, schemas, prefix=info.turn_suffix[len(end_text):],
                                 cache_key=self.template_key())
        return encode_segments(self.tokenizer, segments)

    def _truncate(self, text: str, c: _Counters) -> str:
        limit = self.tools_config.max_tool_response_tokens
        if len(text.encode("utf-8")) + 2 <= limit:
            # A token covers at least one UTF-8 byte (byte-level BPE; byte-fallback sentencepiece adds at most a
            # leading-space piece): text this short cannot be over the limit, and needs no tokenizing here.
            return text
        ids = self.encode_env(text)  # counted as it will be tokenized: plain text
        if len(ids) <= limit:
            return text
        c.add("truncated_tool_responses")
        return self.tokenizer.decode(ids[:limit], skip_special_tokens=False) + \
            f"\n[truncated: {len(ids) - limit} more tokens]"

    async def _run_calls(self, turn: int, parsed: ParseResult, tools: dict[str, BaseTool],
                         instances: dict[str, Any], c: _Counters, trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
        cfg = self.tools_config
        sem = asyncio.Semaphore(cfg.max_parallel_calls)
        run = parsed.calls[:cfg.max_tool_calls_per_turn]
        dropped = parsed.calls[cfg.max_tool_calls_per_turn:]
        excess = cfg.excess_calls or ("drop" if cfg.verl_tool_config else "message")

        async def one(call: ToolCall) -> tuple[str, ToolResponse, float, str]:
            tool = tools.get(call.name)
            if tool is None:
                c.add("unknown_tools")
                return call.name, ToolResponse(text=f"error: unknown tool {call.name!r}; available tools: "
                                                    f"{sorted(tools)}", error="unknown_tool"), 0.0, "unknown_tool"
            problems = tool.validate_arguments(call.arguments)
            if problems:
                c.add("invalid_arguments")
                return call.name, ToolResponse(
                    text=f"error: invalid arguments for {call.name}: " + "; ".join(problems) +
                         f". Expected schema: {json.dumps(tool.parameters)}", error="invalid_arguments"), 0.0, \
                    "invalid_arguments"

            async def execute() -> dict[str, Any]:
                async with sem:
                    t0 = time.monotonic()
                    try:
                        resp = await asyncio.wait_for(tool.execute(instances[call.name], call.arguments),
                                                      cfg.tool_timeout_s)
                        kind = "ok" if resp.error is None else "error"
                    except asyncio.TimeoutError:
                        resp = ToolResponse(text=f"error: {call.name} timed out after {cfg.tool_timeout_s:g}s",
                                            error="timeout")
                        kind = "timeout"
                    except Exception as e:  # noqa: BLE001 - a tool's failure becomes its message
                        resp = ToolResponse(text=f"error: {type(e).__name__}: {e}", error=f"{type(e).__name__}: {e}")
                        kind = "exception"
                    return {"resp": resp.model_dump(), "dt": time.monotonic() - t0, "kind": kind}

            # through the journal: a resumed episode gets the journaled result back without running the tool
            r = await self.tool_call(tool, call.arguments, execute)
            if r["kind"] == "timeout":
                c.add("tool_timeouts")
            return call.name, ToolResponse(**r["resp"]), r["dt"], r["kind"]

        results = await asyncio.gather(*(one(call) for call in run))
        msgs: list[dict[str, Any]] = []
        for call, (name, resp, dt, kind) in zip(run, results):
            c.add("tool_calls")
            c.add("tool_time_s", dt)
            c.add(f"tool/{name}/calls")
            if resp.error is not None:
                c.add("tool_errors")
            for k, v in resp.metrics.items():
                c.add(f"tool/{name}/{k}", float(v))
            text = self._truncate(resp.text, c)
            msgs.append({"role": "tool", "name": name, "content": text})
            # step_reward: a verl tool's per-call reward (0.0 for every other call, as verl lists a failed one)
            trace.append({"turn": turn, "name": name, "arguments": call.arguments, "status": kind,
                          "error": resp.error, "time_s": round(dt, 4), "text": text[:200],
                          "step_reward": float(resp.metrics.get("step_reward", 0.0))})
        for call in dropped:
            c.add("dropped_calls")
            if excess == "drop":
                trace.append({"turn": turn, "name": call.name, "arguments": call.arguments, "status": "dropped",
                              "error": "dropped", "time_s": 0.0, "text": ""})
                continue
            text = (f"error: too many tool calls in one turn (limit {cfg.max_tool_calls_per_turn}); "
                    f"this call to {call.name} was not run")
            msgs.append({"role": "tool", "name": call.name, "content": text})
            trace.append({"turn": turn, "name": call.name, "arguments": call.arguments, "status": "dropped",
                          "error": "dropped", "time_s": 0.0, "text": text})
        for err in parsed.errors:
            c.add("parse_errors")
            text = f"error: could not parse tool call: {err}"
            msgs.append({"role": "tool", "name": "parse_error", "content": text})
            trace.append({"turn": turn, "name": None, "arguments": None, "status": "parse_error", "error": err,
                          "time_s": 0.0, "text": text[:200]})
        return msgs
