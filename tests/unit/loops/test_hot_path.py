"""The tool loop's hot path: the fixed template glue gives exactly what the full render gives, for every template
shape we support (and falls back where the glue depends on history); the compact TrajectoryBuilder gives the same
output as plain lists, in ~21 bytes per token; the prompt cache is keyed by template and render method."""

from __future__ import annotations

import random
import sys
from array import array
from typing import Any

import pytest

from agentloop.errors import ConfigError
from agentloop.loops.base import TrajectoryBuilder
from agentloop.loops.env_tokens import encode_segments
from agentloop.loops.template import _GLUE, env_segments, fixed_glue, turn_segments
from agentloop.models.modelzoo import CHAT_TEMPLATE
from agentloop.records import AgentLoopOutput, TokenOutput
from tests.unit.loops.test_tool_loop import TEST_TEMPLATE, get_tokenizer

# Llama 3.1's shape: header tokens per message, tool results under the ipython role.
LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- if tools -%}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools: ' + (tools | tojson) + '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' -}}"
    "{%- else -%}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

# Glue that depends on the history: tool results numbered over the whole conversation.
NUMBERED_TEMPLATE = (
    "{%- set ns = namespace(n=0) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}{%- set ns.n = ns.n + 1 -%}"
    "{{- '<|im_start|>tool ' + (ns.n | string) + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Glue that depends on whether the conversation has a system message.
SYSTEM_DEPENDENT_TEMPLATE = (
    "{%- set obs = 'observation' if messages[0].role == 'system' else 'tool' -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}{{- '<|im_start|>' + obs + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Trims tool output: the content is not verbatim, so no glue can be trusted (and the full render refuses).
TRIMMING_TEMPLATE = LLAMA3_TEMPLATE.replace("ipython<|end_header_id|>\\n\\n' + m.content", "ipython<|end_header_id|>\\n\\n' + (m.content | trim)")
assert TRIMMING_TEMPLATE != LLAMA3_TEMPLATE

FIXED = {"chatml_per_tool": TEST_TEMPLATE, "qwen2.5_grouped": CHAT_TEMPLATE, "llama3_ipython": LLAMA3_TEMPLATE}
HISTORY_DEPENDENT = {"numbered": NUMBERED_TEMPLATE, "system_dependent": SYSTEM_DEPENDENT_TEMPLATE}

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                            "parameters": {"type": "object", "properties": {
                                                "expression": {"type": "string"}}, "required": ["expression"]}}},
         {"type": "function", "function": {"name": "search", "description": "Search.",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
CONTENTS = ["3", "  padded  \n", "<b>&amp; \"q\" 'x'</b>", "text with <|im_end|> and <tool_call> inside",
            "multi\nline\n\nresult", "error: unknown tool 'nope'", "héllo 😀"]


def _render(tok: Any, template: str):
    def render(messages: list[dict[str, Any]], tools: list[dict] | None, gen: bool) -> str:
        return tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                       add_generation_prompt=gen)

    return render


def _histories(rng: random.Random) -> list[list[dict[str, Any]]]:
    """Conversations ending in an assistant turn that called a tool: with and without a system message, one to
    three earlier turns, earlier tool results of one or two messages."""
    out = []
    for system in (True, False):
        for turns in (1, 2, 3):
            h: list[dict[str, Any]] = [{"role": "system", "content": "You are careful."}] if system else []
            h.append({"role": "user", "content": f"Question {rng.randrange(100)}: what is 1+2?"})
            for t in range(turns):
                h.append({"role": "assistant", "content": f"step {t} " + CALL})
                if t < turns - 1:
                    for _ in range(rng.choice((1, 2))):
                        h.append({"role": "tool", "name": "calculator", "content": rng.choice(CONTENTS)})
            out.append(h)
    return out


def _new_messages(rng: random.Random) -> list[list[dict[str, Any]]]:
    names = ["calculator", "search", "parse_error"]
    return [[{"role": "tool", "name": rng.choice(names), "content": rng.choice(CONTENTS)} for _ in range(k)]
            for k in (1, 1, 2, 3)]


def _cases():
    rng = random.Random(0)
    return [(h, new, tools, prefix) for h in _histories(rng) for new in _new_messages(rng)
            for tools in (TOOLS, None) for prefix in ("", "\n")]


@pytest.mark.parametrize("name", sorted(FIXED) + sorted(HISTORY_DEPENDENT))
def test_turn_segments_are_exactly_the_full_render(name):
    """For every case: turn_segments (fixed glue when the template has it) == env_segments (full render), and the
    tokens are the tokens of the text the full render adds."""
    template = {**FIXED, **HISTORY_DEPENDENT}[name]
    tok = get_tokenizer("test")
    render = _render(tok, template)
    key = f"test:{name}"
    used_fixed = 0
    for history, new, tools, prefix in _cases():
        full = env_segments(render, history, new, tools, prefix=prefix)
        fast = turn_segments(render, history, new, tools, prefix=prefix, cache_key=key)
        assert fast == full, (name, history, new)
        added = render(history + new, tools, True)[len(render(history, tools, False)):]
        assert "".join(s.text for s in fast) == prefix + added
        assert encode_segments(tok, fast) == encode_segments(tok, full)
        used_fixed += fixed_glue(render, new, tools, cache_key=key) is not None
    if name in FIXED:
        assert used_fixed == len(_cases())  # the shortcut was taken every time: it is what was tested
    else:
        assert used_fixed == 0  # the probes saw the glue depend on the history: full render every turn


def test_template_that_alters_tool_output_has_no_fixed_glue():
    tok = get_tokenizer("test")
    render = _render(tok, TRIMMING_TEMPLATE)
    new = [{"role": "tool", "name": "calculator", "content": "  padded  "}]
    history = _histories(random.Random(1))[0]
    assert fixed_glue(render, new, TOOLS, cache_key="test:trim") is None
    with pytest.raises(ConfigError, match="changes tool/environment message content"):
        turn_segments(render, history, new, TOOLS, cache_key="test:trim")


def test_fixed_glue_is_measured_once_per_template_and_message_shape():
    tok = get_tokenizer("test")
    calls = 0
    inner = _render(tok, LLAMA3_TEMPLATE)

    def render(messages, tools, gen):
        nonlocal calls
        calls += 1
        return inner(messages, tools, gen)

    new = [{"role": "tool", "name": "calculator", "content": "x"}]
    _GLUE.clear()
    g = fixed_glue(render, new, TOOLS, cache_key="test:count")
    measured = calls
    assert g is not None and measured > 0
    for content in CONTENTS:  # other contents, same shape: no render at all
        assert fixed_glue(render, [{**new[0], "content": content}], TOOLS, cache_key="test:count") == g
    assert calls == measured
    # another shape (two messages) or another template key is measured on its own
    fixed_glue(render, new * 2, TOOLS, cache_key="test:count")
    assert calls > measured
    # messages with fields that may shape the glue (tool_call_id, empty content) never take the shortcut
    assert fixed_glue(render, [{**new[0], "tool_call_id": "c1"}], TOOLS, cache_key="test:count") is None
    assert fixed_glue(render, [{**new[0], "content": ""}], TOOLS, cache_key="test:count") is None


# ---------------------------------------------------------------- compact token buffers


class ListBuilder:
    """The builder as it was before the compact buffers (plain lists): the reference."""

    def __init__(self, prompt):
        self.prompt_ids, self.response_ids, self.response_mask, self.response_logprobs = list(prompt), [], [], []
        self.token_versions: list[int | None] = []

    def add_model(self, out: TokenOutput):
        n = len(out.token_ids)
        self.response_ids += out.token_ids
        self.response_mask += [1] * n
        self.response_logprobs += [float(x) for x in out.logprobs]
        self.token_versions += out.token_versions if len(out.token_versions) == n else [None] * n

    def add_env(self, ids):
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        self.response_logprobs += [0.0] * len(ids)
        self.token_versions += [None] * len(ids)


def _random_episode(rng: random.Random, versions: bool):
    prompt = [rng.randrange(0, 150_000) for _ in range(rng.randrange(1, 50))]
    steps = []
    for _ in range(rng.randrange(1, 6)):
        n = rng.randrange(0, 30)
        tv = [rng.choice([None, rng.randrange(0, 10)]) for _ in range(n)] if versions else []
        steps.append(("model", TokenOutput(token_ids=[rng.randrange(0, 150_000) for _ in range(n)],
                                           logprobs=[-rng.random() * 5 for _ in range(n)], token_versions=tv,
                                           finish_reason="stop", weight_version="v1")))
        steps.append(("env", [rng.randrange(0, 150_000) for _ in range(rng.randrange(0, 20))]))
    return prompt, steps


@pytest.mark.parametrize("versions", [False, True])
def test_compact_builder_matches_plain_lists(versions):
    rng = random.Random(7 + versions)
    for _ in range(200):
        prompt, steps = _random_episode(rng, versions)
        ref, b = ListBuilder(prompt), TrajectoryBuilder(prompt)
        for kind, x in steps:
            (ref.add_model if kind == "model" else ref.add_env)(x)
            (b.add_model if kind == "model" else b.add_env)(x)
            assert list(b.context()) == ref.prompt_ids + ref.response_ids == b.all_ids
            assert len(b) == len(ref.prompt_ids) + len(ref.response_ids)
            assert b.response_len == len(ref.response_ids)
        out = b.build(reward=1.0)
        assert out.prompt_ids == ref.prompt_ids and out.response_ids == ref.response_ids
        assert out.response_mask == ref.response_mask and out.response_logprobs == ref.response_logprobs
        want_tv = ref.token_versions if any(v is not None for v in ref.token_versions) else []
        assert out.token_versions == want_tv
        assert out.num_model_tokens == sum(ref.response_mask)
        # the output skips per-token validation: it must be what validation would accept, with plain types
        again = AgentLoopOutput.model_validate(out.model_dump())
        assert again.model_dump() == out.model_dump()
        assert all(type(x) is int for x in out.response_ids) and all(type(x) is float for x in out.response_logprobs)


def test_compact_builder_bytes_per_token():
    """The in-flight buffers hold a token in ~21 bytes (4 id + 1 mask + 8 logprob + 8 version), not ~84 as lists."""
    rng = random.Random(3)
    prompt, steps = _random_episode(rng, True)
    b = TrajectoryBuilder(prompt)
    n_resp = 0
    for _ in range(200):
        ids = [rng.randrange(0, 150_000) for _ in range(50)]
        b.add_model(TokenOutput(token_ids=ids, logprobs=[-1.0] * 50, finish_reason="stop"))
        b.add_env(ids[:10])
        n_resp += 60
    buffers = (b._ids, b._mask, b._lps, b._vers)
    assert isinstance(b._ids, array) and b._ids.itemsize == 4 and isinstance(b._mask, bytearray)
    per_token = sum(sys.getsizeof(x) for x in buffers) / n_resp
    assert per_token < 24, per_token
    lists = ListBuilder(prompt)
    for _ in range(200):
        ids = [rng.randrange(1000, 150_000) for _ in range(50)]
        lists.add_model(TokenOutput(token_ids=ids, logprobs=[-rng.random()] * 50, finish_reason="stop"))
        lists.add_env(ids[:10])
    list_bytes = sum(sys.getsizeof(x) for x in (lists.response_ids, lists.response_mask, lists.response_logprobs,
                                                lists.token_versions))
    list_bytes += sum(sys.getsizeof(x) for x in lists.response_ids) + sum(sys.getsizeof(x) for x in
                                                                         lists.response_logprobs)
    assert list_bytes / n_resp > 3 * per_token


def test_context_is_the_buffer_not_a_copy():
    b = TrajectoryBuilder([1, 2, 3])
    ctx = b.context()
    b.add_env([4])
    assert ctx is b.context() and list(ctx) == [1, 2, 3, 4]
    ids = b.all_ids
    ids.append(99)  # the list views are copies: changing one never changes the episode
    assert b.all_ids == [1, 2, 3, 4] and b.prompt_ids == [1, 2, 3]
