"""The tiny model: deterministic cached build, tokenizer, chat template, loadable weights."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from agentloop.models import modelzoo
from agentloop.models.modelzoo import (
    SPECIAL_TOKENS,
    TOOL_TOKENS,
    TinyModelSpec,
    ensure_tiny_model,
    load_tokenizer,
    model_dir_for,
)

SMALL = TinyModelSpec(vocab_size=512, corpus_lines=400, hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)  # fmt: skip

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 3*4 + 1+1?"},
    {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3*4"}}},
            {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}},
        ],
    },
    {"role": "tool", "content": "12"},
    {"role": "tool", "content": "2"},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": "12+2"}}}]},
    {"role": "tool", "content": "14"},
    {"role": "assistant", "content": "#### 14"},
    {"role": "user", "content": "Thanks!"},
]


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_build_is_deterministic_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = ensure_tiny_model(tmp_path / "a", SMALL)
    b = ensure_tiny_model(tmp_path / "b", SMALL)
    assert a.name == b.name == f"tiny-qwen2-{SMALL.digest()}"
    assert a == model_dir_for(SMALL, tmp_path / "a")
    assert _files(a) == _files(b)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= set(_files(a))  # fmt: skip
    assert not [p for p in a.parent.iterdir() if ".tmp-" in p.name]  # temp dir was renamed away

    def no_build(*args: object) -> None:
        raise AssertionError("cache hit must not rebuild")

    monkeypatch.setattr(modelzoo, "_build", no_build)
    assert ensure_tiny_model(tmp_path / "a", SMALL) == a


def test_cache_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTLOOP_CACHE_DIR", str(tmp_path))
    assert model_dir_for(SMALL) == tmp_path / "models" / f"tiny-qwen2-{SMALL.digest()}"


def test_concurrent_builders_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_build = modelzoo._build

    def counting_build(spec: TinyModelSpec, out: Path) -> None:
        calls.append(out)
        real_build(spec, out)

    monkeypatch.setattr(modelzoo, "_build", counting_build)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_tiny_model(tmp_path, SMALL))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(spec: TinyModelSpec, out: Path) -> None:
        (out / "half-written").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(modelzoo, "_build", broken)
    with pytest.raises(RuntimeError, match="boom"):
        ensure_tiny_model(tmp_path, SMALL)
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_spec_changes_the_cache_key() -> None:
    assert TinyModelSpec().digest() != TinyModelSpec(seed=1).digest()
    assert TinyModelSpec().digest() == TinyModelSpec().digest()


def test_tokenizer_tokens_and_ids(tiny_model_path: Path) -> None:
    tok = load_tokenizer(tiny_model_path)
    config = json.loads((tiny_model_path / "config.json").read_text())
    assert tok.is_fast
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert config["eos_token_id"] == tok.eos_token_id and config["pad_token_id"] == tok.pad_token_id
    assert config["vocab_size"] % 64 == 0 and config["vocab_size"] >= len(tok)
    assert 1500 <= len(tok) <= 2048
    for t in (*SPECIAL_TOKENS, *TOOL_TOKENS):
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and tok.decode(ids) == t
    text = 'Héllo wörld 🙂 <tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call> #### 42'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)  # no BOS


def _render(tok, messages, gen=False) -> str:  # type: ignore[no-untyped-def]
    return tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=gen)


def test_chat_template_is_append_only(tiny_model_path: Path) -> None:
    tok = load_tokenizer(tiny_model_path)
    for k in range(1, len(CONVERSATION)):
        if CONVERSATION[k]["role"] == "tool" and CONVERSATION[k - 1]["role"] == "tool":
            continue  # consecutive tool results share one user block: not a message boundary
        shorter, longer = _render(tok, CONVERSATION[:k]), _render(tok, CONVERSATION[: k + 1])
        assert longer.startswith(shorter), k
        assert shorter.endswith("<|im_end|>\n")
        # the same holds for token ids: special tokens split the text at every boundary
        ids_short = tok.encode(shorter, add_special_tokens=False)
        assert tok.encode(longer, add_special_tokens=False)[: len(ids_short)] == ids_short
        assert _render(tok, CONVERSATION[:k], gen=True) == shorter + "<|im_start|>assistant\n"


def test_chat_template_layout(tiny_model_path: Path) -> None:
    tok = load_tokenizer(tiny_model_path)
    text = _render(tok, CONVERSATION, gen=True)
    blocks = text.split("<|im_end|>\n")
    roles = [b.split("\n", 1)[0] for b in blocks[:-1]]
    assert roles == ["<|im_start|>system", "<|im_start|>user", "<|im_start|>assistant", "<|im_start|>user",
                     "<|im_start|>assistant", "<|im_start|>user", "<|im_start|>assistant", "<|im_start|>user"]  # fmt: skip
    assert blocks[-1] == "<|im_start|>assistant\n"
    assert text.count("<|im_end|>\n<|im_start|>") == len(roles) - 1 + 1  # every boundary, the prompt included
    assert "<|im_end|><|im_start|>" not in text and "\n\n<|im_start|>" not in text
    system = blocks[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and "<tools>\n" in system
    assert json.dumps(TOOLS[0]) in system
    assert blocks[2] == (
        '<|im_start|>assistant\nLet me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    )
    assert blocks[3] == "<|im_start|>user\n<tool_response>\n12\n</tool_response>\n<tool_response>\n2\n</tool_response>"
    assert blocks[4].startswith("<|im_start|>assistant\n<tool_call>\n")
    # without tools and without a system message nothing is injected
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_model_loads_and_runs(tiny_model_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path))
    n_params = sum(p.numel() for p in model.parameters())
    assert 2_000_000 < n_params < 8_000_000
    assert model.config.tie_word_embeddings and model.dtype == torch.bfloat16
    tok = load_tokenizer(tiny_model_path)
    ids = torch.tensor([tok.encode("What is 3*4?", add_special_tokens=False)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits.float()).all()
