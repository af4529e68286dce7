"""Make `sampling_params.sampling_seed` work on SGLang's CPU engine.

In SGLang 0.5.23 a request's `sampling_seed` is only honoured with
`--enable-deterministic-inference`, which the server refuses unless the attention backend is
one of the GPU ones (not `torch_native`). Without it the seed is accepted and ignored, so
seeded CPU rollouts are not reproducible. This module patches two functions, in the server
processes only, right after SGLang imports their modules:

    SamplingBatchInfo.from_schedule_batch   always builds the per-request seed tensor; requests
                                            without a seed get a random one (stored on the
                                            request, so it survives retraction)
    top_k_top_p_min_p_sampling_from_probs_torch
                                            drops the seed for batches that need min-p (SGLang
                                            asserts on that combination): min-p batches sample
                                            unseeded

SGLang's seeded sampler (Gumbel-max with a hash of seed, position and token id, i.e.
`murmur_hash32_cpu` from ops.py) then makes a request's tokens depend only on its seed, its
positions and its logits, not on what else is in the batch.

Simplified: speculative-decoding paths, which build SamplingBatchInfo directly, are not
patched (speculative decoding is not used on CPU here).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import random
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["install"]

_BATCH_INFO = "sglang.srt.sampling.sampling_batch_info"
_SAMPLER = "sglang.srt.layers.sampler"
_rng = random.SystemRandom()


def _patch_batch_info(module: ModuleType) -> None:
    import torch

    cls = module.SamplingBatchInfo
    if getattr(cls, "_agentloop_seeded", False):
        return
    original = cls.from_schedule_batch.__func__

    def from_schedule_batch(cls_: type, batch: Any, vocab_size: int) -> Any:
        for req in batch.reqs:
            if req.sampling_params.sampling_seed is None:
                req.sampling_params.sampling_seed = _rng.getrandbits(62)
        info = original(cls_, batch, vocab_size)
        if info.sampling_seed is None:
            info.sampling_seed = torch.tensor(
                [req.sampling_params.sampling_seed for req in batch.reqs], dtype=torch.int64, device=batch.device
            )
        return info

    cls.from_schedule_batch = classmethod(from_schedule_batch)
    cls._agentloop_seeded = True


def _patch_sampler(module: ModuleType) -> None:
    original = module.top_k_top_p_min_p_sampling_from_probs_torch
    if getattr(original, "_agentloop_seeded", False):
        return

    def top_k_top_p_min_p_sampling_from_probs_torch(
        probs: Any, top_ks: Any, top_ps: Any, min_ps: Any, need_min_p_sampling: bool, sampling_seed: Any,
        positions: Any, **kwargs: Any,
    ) -> Any:  # fmt: skip
        if need_min_p_sampling:
            sampling_seed = None
        return original(probs, top_ks, top_ps, min_ps, need_min_p_sampling, sampling_seed, positions, **kwargs)

    top_k_top_p_min_p_sampling_from_probs_torch._agentloop_seeded = True  # type: ignore[attr-defined]
    module.top_k_top_p_min_p_sampling_from_probs_torch = top_k_top_p_min_p_sampling_from_probs_torch


_PATCHES: dict[str, Callable[[ModuleType], None]] = {_BATCH_INFO: _patch_batch_info, _SAMPLER: _patch_sampler}


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then the patch."""

    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[ModuleType], None]):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def install() -> None:
    """Patch now for modules already imported, and on import for the others. Idempotent."""
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())
