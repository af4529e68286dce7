"""Chat-template diffing for multi-turn loops: is the template append-only for tool turns, what text
does it write after an assistant message (e.g. "<|im_end|>\\n")? Measured once per template. And the
text new messages add, split into template glue and message content.

    TemplateInfo    the measured turn suffix
    template_info   render a probe conversation four ways, check each rendering extends the previous one
    turn_text       a model turn's text split into the assistant content and the end token it emitted
    env_segments    the text appended by new (tool/environment) messages as glue and content segments,
                    found by rendering their contents as placeholders (see env_tokens for why)
"""

from __future__ import annotations

import secrets
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
