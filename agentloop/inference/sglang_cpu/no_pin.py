"""Pinned host memory without CUDA: a no-op in CPU SGLang servers (their LoRA layers pin small index tensors).

SGLang's LoRA serving (--enable-lora; agentloop.train.lora, the torch_native LoRA backend on CPU) builds
`torch.tensor(..., pin_memory=True)` and calls `.pin_memory()` on host tensors unconditionally; without an NVIDIA
driver both raise "Found no NVIDIA driver". Pinning only speeds host-to-GPU copies, which a CPU engine never
makes, so in a process without CUDA `install` makes the factories ignore `pin_memory=True` and `Tensor.pin_memory`
return the tensor itself. Only on PYTHONPATH of agentloop's CPU servers (site/common_ops.py); a machine with CUDA
is left as it is.
"""

from __future__ import annotations

import functools

_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "as_tensor")
_installed = False


def install() -> bool:
    """Patch torch in this process when it has no CUDA; True when patched (idempotent)."""
    global _installed
    import torch

    if _installed or torch.cuda.is_available():
        return _installed
    for name in _FACTORIES:
        fn = getattr(torch, name, None)
        if fn is None:
            continue

        @functools.wraps(fn)
        def unpinned(*args, _fn=fn, **kwargs):
            kwargs.pop("pin_memory", None)
            return _fn(*args, **kwargs)

        setattr(torch, name, unpinned)
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]
    _installed = True
    return True


__all__ = ["install"]
