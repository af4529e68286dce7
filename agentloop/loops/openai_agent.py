"""openai_agent_loop: your own agent (OpenAI SDK, Anthropic SDK, any harness), trained through the gateway.

Map:
    OpenAIAgentLoop.run    per episode: open a gateway session (agentloop.gateway.server), run the agent
                           under agent.timeout_s and the agent.max_concurrency cap, close the session, return
                           its segments with the agent's reward
    _run_entry             agent.entry: `await fn(sample, base_url, api_key)` in this process
    _run_command           agent.command: one process group per episode (agentloop.loops.agent_command), or
                           with agent.workers, an episode sent to a long-lived worker (agentloop.loops.agent_workers)
    load_entry             `file.py:fn` / `package.module:fn` -> the async function (imported once)
    agent_reward           what the agent returned -> (reward or None, extra)

The episode's tokens are what the gateway's session recorded (agentloop.loops.chat_session): model
turns as sampled, everything else as mask-0 environment tokens. Reward: the agent's (a float, or
{"reward": x, ...}; a command writes it as JSON on the file descriptor AGENTLOOP_RESULT_FD names, a channel
the model's text cannot reach, never stdout), else the data_source's reward scores the text of the last
assistant message (verl's convention; `extra["solution_str"]`). The agent gets the task without its answer
(no ground_truth, extra_info or tools_kwargs) unless agent.send_answer.

Segments: when the agent's history stops extending the session's (compaction, an edited message, a
second conversation), the session starts a new segment. The loop returns the first segment (with the
episode's metrics and scoring text) and the later ones in `segments`; the engine writes one record per
segment (`segment` 0, 1, ...), all with the episode's reward, group and episode id; the learner gives
each the episode's advantage, computed once per episode.

Failures, each an error record (counted). The policy's, kept with the tokens the session recorded and
trained at reward.failure_score: the agent ran past agent.timeout_s (AgentTimeoutError: cancelled, its
process group killed), or it failed after the policy overflowed the context or made a tool call the
harness cannot use (AgentPolicyError; the session's `policy_faults`). The infrastructure's (its group left
out of training): the agent raised, its command exited non-zero or wrote a malformed result (AgentError)
with no policy fault seen, it made no request; a generate call that failed behind a request fails the
episode with that error (AllServersDownError still stops the run). An entry function must not block the
event loop (use a command for blocking code).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from agentloop.config import SamplingParams
from agentloop.errors import AgentError, AgentTimeoutError, ConfigError
from agentloop.gateway.server import Gateway, SessionHandle, gateway_for
from agentloop.loops.agent_command import read_result, run_command
from agentloop.loops.agent_workers import worker_pool
from agentloop.loops.base import AgentLoopBase
from agentloop.loops.chat_session import ChatSession
from agentloop.loops.registry import register_agent_loop
from agentloop.records import AgentLoopOutput, Sample
from agentloop.util.cache import import_python_file

AgentFn = Callable[[Sample, str, str], Awaitable[Any]]

_CANCEL_WAIT_S = 5.0
"""How long a timed-out entry function gets to finish after it is cancelled."""

_ENTRIES: dict[str, AgentFn] = {}


def load_entry(ref: str) -> AgentFn:
    """`path/to/file.py:fn` or `package.module:fn` -> the async function (a file is imported once)."""
    if ref in _ENTRIES:
        return _ENTRIES[ref]
    target, sep, attr = ref.strip().rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(f"agent.entry={ref!r} must look like 'path/to/file.py:fn' or 'package.module:fn'")
    try:
        if target.endswith(".py") or "/" in target:
            if not Path(target).is_file():
                raise ConfigError(f"agent.entry={ref!r}: file {target!r} does not exist")
            module = import_python_file(Path(target), "agentloop_agent")
        else:
            module = importlib.import_module(target)
    except ConfigError:
        raise
    except Exception as e:  # re-raised naming the entry
        raise ConfigError(f"agent.entry={ref!r}: importing {target!r} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"agent.entry={ref!r}: {attr!r} must be an async function "
                          "`async def fn(sample, base_url, api_key)`, got " + type(fn).__name__)
    _ENTRIES[ref] = fn
    return fn


_TASK_FIELDS = ("index", "uid", "repeat", "attempt", "data_source", "messages", "ability")
"""What an agent gets of its sample unless agent.send_answer: the task, never what holds the answer
(ground_truth, and extra_info / tools_kwargs, where verl rows also keep it)."""


def task_payload(sample: Sample, send_answer: bool = False) -> dict[str, Any]:
    """A command's stdin: the task (with its episode_id), or the whole sample with `send_answer`."""
    body = sample.model_dump(mode="json") if send_answer else sample.model_dump(mode="json", include=set(_TASK_FIELDS))
    return {**body, "episode_id": sample.episode_id}


