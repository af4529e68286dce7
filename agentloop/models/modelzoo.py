"""The project's own tiny Qwen2-architecture model and tokenizer, built once and cached.

Nothing is downloaded: a byte-level BPE tokenizer is trained on a synthetic corpus this
module generates (arithmetic, short instructions, JSON tool calls, python snippets), and a
`Qwen2ForCausalLM` is initialised from a seeded RNG. The model is untrained: its outputs
are near-uniform noise, which is all the plumbing tests need (real token ids, real
logprobs, a real chat template, a real SGLang server).

Map:
    TinyModelSpec        every knob of the build; its hash names the cache directory
    ensure_tiny_model    cached build (file lock + temp dir + atomic rename), returns the dir
    MODEL_SHAPES         named real-model shapes (Qwen2.5-0.5B) for benchmarks, random weights
    shape_config         the Qwen2Config of a named shape
    ensure_shape_model   cached random-weight model of a named shape, with the tiny tokenizer
    resolve_named_model  `tiny`, a shape name or a model directory (a command line's --model) -> its directory
    load_tokenizer       `PreTrainedTokenizerFast` from a model (or tokenizer) directory
    CHAT_TEMPLATE        our Qwen2.5-style ChatML Jinja template with tool support
    build_corpus         the synthetic training text (deterministic in the seed)

Determinism: the same spec (and CODE_VERSION, and library versions) gives byte-identical
files. Changing anything that changes the files must bump CODE_VERSION.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentloop.util.cache import build_once

__all__ = [
    "CHAT_TEMPLATE",
    "CODE_VERSION",
    "SPECIAL_TOKENS",
    "TOOL_TOKENS",
    "MODEL_SHAPES",
    "TinyModelSpec",
    "build_corpus",
    "default_cache_dir",
    "ensure_shape_model",
    "ensure_tiny_model",
    "load_tokenizer",
    "model_dir_for",
    "resolve_named_model",
    "shape_config",
]

CODE_VERSION = "2"
"""Bumped whenever the build code changes its output for an unchanged spec."""

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
"""Special tokens (skipped by `skip_special_tokens`), in id order after the BPE vocabulary."""
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Added (non-special) tokens, each always one token, after SPECIAL_TOKENS."""

