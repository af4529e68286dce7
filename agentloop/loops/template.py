"""Chat-template diffing for multi-turn loops: is the template append-only for tool turns, what text
does it write after an assistant message (e.g. "<|im_end|>\\n")? Measured once per template. And the
text new messages add, split into template glue and message content.

    TemplateInfo    the measured turn suffix
    template_info   render a probe conversation four ways, check each rendering extends the previous one
    turn_text       a model turn's text split into the assistant content and the end token it emitted
    env_segments    the text appended by new (tool/environment) messages as glue and content segments,
                    found by rendering their contents as placeholders (see env_tokens for why)
    turn_segments   the same, rendering only what the turn adds: the glue around new messages of a given
                    shape is measured once (fixed_glue) and reused, so a turn costs no render of the history

Fixed glue. The tool loop used to render the whole history three times per turn (the longest step of a
turn: 15% of a 3-turn episode's CPU, growing with the history). For the templates in use the text around a
tool message depends on the new messages' roles and names only, not on the history before them. That is
measured, not assumed: `fixed_glue` renders two different probe histories (with and without a system
message, one and two earlier turns) followed by the new messages with placeholder contents, and uses the
glue only when both give the same, and when padded, escaped and control-token-laden probe contents come out
verbatim. A template that numbers, trims or escapes tool results, or renders them after looking at the
history, fails one of these and gets the full render every turn (env_segments), as before.
Simplification: a template whose tool-message glue depends on history the probes do not vary (say, on an
earlier user message's exact text) is not detected; tools.check_template's append-only probe is the only
other check.
"""

from __future__ import annotations

import json
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from agentloop.errors import ConfigError
from agentloop.loops.env_tokens import Segment

_MARK = "AGENTLOOP_CONTENT_END_7f3a"



@dataclass(frozen=True)
class TemplateInfo:
    turn_suffix: str
    """Text the template writes after an assistant message's content (e.g. "<|im_end|>\\n")."""



_TEMPLATE_CACHE: dict[str, TemplateInfo] = {}



def _first_diff(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)



def require_prefix(shorter: str, longer: str, what: str) -> None:
    if not longer.startswith(shorter):
        i = _first_diff(shorter, longer)
        raise ConfigError(
            f"the chat template is not append-only for tool turns: {what}. First difference at character "
            f"{i}: {shorter[max(0, i - 40):i + 40]!r} vs {longer[max(0, i - 40):i + 40]!r}. tool_agent_loop "
            "needs a template where adding messages only appends text (set model.tokenizer_path to a "
            "tokenizer with such a template)")



def template_info(render, *, check: bool = True, cache_key: str | None = None) -> TemplateInfo:
    """Measure (and with `check`, verify) the template once; `render(messages, tools, add_generation_prompt)`."""
    if cache_key is not None and cache_key in _TEMPLATE_CACHE:
        return _TEMPLATE_CACHE[cache_key]
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                               "parameters": {"type": "object", "properties": {
                                                   "q": {"type": "string"}}, "required": ["q"]}}}]
    call = '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>'
    u = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    a1 = {"role": "assistant", "content": "thinking " + call + _MARK}
    t1 = {"role": "tool", "name": "lookup", "content": "R1"}
    a2 = {"role": "assistant", "content": call + _MARK}
    t2 = {"role": "tool", "name": "lookup", "content": "R2"}
    try:
        A1 = render(u + [a1], tools, False)
        B1 = render(u + [a1, t1], tools, True)
        A2 = render(u + [a1, t1, a2], tools, False)
        B2 = render(u + [a1, t1, a2, t2], tools, True)
    except Exception as e:  # re-raised as a config problem with the cause
        raise ConfigError(f"the chat template cannot render a tool conversation: {type(e).__name__}: {e}") from e
    if _MARK not in A1 or _MARK not in A2:
        raise ConfigError("the chat template drops assistant message content; tool_agent_loop cannot use it")
    suffix = A1[A1.rindex(_MARK) + len(_MARK):]
    if check:
        require_prefix(A1, B1, "adding a tool message changes the text before it")
        require_prefix(B1, A2, "adding an assistant message after a tool message changes the text before it")
        require_prefix(A2, B2, "adding a second tool message changes the text before it")
        if A2[A2.rindex(_MARK) + len(_MARK):] != suffix:
            raise ConfigError("the chat template ends assistant turns differently from turn to turn "
                              f"({suffix!r} vs {A2[A2.rindex(_MARK) + len(_MARK):]!r})")
    info = TemplateInfo(turn_suffix=suffix)
    if cache_key is not None:
        _TEMPLATE_CACHE[cache_key] = info
    return info



