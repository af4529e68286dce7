"""The model built on the meta device for the GPU plan: its exact parameter count, no weights read or allocated.

    parameter_count   a config.json dict -> the parameters of the causal LM transformers builds from it, as the
                      learner builds it (AutoModelForCausalLM.from_config), on the meta device under
                      accelerate.init_empty_weights; a tied head counted once. None: no model_type transformers
                      knows (a bare dict of sizes), where the plan estimates from the sizes
                      (memory.ModelShape.from_config)

Counted, not estimated: biases (Qwen2's q/k/v), per-head norms (Qwen3's q/k norm), a mixture's router and shared
experts, whatever the architecture has. A 3B model builds in well under a second; nothing is allocated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any


def parameter_count(config: Mapping[str, Any]) -> int | None:
    """The causal LM's parameters (module doc); None when `config` names no model_type transformers builds.
    A multimodal config's `text_config` is the language model, as for the rest of the plan. Built once per
    config (the preflight's model check and its plan ask for the same one)."""
    return _count(json.dumps(config, sort_keys=True, default=str))


@lru_cache(maxsize=8)
def _count(config_json: str) -> int | None:
    c = json.loads(config_json)
    if isinstance(c.get("text_config"), Mapping):
        c = dict(c["text_config"])
    model_type = c.pop("model_type", None)
    if not isinstance(model_type, str):
        return None
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    for k in ("architectures", "auto_map", "transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        c.pop(k, None)
    try:
        hf_config = AutoConfig.for_model(model_type, **c)
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError, TypeError, AttributeError):  # a model_type or a config transformers cannot build
        return None
    model.tie_weights()  # init_empty_weights' parameters are made one by one: tie them as loading would
    return sum(p.numel() for p in model.parameters())  # a tied weight is one parameter


__all__ = ["parameter_count"]
