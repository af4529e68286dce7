"""A one-rank learner's LoRA adapter as one flattened bucket, built without per-tensor Python work on each push.

weight_sync=tensor pushes the adapter every step. Read tensor by tensor, a rank-32 adapter of the 0.5B shape is 336
parameters, each a detach, a reshape, a split view and a metadata record: ~10 ms of host time per push on an H200's
host (GPU acceptance s5, `lora push parts`), a fifth of the 50 ms the whole push may take. The parameters' storage
does not move between steps (the optimizer writes in place), so their flat views and the bucket's metadata are made
once and each push is one concatenation and one cast.

Map:
    AdapterView      the views and the metadata; `bucket()` the uint8 bucket; `current()` whether still valid
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from agentloop.train.lora import PEFT_PREFIX, is_lora_key
from agentloop.train.weights.sync import ParamMeta, bucket_metadata


def _local(p: Any) -> Any:
    """The tensor holding parameter `p`'s values on a one-rank mesh: a DTensor's local tensor, else `p` itself."""
    return getattr(p, "_local_tensor", p)


class AdapterView:
    """The adapter parameters of `model` (named_parameters order, what Learner.adapter_tensors yields) as flat views,
    and the bucket's metadata under PEFT's names (SGLang's flattened_bucket format) in `dtype` (None: as trained).
    Valid while every parameter holds the same tensor at the same address; a reload that swaps one is caught by
    `current()` and the view is rebuilt."""

    def __init__(self, model: Any, dtype: Any = None):
        import torch

        named = [(n, p) for n, p in model.named_parameters() if is_lora_key(n)]
        self.params = [p for _, p in named]
        self.sources = [_local(p) for p in self.params]
        self.addresses = [t.data_ptr() for t in self.sources]
        with torch.no_grad():
            self.views = [t.detach().reshape(-1) for t in self.sources]
        self.dtype = dtype
        self.meta: list[SimpleNamespace] = bucket_metadata(
            [ParamMeta(PEFT_PREFIX + n, tuple(int(x) for x in t.shape), str(dtype or t.dtype).removeprefix("torch."))
             for (n, _), t in zip(named, self.sources)])
        self.as_bytes = [v.view(torch.uint8) for v in self.views] if dtype is None else None
        """dtype None (as trained): each tensor's bytes, concatenated as they are."""
        self.one_dtype = len({t.dtype for t in self.sources}) <= 1
        """Whether one cast after the concatenation does (the usual case), not one per tensor."""

    def current(self) -> bool:
        """Whether every parameter still holds the tensor and the memory the views were made of."""
        return all(_local(p) is t and t.data_ptr() == a for p, t, a in zip(self.params, self.sources, self.addresses))

    def bucket(self) -> Any:
        """The adapter's bytes back to back (uint8), in the metadata's order, a new tensor on the parameters' device."""
        import torch

        with torch.no_grad():
            if not self.views:
                return torch.empty(0, dtype=torch.uint8)
            if self.as_bytes is not None:
                return torch.cat(self.as_bytes)
            if self.one_dtype:
                return torch.cat(self.views).to(self.dtype).view(torch.uint8)
            return torch.cat([v.to(self.dtype) for v in self.views]).view(torch.uint8)


__all__ = ["AdapterView"]