def turn_text(decode: Callable[[list[int]], str], token_ids: list[int], finish_reason: str,
              info: TemplateInfo) -> tuple[str, str]:
    """(content, end_text) of a model turn: `end_text` is the end-of-turn token the model emitted (its
    decoded last token when the turn stopped on it and the template's turn suffix starts with it, e.g.
    "<|im_end|>"; else ""), `content` the text before it: the assistant message to give the template.
    The environment tokens after the turn then start with `info.turn_suffix[len(end_text):]`, so the
    suffix appears exactly once whether the model wrote its end token or was cut off."""
    text = decode(token_ids)
    end_text = ""
    if finish_reason == "stop" and token_ids:
        last = decode(token_ids[-1:])
        if last and info.turn_suffix.startswith(last) and text.endswith(last):
            end_text = last
    return text[:len(text) - len(end_text)], end_text


_PLACEHOLDER = "\ue000agentloop-env-{}-" + secrets.token_hex(4) + "\ue001"
"""Stands for the i-th new message's content in a rendering (private-use characters and a per-process
nonce, so no real text contains it)."""


def env_segments(render: Callable[[list[dict[str, Any]], list[dict] | None, bool], str],
                 history: list[dict[str, Any]], new_messages: list[dict[str, Any]], tools: list[dict] | None,
                 *, prefix: str = "") -> list[Segment]:
    """The text that `new_messages` add after `history` (`render(history + new, tools, True)` minus
    `render(history, tools, False)`), preceded by `prefix` (glue), as glue and content segments.

    Each new message's `content` is rendered as a placeholder, so where the template's own text ends
    and a message's text begins is known exactly. Raises ConfigError when the template is not
    append-only here, or when it alters a message's content (then the split cannot be trusted).
    """
    a = render(history, tools, False)
    real = render(history + new_messages, tools, True)
    require_prefix(a, real, "adding tool messages changed the text before them")
    contents: list[str] = []
    marked = []
    for m in new_messages:
        c = m.get("content")
        if isinstance(c, str) and c:
            marked.append({**m, "content": _PLACEHOLDER.format(len(contents))})
            contents.append(c)
        else:
            marked.append(m)
    text = render(history + marked, tools, True)
    require_prefix(a, text, "adding tool messages changed the text before them")
    segments = [Segment(prefix, False)] if prefix else []
    rest = text[len(a):]
    for i, c in enumerate(contents):
        ph = _PLACEHOLDER.format(i)
        if rest.count(ph) != 1:
            raise ConfigError(f"the chat template renders a tool/environment message's content {rest.count(ph)} "
                              "times (expected once); its tokens cannot be split from the template's")
        glue, rest = rest.split(ph)
        segments += [Segment(glue, False), Segment(c, True)]
    segments.append(Segment(rest, False))
    segments = [s for s in segments if s.text]
    if "".join(s.text for s in segments) != prefix + real[len(a):]:
        raise ConfigError("the chat template changes tool/environment message content as it renders it (e.g. "
                          "trims or escapes it); its tokens cannot be split from the template's")
    return segments


_GLUE: "OrderedDict[tuple[Any, ...], tuple[str, ...] | None]" = OrderedDict()
_GLUE_SIZE = 1024
_GLUE_KEYS = frozenset({"role", "name", "content"})
_PROBE_CONTENT = "  probe <b>&amp; \"quoted\" 'x' <|im_end|>\n<tool_call>\n "
"""Tool output no template should alter: surrounding whitespace, markup, quotes and control-token strings."""


