"""Before the first step: every server serves the run's model, at the weight version the run expects.

`agentloop train --server-url` does not start its servers, so it asks them (GET /model_info) instead of assuming:
    check_served_model    right after connecting, each server's model against model.path: another model type or
                          architecture, or (when the server's model_path is readable here) other sizes, is a
                          ConfigError naming both; a server whose model_path cannot be read here (another host,
                          a hub id) passes on model type and architecture, with a warning
    align_served_weights  before step 1 of a fresh run: a server started with other weights of the same shape
                          is a ConfigError naming both; a server some run has updated (a numeric weight_version
                          other than 0, or other weights) is reloaded with model.path at version 0. A resumed run
                          reloads weights/step-C into every server itself (Trainer.resume_weights).
    weights_fingerprint   size and sampled bytes of a directory's weight files: a copy of model.path is the same
Servers the run launched pass at once (their model_path is model.path, their weight_version "default").

What SGLang 0.5.23 tells: /model_info names model_path (moved to the new directory by every
update_weights_from_disk), model_type, architectures and weight_version ("default" until an update sets one);
no vocabulary size or layer sizes, hence the server's config.json where it can be read.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentloop.errors import ConfigError
from agentloop.server_manager import ServerManager, parse_version

_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "tie_word_embeddings", "num_experts", "num_local_experts",
              "n_routed_experts", "moe_intermediate_size", "sliding_window", "layer_types", "rope_parameters",
              "rope_theta")
"""Config keys that make two models of one architecture different models (dtype and versions do not)."""

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_SAMPLE = 1 << 20


def _say(line: str) -> None:
    print(f"agentloop train: {line}", file=sys.stderr, flush=True)


@dataclass
class ServedModel:
    """One server's answer, checked against model.path."""

    url: str
    model_path: str
    """The directory (or hub id) the server says its weights came from."""
    weight_version: Any
    """Its weight_version label as it reported it ("default" until a weight update sets one)."""
    model_type: str | None
    same_weights: bool | None
    """True: model.path itself or a copy of its weight files; False: other weights; None: cannot tell here."""

    @property
    def version(self) -> int | None:
        return parse_version(self.weight_version)


def weights_fingerprint(model_dir: Path) -> str | None:
    """sha256 over the size and three 1 MiB samples (start, middle, end) of each weight file, in name order;
    None without weight files. Fine-tuned weights differ everywhere, so samples tell them apart, and a copy of
    a 60 GB model is recognised by reading 3 MiB per file. None too when the directory went away while it was read
    (a resumed run's learner retrains the steps a server may still serve, and replaces their directories)."""
    try:
        return _fingerprint(model_dir)
    except FileNotFoundError:
        return None


def _fingerprint(model_dir: Path) -> str | None:
    files = sorted(f for f in model_dir.iterdir() if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(str(size).encode())
        with f.open("rb") as fh:
            for off in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
                fh.seek(off)
                h.update(fh.read(_SAMPLE))
    return h.hexdigest()


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _sizes(model_dir: Path) -> dict[str, Any]:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    tc = cfg.get_text_config() if callable(getattr(cfg, "get_text_config", None)) else cfg
    d = tc.to_dict()
    return {k: d.get(k) for k in _SIZE_KEYS}


def _refusal(errors: list[str]) -> ConfigError:
    return ConfigError("the servers do not serve model.path:\n  " + "\n  ".join(errors)
                       + "\nstart the servers with --model-path set to model.path, or pass the model they serve as "
                         "--model (model.path)")


async def check_served_model(sm: ServerManager, model_path: Path, *,
                             say: Callable[[str], None] = _say) -> list[ServedModel]:
    """Every server's /model_info against model.path; ConfigError naming both sides when one serves another
    model. Returns what each server serves, for `align_served_weights`."""
    from transformers import AutoConfig

    model_path = Path(model_path)
    ours = AutoConfig.from_pretrained(model_path)
    our_type, our_arch = ours.model_type, list(ours.architectures or [])
    our_sizes: dict[str, Any] | None = None
    our_print: str | None = None
    served: list[ServedModel] = []
    errors: list[str] = []
    for i, url in enumerate(sm.urls):
        info = await sm.model_info(i, timeout=sm.cfg.admin_timeout_s)
        if info is None:
            errors.append(f"{url} did not answer GET /model_info, so which model it serves is unknown")
            continue
        path = str(info.get("model_path") or "")
        mtype, arch = info.get("model_type"), list(info.get("architectures") or [])
        theirs = f"{path or '(no model_path)'} (model_type {mtype}, {'/'.join(arch) or 'no architectures'})"
        if (mtype is not None and mtype != our_type) or (arch and our_arch and arch != our_arch):
            errors.append(f"{url} serves {theirs}, but model.path is {model_path} "
                          f"(model_type {our_type}, {'/'.join(our_arch)})")
            continue
        same: bool | None = None
        p = Path(path) if path else None
        if p is not None and _same_dir(p, model_path):
            same = True
        elif p is not None and (p / "config.json").is_file():
            our_sizes = our_sizes if our_sizes is not None else _sizes(model_path)
            their_sizes = _sizes(p)
            diff = [f"{k} {their_sizes[k]} vs {our_sizes[k]}" for k in _SIZE_KEYS if their_sizes[k] != our_sizes[k]]
            if diff:
                errors.append(f"{url} serves {theirs}, a different model from model.path {model_path} "
                              f"(server vs model.path: {', '.join(diff)})")
                continue
            our_print = our_print if our_print is not None else (weights_fingerprint(model_path) or "")
            theirs_print = weights_fingerprint(p)
            same = None if not our_print or theirs_print is None else theirs_print == our_print
        else:
            say(f"warning: {url} serves {path!r}, which cannot be read here (another host, or a hub id): only its "
                f"model type and architecture ({mtype}, {'/'.join(arch)}) were checked against model.path "
                f"{model_path}")
        served.append(ServedModel(url, path, info.get("weight_version"), mtype, same))
    if errors:
        raise _refusal(errors)
    return served


async def align_served_weights(sm: ServerManager, served: list[ServedModel], model_path: Path, first: int, *,
                               say: Callable[[str], None] = _say) -> None:
    """Before step `first`: on a fresh run (first == 1) every server must hold model.path's weights at version 0.
    Started with other weights (no numeric version): ConfigError naming both. Updated by a run (a numeric
    version other than 0, or other weights): reloaded with model.path at version 0. A resumed run loads
    weights/step-(first-1) into every server next, so nothing is done here."""
    if first > 1:
        return
    errors: list[str] = []
    for s in served:
        if s.version is None and s.same_weights is False:
            errors.append(f"{s.url} serves {s.model_path} (weight_version {s.weight_version!r}): the same "
                          f"architecture and sizes as model.path {model_path}, but other weights")
    if errors:
        raise _refusal(errors)
    for s in served:
        if s.version is None or (s.version == 0 and s.same_weights is not False):
            continue
        say(f"server {s.url} serves {s.model_path} at weight version {s.weight_version!r}; a fresh run starts at "
            f"version 0: reloading {model_path} into it")
        await sm.update_weights_from_disk(str(model_path), weight_version=0, urls=[s.url])


__all__ = ["ServedModel", "align_served_weights", "check_served_model", "weights_fingerprint"]
