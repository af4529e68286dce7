"""The synthetic tool-use conversations, tokenized exactly as tool_agent_loop tokenizes episodes."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
from typing import Any

from agentloop.data.builtin import _Lcg
from agentloop.data.tasks import CALCULATOR_SYSTEM, CalcProblem, calculator_problem
from agentloop.models.warmstart.renderings import pick, renderings
from agentloop.models.warmstart.spec import (
    EVAL_SEED,
    TRAIN_ROWS,
    TRAIN_SEED,
    Trace,
    WarmStartSpec,
)


def calculator_schemas() -> list[dict[str, Any]]:
    """The `tools=` list tool_agent_loop gives the template for calculator rows."""
    from agentloop.tools.registry import get_tool

    return [get_tool("calculator")().schema]


def estimate_answer(problem: CalcProblem) -> int:
    """A rough mental estimate: two-digit operands rounded to tens, one-digit ones kept, then computed."""
    from agentloop.tools.calculator import calculate

    def round10(m: re.Match[str]) -> str:
        v = int(m.group(0))
        return str(v if v < 10 else int(math.floor(v / 10 + 0.5)) * 10)

    return int(calculate(re.sub(r"\d+", round10, problem.expression)))


def _calculator_output(expressions: list[str]) -> list[str]:
    """The real calculator tool's message text for each expression."""
    from agentloop.tools.registry import get_tool

    tool = get_tool("calculator")()

    async def run() -> list[str]:
        inst = await tool.create(None)  # type: ignore[arg-type] - the calculator keeps no episode state
        try:
            return [(await tool.execute(inst, {"expression": e})).text for e in expressions]
        finally:
            await tool.release(inst)

    return asyncio.run(run())


def _tool_call_text(expression: str) -> str:
    """The hermes call exactly as the chat template writes an assistant's `tool_calls`."""
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + \
        "\n</tool_call>"


class _Renderer:
    """The template and its turn suffix, as tool_agent_loop sees them."""

    def __init__(self, tokenizer: Any, schemas: list[dict[str, Any]] | None):
        from agentloop.loops.template import template_info

        self.tok = tokenizer
        self.schemas = schemas
        self.eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        self.suffix = template_info(self.render).turn_suffix
        if not self.suffix.startswith(tokenizer.eos_token):
            raise ValueError(f"turn suffix {self.suffix!r} does not start with the EOS token {tokenizer.eos_token!r}")

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None, gen: bool) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": gen}
        if tools:
            kwargs["tools"] = tools
        return self.tok.apply_chat_template(messages, **kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def env_ids(self, history: list[dict[str, Any]], tool_msgs: list[dict[str, Any]], end_text: str) -> list[int]:
        """Tokens between an assistant turn and the next one (tool_agent_loop's `_env_ids`)."""
        a = self.render(history, self.schemas, False)
        b = self.render(history + tool_msgs, self.schemas, True)
        if not b.startswith(a):
            raise ValueError("the chat template is not append-only for tool turns")
        return self.encode(self.suffix[len(end_text):] + b[len(a):])


def encode_conversation(tokenizer: Any, messages: list[dict[str, Any]],
                        schemas: list[dict[str, Any]] | None) -> tuple[list[int], list[int]]:
    """(ids, mask) of a conversation that starts with system/user messages, tokenized turn by turn.

    Every assistant message becomes its content's tokens plus the EOS token with mask 1; everything
    else (prompt, tool messages, headers) has mask 0. The ids end with the last assistant's EOS.
    """
    r = _Renderer(tokenizer, schemas)
    return _encode(r, messages)


def _encode(r: _Renderer, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    history = [dict(m) for m in messages[:first]]
    ids = r.encode(r.render(history, r.schemas, True))
    mask = [0] * len(ids)
    i = first
    while i < len(messages):
        msg = messages[i]
        if msg["role"] != "assistant":
            raise ValueError(f"message {i} should be the assistant's, got role {msg['role']!r}")
        seg = r.encode(msg["content"]) + [r.eos_id]
        ids += seg
        mask += [1] * len(seg)
        history.append(dict(msg))
        i += 1
        tool_msgs = []
        while i < len(messages) and messages[i]["role"] == "tool":
            tool_msgs.append(dict(messages[i]))
            i += 1
        if tool_msgs:
            env = r.env_ids(history, tool_msgs, r.tok.eos_token)
            ids += env
            mask += [0] * len(env)
            history += tool_msgs
        elif i < len(messages):
            raise ValueError(f"message {i} ({messages[i]['role']!r}) follows an assistant turn; only tool "
                             "messages may")
    return ids, mask


def _excluded_expressions() -> set[str]:
    """Expressions of the `calculator` eval set and the `calculator_train` RL set."""
    out: set[str] = set()
    for seed, n in ((EVAL_SEED, 64), (TRAIN_SEED, TRAIN_ROWS)):
        rng = _Lcg(seed)
        out.update(calculator_problem(rng).expression for _ in range(n))
    return out


def build_traces(tokenizer: Any, spec: WarmStartSpec) -> list[Trace]:
    """`spec.n_traces` conversations (minus any over `max_len`), a `tool_fraction` share calling the tool."""
    excluded = _excluded_expressions()
    rng = _Lcg(spec.seed)
    problems: list[CalcProblem] = []
    seen: set[str] = set()
    while len(problems) < spec.n_traces:
        p = calculator_problem(rng)
        if p.expression not in excluded and p.expression not in seen:
            seen.add(p.expression)
            problems.append(p)
    n_tool = round(spec.n_traces * spec.tool_fraction)
    kinds = [True] * n_tool + [False] * (spec.n_traces - n_tool)
    random.Random(spec.seed).shuffle(kinds)
    outputs = iter(_calculator_output([p.expression for p, k in zip(problems, kinds) if k]))
    renderers: dict[str, _Renderer] = {}
    pick_rng = random.Random(spec.seed + 1)  # its own stream: a fixed build draws nothing from it
    traces = []
    for p, uses_tool in zip(problems, kinds):
        rendering = pick(pick_rng) if spec.renderings == "varied" else renderings()["agentloop"]
        r = renderers.get(rendering.name)
        if r is None:
            r = renderers[rendering.name] = _Renderer(tokenizer, rendering.tools)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": CALCULATOR_SYSTEM if rendering.system is None else rendering.system},
            {"role": "user", "content": rendering.user_prefix + p.question}]
        if uses_tool:
            result = next(outputs)
            messages += [{"role": "assistant", "content": _tool_call_text(p.expression)},
                         {"role": "tool", "name": "calculator", "content": result},
                         {"role": "assistant", "content": f"#### {result}"}]
        else:
            messages.append({"role": "assistant", "content": f"#### {estimate_answer(p)}"})
        ids, mask = _encode(r, messages)
        if len(ids) <= spec.max_len:
            traces.append(Trace(messages=messages, uses_tool=uses_tool, answer=p.answer, ids=ids, mask=mask,
                                rendering=rendering.name))
    if not traces:
        raise ValueError(f"every trace is longer than max_len={spec.max_len}")
    return traces
