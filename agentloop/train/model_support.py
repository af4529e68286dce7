"""Which Hugging Face models the learner runs exactly, decided from the model's config alone (no weights).

    check_model_support   a model directory (or its config) -> ModelSupport: the head transform the learner
                          applies, notes on what it applies, and the problems that make it refuse the model
    require_model_support the same, raising ConfigError that names every problem (the learner calls it as it
                          starts; `agentloop train` calls it before it starts anything)
    neutralize_head       switch a built model's own head post-processing off (LogprobHead applies it instead)
    HEAD_TRANSFORMS       model_type -> where and how its forward post-processes the LM head's output
    PRE_HEAD              model types that scale the hidden state before the head (exact as they are)

Why the head: the learner computes logprobs from the final hidden states through the LM head itself, inside
the model's forward (agentloop.train.trainer.logprobs); what the forward does to the head's output afterwards (Gemma-2's
soft cap, Granite's and Cohere's scales) would land on the (logprob, entropy) pairs instead of on the logits. So
the learner takes that step out of the model and applies it in its head, for every model in HEAD_TRANSFORMS;
an unknown model type carrying one of the keys other architectures apply there is refused, and a forward that
still changes the head's output is caught at the first forward pass (LogprobHead.returned_as_is).

Why attention: the learner runs attention through SDPA with its own masks (padded or packed rows, shared
prompts), FlashAttention varlen or FlexAttention (agentloop.train.trainer.attention). None of them applies an attention
logit soft cap, sinks, a sparse index or a position bias, each sequence is attended causally as a whole, and
recurrent or state-space layers would carry their state across the sequences of a packed or shared row. A
sliding window (or a chunked attention) is exact only while no sequence is longer than the window: `max_len`
(the run's model.context_length, else the model's max_position_embeddings) must fit in it.
Simplification: checks go by model_type and config keys of the installed transformers; a model type this
module has never seen passes when none of its keys is suspicious, with the first-forward check as the net.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentloop.errors import ConfigError

# No torch at import time: `agentloop train` calls this before anything heavy starts.


@dataclass(frozen=True)
class HeadPostprocessing:
    """How one architecture's forward changes its LM head's output x."""

    key: str
    """The config key holding the value."""
    op: Literal["softcap", "mul", "div"]
    """softcap: v * tanh(x / v); mul: x * v; div: x / v."""
    attr: str | None = None
    """The forward reads a copy the model keeps as this attribute instead of config.<key>."""


_SOFTCAP = HeadPostprocessing("final_logit_softcapping", "softcap")
_GRANITE = HeadPostprocessing("logits_scaling", "div")
_COHERE = HeadPostprocessing("logit_scale", "mul", attr="logit_scale")

HEAD_TRANSFORMS: dict[str, HeadPostprocessing] = {
    # `logits = tanh(logits / cap) * cap` after lm_head, cap read from self.config at every forward
    "gemma2": _SOFTCAP, "gemma3_text": _SOFTCAP, "gemma3n_text": _SOFTCAP, "gemma4_text": _SOFTCAP,
    "vaultgemma": _SOFTCAP, "nanochat": _SOFTCAP,
    # `logits = logits / self.config.logits_scaling`
    "granite": _GRANITE, "granitemoe": _GRANITE, "granitemoeshared": _GRANITE,
    # `logits = lm_head(h) * self.config.logits_scaling` (the same key as Granite, the other way round)
    "hyperclovax": HeadPostprocessing("logits_scaling", "mul"),
    # `logits = logits * self.logit_scale`, copied from config.logit_scale in __init__
    "cohere": _COHERE, "cohere2": _COHERE, "cohere2_moe": _COHERE,
}
"""Model types whose head post-processing the learner applies itself (transformers 5.19's *ForCausalLM)."""

PRE_HEAD = {"minicpm3": "logits_scaling"}
"""Model types whose scaling key divides the hidden state before the head: the learner's head sees it already."""

_HEAD_KEYS = {"final_logit_softcapping": None, "logit_softcapping": None, "logits_soft_cap": None,
              "output_logit_soft_cap": None, "logits_scaling": 1.0, "logit_scale": 1.0, "lm_head_multiplier": 1.0}
"""Config keys (and their neutral values) that some architecture applies to its head's output."""

_ATTENTION_LAYERS = {"full_attention", "sliding_attention", "attention"}
_STATELESS_LAYERS = {"mlp", "moe"}  # no mixing across positions (Nemotron-H's MLP-only blocks)
_WINDOWED = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}