def agent_sample(sample: Sample, send_answer: bool = False) -> Sample:
    """An entry function's `sample`: a copy, without ground_truth, extra_info and tools_kwargs unless
    `send_answer`."""
    if send_answer:
        return sample.model_copy(deep=True)
    return Sample(**sample.model_dump(include=set(_TASK_FIELDS)))


def agent_reward(result: Any) -> tuple[float | None, dict[str, Any]]:
    """(reward, extra) from what an agent returned: a number, None, or a dict with "reward" (the other keys
    are kept in the record's extra["agent_result"])."""
    def number(x: Any, what: str) -> float | None:
        if x is None:
            return None
        if isinstance(x, (bool, int, float)) and math.isfinite(float(x)):
            return float(x)
        raise AgentError(f"{what} must be a finite number or None, got {x!r}")

    if result is None or isinstance(result, (bool, int, float)):
        return number(result, "the agent's reward"), {}
    if isinstance(result, dict):
        rest = {k: v for k, v in result.items() if k != "reward"}
        try:
            json.dumps(rest)
        except (TypeError, ValueError) as e:
            raise AgentError(f"the agent's result must be JSON-serializable: {e}") from None
        return number(result.get("reward"), "the agent's 'reward'"), ({"agent_result": rest} if rest else {})
    raise AgentError(f"the agent returned a {type(result).__name__}; expected a number, a dict with 'reward', or None")


