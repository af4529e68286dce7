"""`agentloop tinker serve`'s settings (one pydantic record; the command's flags set them)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

KEY_ENV = "AGENTLOOP_TINKER_KEY"
"""The shared secret a non-local bind requires: clients send it as their Tinker API key (TINKER_API_KEY, which
the SDK wants to start with `tml-`)."""


class TinkerServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = "tiny"
    """The base model: a local HF directory, or `tiny` (the project's tiny model, built once) or a real-model shape
    name of agentloop/models (random weights, e.g. qwen2.5-0.5b-shape)."""
    model_name: str | None = None
    """The name clients pass as base_model (default: the resolved local path, which the SDK's get_tokenizer can
    load with transformers, no hub needed). The local path is accepted too."""
    host: str = "127.0.0.1"
    """Bind address; anything but loopback needs the shared secret in AGENTLOOP_TINKER_KEY."""
    port: int = Field(default=8000, ge=0, le=65535)
    """Port (0: any free one, printed)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the training model and the SGLang server run."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The training model's dtype."""
    run_dir: str = "runs/tinker"
    """Checkpoints (tinker:// paths map to run_dir/checkpoints/...) and the SGLang log."""
    max_lora_rank: int = Field(default=32, ge=1)
    """The largest LoRA rank a training client may ask for (the SGLang server is launched with it)."""
    lora_alpha: float = Field(default=32.0, gt=0)
    """LoRA alpha of every adapter (scale alpha / rank)."""
    allow_full_weights: bool = True
    """Our extension: a create_model whose user_metadata has `agentloop_full_weights: "true"` trains every weight
    (no LoRA); its sampler weights are an HF directory the server loads with update_weights_from_disk."""
    server_url: str | None = None
    """Use this running SGLang server instead of launching one (it must serve the same model with --enable-lora)."""
    poll_s: float = Field(default=20.0, gt=0)
    """How long a retrieve_future waits for a result before answering try_again (the SDK's timeout is 45 s)."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Timeout of one call to the SGLang server."""
    startup_timeout_s: float = Field(default=600.0, gt=0)
    """How long the SGLang server may take to come up."""
