"""The supervised warm start: traces, the assistant-only mask, the cached build, loadable output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import agentloop.models.warmstart as warmstart
from agentloop.data.tasks import CALCULATOR_SYSTEM
from agentloop.models.modelzoo import load_tokenizer
from agentloop.models.warmstart import (
    DEFAULT_SPEC,
    WarmStartSpec,
    build_traces,
    calculator_schemas,
    encode_conversation,
    ensure_warm_model,
    evaluate_tool_use,
    warm_model_dir_for,
)
from agentloop.models.warmstart.traces import _excluded_expressions
from agentloop.tools.calculator import calculate, format_number
from agentloop.tools.parsers import parse_hermes

TINY = WarmStartSpec(n_traces=32, steps=20, batch_size=4, warmup_steps=2)
"""A build small enough for the tests (about 10 s on 2 cores)."""


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path):
    return load_tokenizer(tiny_model_path)


@pytest.fixture(scope="module")
def traces(tokenizer):
    return build_traces(tokenizer, WarmStartSpec(n_traces=24, tool_fraction=0.5))


@pytest.fixture(scope="module")
def warm_dir(tmp_path_factory, tiny_model_path: Path) -> Path:
    return ensure_warm_model(tmp_path_factory.mktemp("cache"), TINY, base_dir=tiny_model_path)


def _spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for i, (t, m) in enumerate(zip(ids, mask)):
        if m and (i == 0 or not mask[i - 1]):
            out.append([])
        if m:
            out[-1].append(t)
    return out


def test_traces_mix_and_render_like_the_template(tokenizer, traces) -> None:
    assert sum(t.uses_tool for t in traces) == 12
    schemas = calculator_schemas()
    for t in traces:
        assert t.messages[0] == {"role": "system", "content": CALCULATOR_SYSTEM}
        assert len(t.ids) == len(t.mask)
        full = tokenizer.apply_chat_template(t.messages, tools=schemas, tokenize=False)
        # the turn-by-turn tokens spell the template's text (the last turn's trailing "\n" is not generated)
        assert tokenizer.decode(t.ids, skip_special_tokens=False) + "\n" == full
        assert "<tools>" in full and '"name": "calculator"' in full


def test_mask_covers_exactly_the_assistant_turns(tokenizer, traces) -> None:
    for t in traces:
        spans = [tokenizer.decode(s, skip_special_tokens=False) for s in _spans(t.ids, t.mask)]
        wanted = [m["content"] + tokenizer.eos_token for m in t.messages if m["role"] == "assistant"]
        assert spans == wanted
        # nothing of the system, user or tool text is trained on
        unmasked = tokenizer.decode([i for i, m in zip(t.ids, t.mask) if not m], skip_special_tokens=False)
        assert CALCULATOR_SYSTEM in unmasked and t.messages[1]["content"] in unmasked


def test_tool_trace_is_parseable_and_uses_the_real_tool(traces) -> None:
    tool_traces = [t for t in traces if t.uses_tool]
    for t in tool_traces:
        call_msg, tool_msg, final = t.messages[2], t.messages[3], t.messages[4]
        parsed = parse_hermes(call_msg["content"])
        assert not parsed.errors and len(parsed.calls) == 1
        call = parsed.calls[0]
        assert call.name == "calculator" and set(call.arguments) == {"expression"}
        assert tool_msg["role"] == "tool" and tool_msg["content"] == format_number(calculate(call.arguments["expression"]))
        assert int(tool_msg["content"]) == t.answer
        assert final["content"] == f"#### {t.answer}"
    direct = [t for t in traces if not t.uses_tool]
    assert all(len(t.messages) == 3 and t.messages[2]["content"].startswith("#### ") for t in direct)
    # estimates are plausible but mostly wrong
    assert sum(t.messages[2]["content"] == f"#### {t.answer}" for t in direct) <= len(direct) // 3


def test_trace_problems_avoid_the_eval_and_rl_sets(traces) -> None:
    excluded = _excluded_expressions()
    assert len(excluded) > 4000
    assert not any(t.messages[1]["content"][len("What is "):-1] in excluded for t in traces)


def test_encode_rejects_a_user_turn_after_the_assistant(tokenizer) -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"}, {"role": "user", "content": "again"}]
    with pytest.raises(ValueError, match="only tool"):
        encode_conversation(tokenizer, msgs, calculator_schemas())


def test_build_is_cached_and_loads(warm_dir: Path, tiny_model_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    assert warm_dir == warm_model_dir_for(TINY, tiny_model_path, warm_dir.parent.parent)
    assert warm_dir.name.startswith("warm-")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "agentloop_warmstart.json"):
        assert (warm_dir / name).is_file(), name
    assert (warm_dir / "tokenizer.json").read_bytes() == (tiny_model_path / "tokenizer.json").read_bytes()
    meta = json.loads((warm_dir / "agentloop_warmstart.json").read_text())
    assert meta["spec"] == TINY.model_dump(mode="json") and meta["base_model"] == tiny_model_path.name
    assert meta["loss"]["last"] < meta["loss"]["first"]

    from agentloop.models.warmstart import build as warm_build

    def no_build(*a, **k):
        raise AssertionError("a cached warm model was built again")

    with pytest.MonkeyPatch.context() as mp:  # a cache hit builds nothing (whatever the machine's speed)
        mp.setattr(warm_build, "_build", no_build)
        mp.setattr(warm_build, "_install_shipped", no_build)
        assert ensure_warm_model(warm_dir.parent.parent, TINY, base_dir=tiny_model_path) == warm_dir

    model = AutoModelForCausalLM.from_pretrained(str(warm_dir), dtype="auto")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype="auto")
    assert next(model.parameters()).dtype == next(base.parameters()).dtype == torch.bfloat16
    assert json.loads((warm_dir / "config.json").read_text())["vocab_size"] == base.config.vocab_size
    tok = load_tokenizer(warm_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 12 * 34 + 5?"}], tools=calculator_schemas(),
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape[:2] == ids.shape and torch.isfinite(logits).all()
    changed = any(not torch.equal(a, b) for a, b in zip(model.parameters(), base.parameters()))
    assert changed


def test_build_is_deterministic(tmp_path: Path, tiny_model_path: Path) -> None:
    spec = WarmStartSpec(n_traces=8, steps=2, batch_size=2, warmup_steps=1)
    a = ensure_warm_model(tmp_path / "a", spec, base_dir=tiny_model_path)
    b = ensure_warm_model(tmp_path / "b", spec, base_dir=tiny_model_path)
    assert a.name == b.name
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    other = spec.model_copy(update={"seed": spec.seed + 1})
    assert warm_model_dir_for(other, tiny_model_path, tmp_path / "a") != a


def test_evaluate_tool_use_runs(warm_dir: Path) -> None:
    stats = evaluate_tool_use(warm_dir, n=4, temperature=1.0, max_new_tokens=12)
    assert stats.n == 4
    for v in (stats.tool_call_rate, stats.attempted_call_rate, stats.accuracy, stats.right_expression_rate):
        assert 0.0 <= v <= 1.0
    assert stats.tool_call_rate <= stats.attempted_call_rate
    assert len(stats.examples) == 4
    smol = evaluate_tool_use(warm_dir, n=2, temperature=1.0, max_new_tokens=8, rendering="smolagents")
    assert smol.n == 2 and "New task:" not in smol.examples[0]  # examples start after the prompt


def test_shipped_model_installs_and_uses_the_calculator(tmp_path: Path, tiny_model_path: Path) -> None:
    manifest = warmstart.shipped_artefact()
    assert manifest is not None, "the package ships the GPU-built warm model"
    d = ensure_warm_model(tmp_path, base_dir=tiny_model_path)
    assert d.name == manifest["digest"] == warm_model_dir_for(DEFAULT_SPEC, tiny_model_path, tmp_path).name
    assert (d / "tokenizer.json").read_bytes() == (tiny_model_path / "tokenizer.json").read_bytes()
    # It is the policy RL starts from: greedy it mostly calls the tool, and a call is copied right.
    stats = evaluate_tool_use(d, n=16, temperature=0.0, max_new_tokens=48)
    assert stats.tool_call_rate >= 0.5, stats.examples
    assert stats.accuracy_with_tool >= 0.9, stats.examples
    assert stats.accuracy_without_tool <= 0.2


def _shipped_copy(tmp_path: Path, monkeypatch) -> Path:
    src = warmstart.SHIPPED_DIR
    dst = tmp_path / "shipped"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(warmstart.build, "SHIPPED_DIR", dst)
    return dst


def test_corrupt_shipped_weights_are_refused(tmp_path: Path, tiny_model_path: Path, monkeypatch) -> None:
    dst = _shipped_copy(tmp_path, monkeypatch)
    data = bytearray((dst / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (dst / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="model.safetensors is missing or corrupt"):
        ensure_warm_model(tmp_path / "cache", base_dir=tiny_model_path)
    assert not warm_model_dir_for(DEFAULT_SPEC, tiny_model_path, tmp_path / "cache").exists()


def test_shipped_weights_need_the_same_tokenizer(tmp_path: Path, tiny_model_path: Path, monkeypatch) -> None:
    dst = _shipped_copy(tmp_path, monkeypatch)
    manifest = json.loads((dst / "artefact.json").read_text())
    manifest["tokenizer_sha256"] = "0" * 64
    (dst / "artefact.json").write_text(json.dumps(manifest))
    with pytest.raises(RuntimeError, match="local tokenizer .* hashes to"):
        ensure_warm_model(tmp_path / "cache", base_dir=tiny_model_path)


def test_gpu_spec_without_gpu_or_artefact_says_so(tmp_path: Path, tiny_model_path: Path, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = DEFAULT_SPEC.model_copy(update={"seed": 1})
    with pytest.raises(RuntimeError, match="no GPU is visible and no shipped artefact matches"):
        ensure_warm_model(tmp_path, spec, base_dir=tiny_model_path)


def test_varied_traces_render_the_task_as_each_harness_does(tokenizer) -> None:
    """renderings="varied": the tools and system prompts the harnesses send (the Agents SDK's strict schema,
    LangChain's key order, smolagents' prompt), each trace tokenized as the gateway would; the default spec's
    digest (the shipped model's) and its traces are unchanged."""
    from agentloop.models.warmstart.renderings import renderings
    from agentloop.models.warmstart.spec import VARIED_SPEC

    assert warm_model_dir_for(DEFAULT_SPEC, "tiny-qwen2-ce9e2b34b38b").name == "warm-f2e7a0a9ae32"
    assert VARIED_SPEC.digest("b") != DEFAULT_SPEC.model_copy(update={"max_len": 2048}).digest("b")
    spec = WarmStartSpec(n_traces=60, tool_fraction=0.5, renderings="varied", max_len=2048)
    traces = build_traces(tokenizer, spec)
    used = {t.rendering for t in traces}
    assert used == set(renderings()), used
    for t in traces:
        how = renderings()[t.rendering]
        full = tokenizer.apply_chat_template(t.messages, tools=how.tools, tokenize=False)
        assert tokenizer.decode(t.ids, skip_special_tokens=False) + "\n" == full
        assert t.messages[1]["content"].startswith(how.user_prefix)
    strict = next(t for t in traces if t.rendering == "agents_sdk_chat")
    assert '"strict": true' in tokenizer.decode(strict.ids)
    smol = next(t for t in traces if t.rendering == "smolagents")
    assert "You are an expert assistant who can solve any task using tool calls" in smol.messages[0]["content"]
    fixed = build_traces(tokenizer, WarmStartSpec(n_traces=24, tool_fraction=0.5))
    assert {t.rendering for t in fixed} == {"agentloop"}