@register_agent_loop("openai_agent_loop")
class OpenAIAgentLoop(AgentLoopBase):
    """Runs `config.agent` once per episode against a gateway session; see the module doc."""

    async def run(self, sample: Sample, sampling_params: SamplingParams) -> AgentLoopOutput:
        cfg = self.config.agent
        if not (cfg.entry or cfg.command):
            raise ConfigError("openai_agent_loop needs agent.entry=path.py:fn or agent.command=\"...\"")
        if not self.config.data.apply_chat_template:
            raise ConfigError("openai_agent_loop renders every request with the chat template: "
                              "data.apply_chat_template=false cannot be used with it")
        entry = load_entry(cfg.entry) if cfg.entry else None
        gw: Gateway = self.extra_kwargs.get("gateway") or await gateway_for(self.server_manager, self.config.gateway)
        session = ChatSession(self, sample.episode_id, sampling_params, parser=self.config.tools.parser,
                              check_template=self.config.tools.check_template,
                              max_tokens_per_call=cfg.max_tokens_per_call, watch=self.trajectories)
        handle = gw.open_session(sample.episode_id, session)
        slots = gw.slots(cfg.max_concurrency) if cfg.max_concurrency else contextlib.nullcontext()
        t0 = time.monotonic()
        t_agent = t0
        failed: AgentError | None = None
        try:
            async with slots:
                t_agent = time.monotonic()
                try:
                    result = await (self._run_entry(entry, sample, handle) if entry is not None
                                    else self._run_command(sample, handle))
                except AgentError as e:
                    if session.failure is not None:  # the root cause: a request the servers could not serve
                        raise session.failure from None
                    failed = e
        finally:
            gw.close_session(handle.key)
        if session.failure is not None:
            raise session.failure
        outs = session.outputs()
        if failed is not None:
            return self._failed(failed, session, outs, t0, t_agent)
        reward, extra = agent_reward(result)
        if not outs:
            raise AgentError(f"the agent made no model request through the gateway (its base_url was "
                             f"{handle.openai_base_url})")
        first = self._first(session, outs, t0, t_agent)
        first.reward = reward
        first.extra.update(extra)
        if session.aborted and reward is None:
            first.finish_reason = "abort"  # a server abort cut a turn: not scored, so no segment is trained
        return first

    @staticmethod
    def _first(session: ChatSession, outs: list[AgentLoopOutput], t0: float, t_agent: float) -> AgentLoopOutput:
        first = outs[0]
        first.segments = outs[1:]
        first.metrics.update({**session.m, "agent_time_s": time.monotonic() - t_agent,
                              "agent_wait_s": t_agent - t0, "segments": float(len(outs)),
                              "policy_faults": float(len(session.policy_faults))})
        first.extra.update({"solution_str": session.last_content or ""})
        return first

    def _failed(self, e: AgentError, session: ChatSession, outs: list[AgentLoopOutput], t0: float,
                t_agent: float) -> AgentLoopOutput:
        """The agent failed: the policy's failure, kept with the tokens the session recorded (trained at
        reward.failure_score), when it ran past its timeout or failed after a policy fault the gateway saw;
        otherwise the infrastructure's (raised: an error record, its group left out)."""
        if isinstance(e, AgentTimeoutError):
            error, finish = f"AgentTimeoutError: {e}", "timeout"
        elif session.policy_faults:
            faults = "; ".join(dict.fromkeys(session.policy_faults))
            error, finish = f"AgentPolicyError: {e} (after the policy's {faults})", "error"
        else:
            raise e
        if not outs:
            raise e
        first = self._first(session, outs, t0, t_agent)
        for out in [first, *first.segments]:
            out.error, out.finish_reason = error, finish
        return first

    async def _run_entry(self, fn: AgentFn, sample: Sample, handle: SessionHandle) -> Any:
        timeout = self.config.agent.timeout_s
        task = asyncio.ensure_future(fn(agent_sample(sample, self.config.agent.send_answer), handle.openai_base_url,
                                        handle.api_key))
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout)
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.wait({task}, timeout=_CANCEL_WAIT_S)
            raise
        if not done:
            task.cancel()
            await asyncio.wait({task}, timeout=_CANCEL_WAIT_S)
            raise AgentTimeoutError(f"the agent {self.config.agent.entry} ran past agent.timeout_s={timeout:g}")
        try:
            return task.result()
        except asyncio.CancelledError:
            raise AgentError(f"the agent {self.config.agent.entry} was cancelled") from None
        except Exception as e:
            raise AgentError(f"the agent {self.config.agent.entry} raised {type(e).__name__}: {e}") from e

    async def _run_command(self, sample: Sample, handle: SessionHandle) -> Any:
        cfg = self.config.agent
        if cfg.workers:
            pool = worker_pool(self.server_manager, cfg, {**os.environ, **cfg.env})
            result = await pool.run({"task": task_payload(sample, cfg.send_answer), "episode_id": sample.episode_id,
                                     "openai_base_url": handle.openai_base_url,
                                     "anthropic_base_url": handle.anthropic_base_url, "api_key": handle.api_key},
                                    cfg.timeout_s)
            if result is not None and not isinstance(result, dict):
                raise AgentError(f"the agent worker's result must be a JSON object or null, got {result!r:.200}")
            return result
        env = {**os.environ, **cfg.env, "OPENAI_BASE_URL": handle.openai_base_url, "OPENAI_API_KEY": handle.api_key,
               "ANTHROPIC_BASE_URL": handle.anthropic_base_url, "ANTHROPIC_API_KEY": handle.api_key,
               "AGENTLOOP_EPISODE_ID": sample.episode_id}
        payload = json.dumps(task_payload(sample, cfg.send_answer)).encode() + b"\n"
        res = await run_command(cfg.command or "", stdin=payload, env=env, cwd=cfg.cwd, timeout_s=cfg.timeout_s,
                                limit=cfg.output_limit_bytes)
        tail = res.stderr[-2000:].strip()
        if res.timed_out:
            raise AgentTimeoutError(f"the agent command ran past agent.timeout_s={cfg.timeout_s:g} (its process group "
                                    f"was killed); stderr tail: {tail!r}")
        if res.returncode != 0:
            raise AgentError(f"the agent command exited with code {res.returncode}; stderr tail: {tail!r}")
        return read_result(res.result, overflow=res.result_overflow)


__all__ = ["OpenAIAgentLoop", "agent_reward", "agent_sample", "load_entry", "task_payload"]
