"""Which model a run uses and its tokenizer: `resolve_model` (cfg.model.path or the tiny model, built once),
`load_tokenizer_for` (the tokenizer plus the context length loops must respect), and `copy_aux_files` (what an
exported model directory takes from its base besides weights and config)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from agentloop.config import Config
from agentloop.errors import ConfigError
from agentloop.models.modelzoo import ensure_tiny_model


def resolve_model(cfg: Config) -> Path:
    if cfg.model.path:
        p = Path(cfg.model.path)
        if not (p / "config.json").is_file():
            raise ConfigError(f"model.path={cfg.model.path!r} is not a Hugging Face model directory "
                              "(no config.json there)")
        return p
    return ensure_tiny_model()



def copy_aux_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config, chat template...: every top-level file of model directory `src` except
    weights and config.json, copied into `dst` (an exported model directory the servers and transformers load)."""
    skip_suffix = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
    for f in Path(src).iterdir():
        if not f.is_file() or f.name == "config.json" or f.name.endswith(skip_suffix) or f.name.endswith(".index.json"):
            continue
        shutil.copy2(f, Path(dst) / f.name)


def load_tokenizer_for(cfg: Config, model_path: Path) -> Any:
    tok_path = Path(cfg.model.tokenizer_path) if cfg.model.tokenizer_path else model_path
    try:
        if (tok_path / "tokenizer.json").is_file():
            # The fast backend straight from tokenizer.json: the same ids AutoTokenizer's fast class
            # gives, without AutoTokenizer's ~5 s of class resolution on every start.
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast.from_pretrained(str(tok_path))
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(tok_path))
    except Exception as e:  # re-raised with the path named
        raise ConfigError(f"cannot load a tokenizer from {str(tok_path)!r}: {e}") from e
    if getattr(tok, "chat_template", None) is None and cfg.data.apply_chat_template:
        # a base model's tokenizer: fine when prompts are sent as written (TinyZero's raw prompts)
        raise ConfigError(f"tokenizer at {str(tok_path)!r} has no chat_template, and data.apply_chat_template=true "
                          "renders every prompt with one: set model.tokenizer_path to a tokenizer that has one (e.g. "
                          "the instruct model's), or set data.apply_chat_template=false to send each row's single "
                          "text message as is (a base model)")
    ctx = cfg.model.context_length
    if ctx is None:
        try:
            mc = json.loads((model_path / "config.json").read_text())
            ctx = int(mc.get("max_position_embeddings") or 0) or None
        except (OSError, ValueError):
            ctx = None
    tok.agentloop_context_length = ctx
    return tok