# Split pattern applied before byte-level BPE: contractions, letter runs with one optional
# leading non-letter, single digits (so numbers are digit sequences, as in Qwen2), punctuation
# runs, newlines, and whitespace.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML with tools, written for this project. Layout of one conversation:
#   <|im_start|>system\n{system}\n\n# Tools ...<tools>\n{tool json}\n</tools> ...<|im_end|>\n
#   <|im_start|>user\n{content}<|im_end|>\n
#   <|im_start|>assistant\n{content}\n<tool_call>\n{json}\n</tool_call><|im_end|>\n
#   <|im_start|>user\n<tool_response>\n{r1}\n</tool_response>\n<tool_response>\n{r2}\n</tool_response><|im_end|>\n
#   <|im_start|>assistant\n                      (add_generation_prompt)
# Consecutive `tool` messages share one user block; the block is closed after the last of them.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set ns.system = messages[0].content -%}"
    "{%- set rest = messages[1:] -%}"
    "{%- else -%}"
    "{%- set rest = messages -%}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if ns.system -%}{{- ns.system + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou can call the functions below to help with the request. '"
    " 'Their signatures are listed inside <tools></tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call a function, answer with one JSON object per call, each inside '"
    " '<tool_call></tool_call>:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": '"
    " '<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif messages and messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in rest -%}"
    "{%- if message.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if message.content -%}{{- message.content -}}{%- endif -%}"
    "{%- if message.tool_calls -%}"
    "{%- for tc in message.tool_calls -%}"
    "{%- if tc.function is defined -%}{%- set tc = tc.function -%}{%- endif -%}"
    "{%- if message.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (tc.name | tojson) + ', \"arguments\": ' -}}"
    "{%- if tc.arguments is string -%}{{- tc.arguments -}}{%- else -%}{{- tc.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class TinyModelSpec(BaseModel):
    """Everything that determines the tiny model's files; its hash names the cache entry."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    vocab_size: int = Field(default=2048, ge=300)
    """Target tokenizer size: byte-level BPE merges plus the special and tool tokens."""
    corpus_lines: int = Field(default=6000, ge=100)
    """Number of synthetic corpus lines the tokenizer is trained on."""
    hidden_size: int = Field(default=256, ge=16)
    """Model width."""
    num_hidden_layers: int = Field(default=4, ge=1)
    """Decoder layers."""
    num_attention_heads: int = Field(default=4, ge=1)
    """Query heads (head_dim = hidden_size / heads)."""
    num_key_value_heads: int = Field(default=2, ge=1)
    """KV heads (grouped-query attention)."""
    intermediate_size: int = Field(default=768, ge=16)
    """MLP width."""
    max_position_embeddings: int = Field(default=4096, ge=64)
    """Context length the server allows."""
    rope_theta: float = Field(default=10000.0, gt=0)
    """RoPE base."""
    initializer_range: float = Field(default=0.02, gt=0)
    """Std of the normal weight init."""
    vocab_multiple: int = Field(default=64, ge=1)
    """The model's vocab (embedding rows) is the tokenizer size rounded up to this."""
    dtype: str = Field(default="bfloat16", pattern="^(bfloat16|float16|float32)$")
    """Weights dtype on disk (and `torch_dtype` in config.json)."""
    seed: int = 0
    """Seed of the corpus and of the weight init."""

    def digest(self) -> str:
        """Short hash of the spec and CODE_VERSION (the cache key)."""
        payload = json.dumps({"code": CODE_VERSION, "spec": self.model_dump(mode="json")}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """`$AGENTLOOP_CACHE_DIR`, else `~/.cache/agentloop`."""
    env = os.environ.get("AGENTLOOP_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "agentloop"


def model_dir_for(spec: TinyModelSpec, cache_dir: str | Path | None = None) -> Path:
    """Where `ensure_tiny_model` puts (or finds) the model of `spec`."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "models" / f"tiny-qwen2-{spec.digest()}"


def ensure_tiny_model(cache_dir: str | Path | None = None, spec: TinyModelSpec | None = None) -> Path:
    """The tiny model's directory (weights, config, tokenizer), building it on first use.

    Safe across processes: an fcntl lock serialises builders, the build happens in a temp
    dir next to the target and is renamed into place, so a reader sees either nothing or a
    complete directory.
    """
    spec = spec or TinyModelSpec()
    return build_once(model_dir_for(spec, cache_dir), lambda tmp: _build(spec, tmp))


MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b-shape": dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
    ),
    "qwen2.5-1.5b-shape": dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
    ),
    "qwen2.5-3b-shape": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
    ),
}
"""Qwen2 config fields of real model shapes, for benchmarks that need the real compute and memory
of a model but not its weights (so nothing is downloaded). Qwen2.5-0.5B: 494M parameters; 1.5B: 1.54B;
3B: 3.09B (all with tied embeddings, as the released models)."""


def shape_config(name: str, *, bos_token_id: int = 1, eos_token_id: int = 2, pad_token_id: int = 0,
                 dtype: str = "bfloat16") -> Any:
    """`Qwen2Config` of the shape `name` in MODEL_SHAPES (token ids and dtype as given)."""
    from transformers import Qwen2Config

    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {sorted(MODEL_SHAPES)}")
    return Qwen2Config(**MODEL_SHAPES[name], bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                       pad_token_id=pad_token_id, torch_dtype=dtype)


def ensure_shape_model(name: str = "qwen2.5-0.5b-shape", cache_dir: str | Path | None = None, *,
                       seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Directory of a random-weight model of shape `name` (built once, cached like the tiny model).

    It carries the tiny model's tokenizer files and token ids, so it is a complete model directory
    (SGLang can serve it, the learner can load it); its vocabulary is the shape's, far larger than
    the tokenizer's, which only matters for decoding random ids. Building the 0.5B shape takes
    ~10-30 s of CPU (seeded init + a ~1 GB bf16 safetensors write).
    """
    shape_config(name)  # an unknown name fails before anything is built
    tiny = ensure_tiny_model(cache_dir)
    tc = json.loads((tiny / "config.json").read_text())
    payload = json.dumps({"code": CODE_VERSION, "shape": MODEL_SHAPES[name], "seed": seed, "dtype": dtype,
                          "tiny": tiny.name}, sort_keys=True)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / "models" / f"{name}-{hashlib.sha256(payload.encode()).hexdigest()[:12]}"

    def build(out: Path) -> None:
        import shutil

        import torch
        from transformers import Qwen2ForCausalLM

        config = shape_config(name, bos_token_id=tc["bos_token_id"], eos_token_id=tc["eos_token_id"],
                              pad_token_id=tc["pad_token_id"], dtype=dtype)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen2ForCausalLM(config)
        model.to(getattr(torch, dtype)).save_pretrained(str(out), safe_serialization=True)
        for f in tiny.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
                shutil.copy(f, out / f.name)

    return build_once(target, build)


def resolve_named_model(name: str) -> Path:
    """A model named on a command line: `tiny` (built once), a MODEL_SHAPES name (random weights, built once) or
    a directory holding a Hugging Face config.json."""
    from agentloop.errors import ConfigError

    if name == "tiny":
        return ensure_tiny_model()
    if name in MODEL_SHAPES:
        return ensure_shape_model(name)
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"--model {name!r}: not 'tiny', not one of {sorted(MODEL_SHAPES)}, "
                          "and not a directory with a config.json")
    return path


def load_tokenizer(path: str | Path) -> Any:
    """`PreTrainedTokenizerFast` of a model directory built here (or any HF tokenizer dir)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


# ---------------------------------------------------------------- corpus

_NAMES = ["Ada", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kai", "Lu", "Max", "Nia"]
_THINGS = ["apples", "books", "coins", "eggs", "marbles", "pens", "stamps", "cards", "shells", "boxes"]
_VERBS = ["Compute", "Calculate", "Evaluate", "Find", "Work out", "Determine", "Solve"]
_INSTRUCTIONS = [
    "Answer the question.",
    "Think step by step.",
    "Put the final answer after ####.",
    "Give the final answer in \\boxed{}.",
    "Use the calculator tool if needed.",
    "You are a helpful assistant.",
    "Please be brief and precise.",
    "Show your work, then state the answer.",
    "Write a short python function.",
    "Return only the number.",
]
_WORDS = (
    "the a an of to and in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how said "
    "each she which do their time if will way about many then them write would like so these her "
    "long make thing see him two has look more day could go come did number sound no most people "
    "my over know water than call first who may down side been now find any new work part take get "
    "place made live where after back little only round man year came show every good me give our "
    "under name very through just form sentence great think say help low line differ turn cause much "
    "mean before move right boy old too same tell does set three want air well also play small end "
    "put home read hand port large spell add even land here must big high such follow act why ask "
    "answer question tool result function value total left each more less step final"
).split()
_PY_SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "def solve(x):\n    total = 0\n    for i in range(x):\n        total += i\n    return total\n",
    "import math\nprint(math.sqrt({n}))\n",
    "result = {a} * {b} + {c}\nprint(result)\n",
    "numbers = [{a}, {b}, {c}]\nprint(sum(numbers) / len(numbers))\n",
    "if {a} > {b}:\n    print(\"yes\")\nelse:\n    print(\"no\")\n",
    "class Counter:\n    def __init__(self):\n        self.n = 0\n\n    def step(self):\n        self.n += 1\n",
    "with open(\"data.json\") as f:\n    rows = json.load(f)\n",
    "x = [i ** 2 for i in range({n})]\nprint(x[-1])\n",
]


def _pseudo_words(rng: random.Random, n: int) -> list[str]:
    """Pronounceable made-up words, so the BPE sees more than a few hundred distinct words."""
    onsets = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
              "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "sl", "st", "th", "tr", ""]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "ng", "ck", "st", "nd", "rt"]
    return [
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3)))
        for _ in range(n)
    ]


def _sentence(rng: random.Random, extra: list[str]) -> str:
    words = [
        rng.choice(_WORDS) if rng.random() < 0.6 else extra[min(int(rng.expovariate(1 / 800)), len(extra) - 1)]
        for _ in range(rng.randint(4, 14))
    ]
    s = " ".join(words)
    return s[0].upper() + s[1:] + rng.choice([".", ".", "?", "!"])


def _arith(rng: random.Random) -> tuple[str, str, int]:
    a, b = rng.randint(0, 999), rng.randint(1, 99)
    op = rng.choice(["+", "-", "*"])
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a} {op} {b}", f"{a}{op}{b}", value


def build_corpus(lines: int, seed: int) -> list[str]:
    """Synthetic tokenizer-training text, deterministic in (lines, seed)."""
    rng = random.Random(seed)
    extra = _pseudo_words(rng, 4000)
    out: list[str] = []
    for i in range(lines):
        kind = i % 8
        if kind == 0:
            expr, _, v = _arith(rng)
            out.append(f"{rng.choice(_VERBS)} {expr}. {rng.choice(_INSTRUCTIONS)}\n{expr} = {v}\n#### {v}")
        elif kind == 1:
            expr, _, v = _arith(rng)
            out.append(f"What is {expr}?\nThe answer is \\boxed{{{v}}}.")
        elif kind == 2:
            name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            out.append(
                f"{name} has {a} {thing} and buys {b} more. How many {thing} does {name} have now?\n"
                f"{name} has {a} + {b} = {a + b} {thing}.\n#### {a + b}"
            )
        elif kind == 3:
            _, compact, v = _arith(rng)
            call = json.dumps({"name": "calculator", "arguments": {"expression": compact}})
            out.append(f"<tool_call>\n{call}\n</tool_call>\n<tool_response>\n{v}\n</tool_response>")
        elif kind == 4:
            tool = {
                "type": "function",
                "function": {
                    "name": rng.choice(["calculator", "python", "search", "lookup"]),
                    "description": _sentence(rng, extra),
                    "parameters": {
                        "type": "object",
                        "properties": {"expression": {"type": "string", "description": _sentence(rng, extra)}},
                        "required": ["expression"],
                    },
                },
            }
            out.append(json.dumps(tool))
        elif kind == 5:
            snippet = rng.choice(_PY_SNIPPETS)
            out.append(
                snippet.format(a=rng.randint(0, 99), b=rng.randint(0, 99), c=rng.randint(0, 99), n=rng.randint(1, 500))
            )
        elif kind == 6:
            user, reply = _sentence(rng, extra), _sentence(rng, extra)
            out.append(f"system\n{rng.choice(_INSTRUCTIONS)}\nuser\n{user}\nassistant\n{reply}")
        else:
            out.append(" ".join(_sentence(rng, extra) for _ in range(rng.randint(1, 4))))
    return out


# ---------------------------------------------------------------- build


def _train_tokenizer(spec: TinyModelSpec) -> Any:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    n_added = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - n_added,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(build_corpus(spec.corpus_lines, spec.seed), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tok


def _tokenizer_config(tok: Any, spec: TinyModelSpec) -> dict[str, Any]:
    decoder = {}
    for t in (*SPECIAL_TOKENS, *TOOL_TOKENS):
        decoder[str(tok.token_to_id(t))] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": spec.max_position_embeddings,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n")


def _build(spec: TinyModelSpec, out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = _train_tokenizer(spec)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tok, spec))
    _write_json(
        out / "special_tokens_map.json",
        {"additional_special_tokens": [IM_START, IM_END], "eos_token": IM_END, "pad_token": PAD_TOKEN},
    )

    pad_id, eos_id = tok.token_to_id(PAD_TOKEN), tok.token_to_id(IM_END)
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    vocab = -(-n_tok // spec.vocab_multiple) * spec.vocab_multiple
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=pad_id,  # as in Qwen2.5: no BOS is prepended; the id is <|endoftext|>
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype=spec.dtype,
    )
    dtype = getattr(torch, spec.dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(config)
    model = model.to(dtype).eval()
    from transformers.utils import logging as hf_logging

    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out), safe_serialization=True)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    # Token ids only: SGLang turns sampling fields found here into default chat sampling params.
    GenerationConfig(bos_token_id=pad_id, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id).save_pretrained(str(out))
    _write_json(out / "agentloop_spec.json", {"code_version": CODE_VERSION, "spec": spec.model_dump(mode="json")})