def _glue_of(render: Callable[[list[dict[str, Any]], list[dict] | None, bool], str], history: list[dict[str, Any]],
             marked: list[dict[str, Any]], tools: list[dict] | None, n: int) -> tuple[str, ...] | None:
    a = render(history, tools, False)
    text = render(history + marked, tools, True)
    if not text.startswith(a):
        return None
    rest, glue = text[len(a):], []
    for i in range(n):
        ph = _PLACEHOLDER.format(i)
        if rest.count(ph) != 1:
            return None
        g, rest = rest.split(ph)
        glue.append(g)
    glue.append(rest)
    return tuple(glue)


def fixed_glue(render: Callable[[list[dict[str, Any]], list[dict] | None, bool], str],
               new_messages: list[dict[str, Any]], tools: list[dict] | None, *,
               cache_key: str) -> tuple[str, ...] | None:
    """The template text around `new_messages` (k + 1 strings for k contents) when it does not depend on the
    history, else None (see the module docstring). Measured once per (template, tools, the messages' roles and
    names); `cache_key` names the template (and the render function)."""
    if not all(m.keys() <= _GLUE_KEYS and isinstance(m.get("content"), str) and m["content"] for m in new_messages):
        return None  # other fields (tool_call_id, list contents, empty ones) may shape the glue: no shortcut
    try:
        tools_key = json.dumps(tools, sort_keys=True)
    except TypeError:
        return None
    key = (cache_key, tools_key, tuple((m["role"], m.get("name")) for m in new_messages))
    if key in _GLUE:
        _GLUE.move_to_end(key)
        return _GLUE[key]
    glue = _measure_glue(render, new_messages, tools)
    _GLUE[key] = glue
    if len(_GLUE) > _GLUE_SIZE:
        _GLUE.popitem(last=False)
    return glue


def _measure_glue(render: Callable[[list[dict[str, Any]], list[dict] | None, bool], str],
                  new_messages: list[dict[str, Any]], tools: list[dict] | None) -> tuple[str, ...] | None:
    name = (tools or [{}])[0].get("function", {}).get("name", "lookup") if tools else "lookup"
    call = '<tool_call>\n{"name": "%s", "arguments": {}}\n</tool_call>' % name
    probes = [
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
         {"role": "assistant", "content": "thinking " + call}],
        [{"role": "user", "content": "Another question, longer than the first one."},
         {"role": "assistant", "content": call}, {"role": "tool", "name": name, "content": "R1"},
         {"role": "assistant", "content": "more " + call}],
    ]
    marked = [{**m, "content": _PLACEHOLDER.format(i)} for i, m in enumerate(new_messages)]
    try:
        glues = {_glue_of(render, h, marked, tools, len(new_messages)) for h in probes}
        if len(glues) != 1 or None in glues:
            return None
        glue = glues.pop()
        # contents must come out verbatim: a template that trims, escapes or rewrites them has no fixed glue
        real = [{**m, "content": _PROBE_CONTENT} for m in new_messages]
        a = render(probes[0], tools, False)
        text = render(probes[0] + real, tools, True)
    except Exception:  # noqa: BLE001 - a template the probes break: the full render decides (and reports)
        return None
    expect = glue[0] + "".join(_PROBE_CONTENT + g for g in glue[1:])
    return glue if text == a + expect else None


def turn_segments(render: Callable[[list[dict[str, Any]], list[dict] | None, bool], str],
                  history: list[dict[str, Any]], new_messages: list[dict[str, Any]], tools: list[dict] | None,
                  *, prefix: str = "", cache_key: str) -> list[Segment]:
    """`env_segments(render, history, new_messages, tools, prefix=prefix)`, without rendering the history when
    the template's glue around such messages is fixed (see the module docstring); the same segments either way."""
    glue = fixed_glue(render, new_messages, tools, cache_key=cache_key)
    if glue is None:
        return env_segments(render, history, new_messages, tools, prefix=prefix)
    segments = [Segment(prefix, False)] if prefix else []
    segments.append(Segment(glue[0], False))
    for m, g in zip(new_messages, glue[1:]):
        segments += [Segment(m["content"], True), Segment(g, False)]
    return [seg for seg in segments if seg.text]