_REFUSED_TYPES = {
    "gpt_oss": "attention sinks (s_aux), which SDPA, FlashAttention varlen and FlexAttention here ignore",
    "granite_swa": "attention sinks (s_aux), which SDPA, FlashAttention varlen and FlexAttention here ignore",
    "granitemoe_swa": "attention sinks (s_aux), which SDPA, FlashAttention varlen and FlexAttention here ignore",
    "mimo_v2_flash": "attention sinks (s_aux), which SDPA, FlashAttention varlen and FlexAttention here ignore",
    "hy_v4": "sparse attention (an index of attended keys), which the learner's attention does not apply",
    "deepseek_v4": "compressed sparse attention, which the learner's attention does not apply",
    "inkling_text": "a relative position bias inside attention, which the learner's attention does not apply",
    "rwkv": "recurrent layers, whose state would run across the sequences of a packed or shared row",
    "xlstm": "recurrent layers, whose state would run across the sequences of a packed or shared row",
    "recurrent_gemma": "recurrent layers, whose state would run across the sequences of a packed or shared row",
}
"""Model types refused whatever their config says (their attention or layers are outside the learner's)."""

_HEAD_BIAS = {"phi": None, "codegen": None, "gptj": None, "ctrl": None, "phimoe": "lm_head_bias",
              "ernie4_5_moe": "use_bias"}
"""Model types whose LM head has a bias (always, or when this config key is true)."""

_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class HeadTransform:
    """What a model applies to its LM head's output x before the softmax: logits = x * scale, then
    softcap * tanh(logits / softcap) when `softcap` is set (check_model_support reads it from the
    model's config). The identity for most models."""

    scale: float = 1.0
    """Granite: 1 / logits_scaling; Cohere: logit_scale; HyperCLOVAX: logits_scaling."""
    softcap: float | None = None
    """Gemma-2 and kin: final_logit_softcapping."""

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def apply(self, x: Any) -> Any:
        """The model's logits from its raw head output (the plain, non-logprob path of LogprobHead)."""
        import torch

        if self.scale != 1.0:
            x = x * self.scale
        if self.softcap is not None:
            x = torch.tanh(x / self.softcap) * self.softcap
        return x


@dataclass
class ModelSupport:
    """What `check_model_support` found."""

    model_type: str
    head_scale: float = 1.0
    """The head transform the learner's logprob head applies (`transform()`): logits * head_scale, ..."""
    head_softcap: float | None = None
    """... then head_softcap * tanh(logits / head_softcap)."""
    neutral: list[tuple[str, str, Any]] = field(default_factory=list)
    """(where, name, value): what `neutralize_head` sets so the model's forward leaves the head's output alone;
    where is "config" (the text config's key) or "module" (an attribute of the model)."""
    applied: list[str] = field(default_factory=list)
    """What the learner does or decides to match the model exactly (one line each, for the logs)."""
    problems: list[str] = field(default_factory=list)
    """Why the learner cannot run the model exactly (empty: supported)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def transform(self) -> HeadTransform:
        """The HeadTransform the learner's logprob head (agentloop.train.trainer.logprobs) applies."""
        return HeadTransform(scale=self.head_scale, softcap=self.head_softcap)

    def message(self, where: str) -> str:
        return (f"the learner cannot run {where} (model_type {self.model_type!r}) exactly:\n  "
                + "\n  ".join(self.problems))


