"""The cached build: install the shipped weights when the spec and base model match, else train here."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from agentloop.models.modelzoo import (
    default_cache_dir,
    ensure_tiny_model,
    load_tokenizer,
)
from agentloop.models.warmstart.sft import train_sft
from agentloop.models.warmstart.spec import (
    _COPIED_FILES,
    CODE_VERSION,
    DEFAULT_SPEC,
    SHIPPED_DIR,
    WarmStartSpec,
)
from agentloop.models.warmstart.traces import build_traces
from agentloop.util.cache import build_once

logger = logging.getLogger(__name__)


def warm_model_dir_for(spec: WarmStartSpec, base_dir: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Where `ensure_warm_model` puts (or finds) the model of `spec` trained from `base_dir`."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "models" / f"warm-{spec.digest(Path(base_dir).name)}"


def ensure_warm_model(cache_dir: str | Path | None = None, spec: WarmStartSpec | None = None, *,
                      base_dir: str | Path | None = None) -> Path:
    """The warm-started model's directory (weights, config, tokenizer), building it on first use.

    `base_dir` defaults to the project's tiny model (`ensure_tiny_model(cache_dir)`). Safe across
    processes: an fcntl lock serialises builders, the build happens in a temp dir next to the target
    and is renamed into place, so a reader sees either nothing or a complete directory.
    """
    spec = spec or DEFAULT_SPEC
    base = Path(base_dir) if base_dir is not None else ensure_tiny_model(cache_dir)
    target = warm_model_dir_for(spec, base, cache_dir)
    shipped = shipped_artefact()
    if shipped is not None and shipped["digest"] == target.name and shipped["base_model"] == base.name:
        return build_once(target, lambda tmp: _install_shipped(shipped, base, tmp))
    if spec.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"warm start {target.name}: its spec trains on {spec.device!r} but no GPU is "
                               "visible and no shipped artefact matches; pass a spec with device='cpu' "
                               "(hours on 2 cores) or build it on a GPU (benchmarks/gpu_build_warm.sh)")
    return build_once(target, lambda tmp: _build(spec, base, tmp))


def shipped_artefact() -> dict[str, Any] | None:
    """The manifest of the warm model shipped in the package (None when the package has none)."""
    manifest = SHIPPED_DIR / "artefact.json"
    return json.loads(manifest.read_text()) if manifest.is_file() else None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _install_shipped(manifest: dict[str, Any], base: Path, out: Path) -> None:
    """Copy the shipped weights next to the locally built tokenizer, checking every checksum.

    The tokenizer is rebuilt locally (modelzoo), not shipped; its hash must equal the one the weights
    were trained with, or the ids would mean different strings and the model would emit noise.
    """
    tok_sha = _sha256(base / "tokenizer.json")
    if tok_sha != manifest["tokenizer_sha256"]:
        raise RuntimeError(f"shipped warm model {manifest['digest']}: the local tokenizer {base / 'tokenizer.json'} "
                           f"hashes to {tok_sha[:12]}, the weights were trained with "
                           f"{manifest['tokenizer_sha256'][:12]}; rebuild the warm start on a GPU")
    for name, sha in manifest["files"].items():
        src = SHIPPED_DIR / name
        if not src.is_file() or _sha256(src) != sha:
            raise RuntimeError(f"shipped warm model {manifest['digest']}: {src} is missing or corrupt "
                               f"(expected sha256 {sha[:12]})")
        shutil.copyfile(src, out / name)
    for name in _COPIED_FILES:
        if (base / name).is_file() and not (out / name).exists():
            shutil.copyfile(base / name, out / name)
    logger.info("warm start %s installed from the package (built %s)", manifest["digest"], manifest["built_on"])


def _quiet_hf():
    """Context manager: transformers' progress bars off (restored after)."""
    from contextlib import contextmanager

    from transformers.utils import logging as hf_logging

    @contextmanager
    def quiet():
        was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            if was_on:
                hf_logging.enable_progress_bar()

    return quiet()


def _build(spec: WarmStartSpec, base: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.monotonic()
    tok = load_tokenizer(base)
    traces = build_traces(tok, spec)
    t_traces = time.monotonic() - t0
    threads = torch.get_num_threads()
    det = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(spec.num_threads)
    torch.use_deterministic_algorithms(spec.device == "cpu")
    try:
        with torch.random.fork_rng(devices=[]), _quiet_hf():
            torch.manual_seed(spec.seed)
            model = AutoModelForCausalLM.from_pretrained(str(base), dtype="auto")
            saved_dtype = next(model.parameters()).dtype
            model = model.float().to(spec.device)
            losses = train_sft(model, traces, spec, pad_id=tok.pad_token_id)
            model = model.to("cpu", saved_dtype)
            model.save_pretrained(str(out), safe_serialization=True)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)
    for name in _COPIED_FILES:
        if (base / name).is_file():
            shutil.copyfile(base / name, out / name)
    n_tool = sum(t.uses_tool for t in traces)
    meta = {
        "code_version": CODE_VERSION,
        "base_model": base.name,
        "spec": spec.model_dump(mode="json"),
        "traces": {"total": len(traces), "tool": n_tool, "direct": len(traces) - n_tool,
                   "tokens": sum(len(t.ids) for t in traces),
                   "assistant_tokens": sum(sum(t.mask) for t in traces)},
        "loss": {"first": losses[0], "last": losses[-1], "every_10": losses[::10]},
    }
    (out / "agentloop_warmstart.json").write_text(json.dumps(meta, indent=2) + "\n")
    logger.info("warm start built in %.1fs (traces %.1fs): loss %.3f -> %.3f", time.monotonic() - t0, t_traces,
                losses[0], losses[-1])