def _load_config(model: Any) -> Any:
    """A transformers config from a model directory, a config.json path, a dict or a config (returned as is)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    if isinstance(model, Mapping):
        d = dict(model)
        if "model_type" not in d:
            raise ConfigError("model config has no model_type")
        return AutoConfig.for_model(d.pop("model_type"), **d)
    p = Path(model)
    if p.is_file():
        d = json.loads(p.read_text())
        return _load_config(d)
    if not (p / "config.json").is_file():
        raise ConfigError(f"{str(p)!r} is not a Hugging Face model directory (no config.json there)")
    try:
        return AutoConfig.from_pretrained(p)
    except Exception as e:  # re-raised with the directory named
        raise ConfigError(f"transformers cannot read the config of {str(p)!r}: {type(e).__name__}: {e}") from e


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def check_model_support(model: Any, *, max_len: int | None = None) -> ModelSupport:
    """The learner's verdict on `model` (a model directory, its config.json, a dict or a transformers config).

    `max_len`: the longest sequence (prompt + response tokens) the learner will see; None: the model's
    max_position_embeddings. Cheap: reads the config, never the weights."""
    config = _load_config(model)
    tc = _text_config(config)
    mt = str(getattr(config, "model_type", "") or "")
    tmt = str(getattr(tc, "model_type", "") or mt)
    s = ModelSupport(model_type=mt)
    if max_len is None:
        max_len = getattr(tc, "max_position_embeddings", None)

    def val(key: str, default: Any = None) -> Any:
        return getattr(tc, key, default)

    # -- the head's output ----------------------------------------------------------------------------------
    known = HEAD_TRANSFORMS.get(mt)
    if known is not None:
        v = val(known.key)
        if v is not None and not (known.op != "softcap" and float(v) == 1.0):
            v = float(v)
            if not v > 0:
                s.problems.append(f"{known.key}={v:g}: the head transform needs a positive value")
            elif known.op == "softcap":
                s.head_softcap = v
                s.applied.append(f"{known.key}={v:g}: the logprob head soft-caps the logits, "
                                 f"{v:g} * tanh(logits / {v:g})")
            else:
                s.head_scale = v if known.op == "mul" else 1.0 / v
                s.applied.append(f"{known.key}={v:g}: the logprob head scales the logits, logits "
                                 f"{'*' if known.op == 'mul' else '/'} {v:g}")
            if not s.problems:
                neutral = None if known.op == "softcap" else 1.0
                s.neutral.append(("module", known.attr, neutral) if known.attr else ("config", known.key, neutral))
    else:
        for key, neutral in _HEAD_KEYS.items():
            v = val(key)
            if v is None or v == neutral or PRE_HEAD.get(mt) == key or PRE_HEAD.get(tmt) == key:
                continue
            s.problems.append(
                f"{key}={v}: other architectures apply this key to the LM head's output, and agentloop does not "
                f"know what model_type {mt!r} does with it, so the learner's logprobs could be off; use a model "
                "type agentloop lists (agentloop.train.model_support.HEAD_TRANSFORMS) or extend that table")
    unpadded = val("unpadded_vocab_size")
    if unpadded is not None and val("vocab_size") is not None and int(unpadded) < int(val("vocab_size")):
        s.problems.append(f"unpadded_vocab_size={unpadded} < vocab_size={val('vocab_size')}: the model cuts its "
                          "logits to the unpadded vocabulary, the learner's head computes the softmax over all of it; "
                          "not supported")
    if mt in _HEAD_BIAS and (_HEAD_BIAS[mt] is None or val(_HEAD_BIAS[mt])):
        s.problems.append(f"model_type {mt!r} has an LM head bias, which the learner's chunked logprob head does "
                          "not add; use a model without one")

    # -- layers and attention -------------------------------------------------------------------------------
    if mt in _REFUSED_TYPES or tmt in _REFUSED_TYPES:
        s.problems.append(f"model_type {mt!r}: {_REFUSED_TYPES.get(mt) or _REFUSED_TYPES[tmt]}; not supported, "
                          "use another model")
    if getattr(config, "is_encoder_decoder", False):
        s.problems.append("is_encoder_decoder=true: the learner trains decoder-only causal LMs; use one")
    if val("use_bidirectional_attention") is True or val("is_causal") is False:
        s.problems.append("use_bidirectional_attention / is_causal: bidirectional (non-causal) attention, but the "
                          "learner attends causally; use a causal model")
    softcap = val("attn_logit_softcapping")
    if softcap is not None:
        s.problems.append(f"attn_logit_softcapping={softcap:g}: none of the learner's attention paths (SDPA, "
                          "FlashAttention varlen, FlexAttention) soft-caps attention scores, so its logprobs would "
                          "be off; use a model without attention soft-capping")
    kinds = [str(k) for k in (val("layer_types") or [])]
    for key in ("layers_block_type", "block_types"):
        kinds += [str(k) for k in (val(key) or [])]
    other = sorted({k for k in kinds if k not in _ATTENTION_LAYERS and k not in _STATELESS_LAYERS
                    and k not in _WINDOWED})
    if other:
        s.problems.append(f"layer_types {other}: only attention layers (full or sliding) are supported; recurrent, "
                          "linear-attention, state-space and sparse layers would carry state or skip keys across "
                          "the sequences of a packed or shared row; use an attention-only model")
    windows: dict[str, int] = {}
    if val("layer_types"):
        for kind, key in _WINDOWED.items():
            if kind in kinds and val(key):
                windows[key] = int(val(key))
    elif val("sliding_window") and val("use_sliding_window", True) is not False:
        windows["sliding_window"] = int(val("sliding_window"))  # Mistral, Phi-3, Starcoder2: every layer
    if val("attention_chunk_size") and "attention_chunk_size" not in windows and not val("layer_types"):
        windows["attention_chunk_size"] = int(val("attention_chunk_size"))
    for key, w in windows.items():
        if max_len is not None and max_len <= w:
            s.applied.append(f"{key}={w} >= the longest sequence ({max_len} tokens): the window never cuts, "
                             "every layer attends to whole sequences")
        else:
            s.problems.append(
                f"{key}={w}: the window cuts sequences longer than {w} tokens"
                + (f" and sequences may reach {max_len} (model.context_length, else max_position_embeddings)"
                   if max_len is not None else "")
                + f", which the learner's attention paths do not apply; set model.context_length <= {w} to train "
                "within the window, or use a model without it")

    # -- notes ----------------------------------------------------------------------------------------------
    if any((val(k) or 0) > 1 for k in _MOE_KEYS):
        coef = val("router_aux_loss_coef")
        s.applied.append("mixture of experts: the router runs as in the model; its load-balancing loss"
                         + (f" (router_aux_loss_coef={coef:g})" if isinstance(coef, (int, float)) else "")
                         + " is not added to the policy loss")
    return s


def require_model_support(model: Any, *, max_len: int | None = None, where: str | None = None) -> ModelSupport:
    """`check_model_support`, raising ConfigError with every problem when the learner cannot run the model."""
    s = check_model_support(model, max_len=max_len)
    if not s.ok:
        name = where or (str(model) if isinstance(model, (str, Path)) else "this model")
        raise ConfigError(s.message(name))
    return s


def neutralize_head(model: Any, support: ModelSupport) -> None:
    """Make `model`'s forward leave its head's output alone (the learner's LogprobHead applies the transform)."""
    for where, name, value in support.neutral:
        target = _text_config(model.config) if where == "config" else model
        if where == "module" and not isinstance(getattr(target, name, None), (int, float)):
            raise RuntimeError(f"{type(model).__name__}: expected a number in .{name} (the head scale its forward "
                               "applies); this transformers version differs from the one agentloop knows")
        setattr(target, name, value)


__all__ = ["HEAD_TRANSFORMS", "PRE_HEAD", "HeadPostprocessing", "ModelSupport", "check_model_support",
           "neutralize_head", "require_model_support"]
