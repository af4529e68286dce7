"""Attention over packed micro-batches: which position may see which, as a FlexAttention block mask
(CUDA) or a dense boolean mask (any device), and the HF attention function that runs the former.

Map:
    allowed            the rule on (doc_ids, seg_ids) of agentloop.train.batching's packed layout
    dense_mask         [1, 1, L, L] boolean mask for SDPA (learner.attention=packed_sdpa)
    block_mask         FlexAttention BlockMask, built a band of query blocks at a time (never L x L at once)
    FLEX_IMPL, register_flex   "agentloop_flex": a HF attention function that calls compiled flex_attention
                       with the block mask given as the model's attention_mask, and refuses anything else
    resolve_attention  learner.attention "auto" -> flex (CUDA, FlexAttention, head dim >= 16 and a power of 2),
                       packed_sdpa (other CUDA models) or padded (CPU)
    model_attn_impl, check_attn_impl   which HF implementation a layout needs, and the check that the
                       loaded model runs it (an eager model would add a boolean mask as numbers)

Block sparsity: a query block only visits key blocks holding some allowed pair; blocks where every pair
is allowed skip the mask function too. Responses of a shared prompt (seg >= 1) never see each other, so
their cross blocks are skipped: sharing a prompt costs no masked-pair FLOPs beyond partial blocks.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

FLEX_IMPL = "agentloop_flex"
BLOCK = 128


def allowed(doc: torch.Tensor, seg: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Position q may attend to position k: same item, causal, and k is on the prompt part or in q's segment."""
    return (doc[q] == doc[k]) & (k <= q) & ((seg[k] == 0) | (seg[k] == seg[q]))


def dense_mask(doc: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """[1, 1, L, L] boolean mask of `allowed` (True = attend). Padding positions (doc -1) attend causally
    among themselves, so no query row is empty (SDPA would return NaN)."""
    L = doc.shape[0]
    idx = torch.arange(L, device=doc.device)
    return allowed(doc, seg, idx[:, None], idx[None, :])[None, None]


def block_mask(doc: torch.Tensor, seg: torch.Tensor, *, block: int = BLOCK, band_pairs: int = 1 << 26) -> Any:
    """FlexAttention BlockMask of `allowed` for a packed row (doc/seg on the target device).

    Built by evaluating the rule on bands of query blocks (at most `band_pairs` pairs at once), so memory
    stays O(band) for any row length, unlike create_block_mask's dense evaluation.
    """
    from torch.nn.attention.flex_attention import BlockMask

    L = doc.shape[0]
    nb = -(-L // block)
    pad = nb * block - L
    dev = doc.device
    if pad:
        # Positions past L never exist in the kernel; give them their own doc so they only pad partial blocks.
        doc_p = torch.cat([doc, torch.full((pad,), -2, dtype=doc.dtype, device=dev)])
        seg_p = torch.cat([seg, torch.zeros(pad, dtype=seg.dtype, device=dev)])
    else:
        doc_p, seg_p = doc, seg
    kv = torch.arange(nb * block, device=dev)
    rows = max(1, band_pairs // (nb * block * block))
    any_parts, all_parts = [], []
    for qb0 in range(0, nb, rows):
        qb1 = min(nb, qb0 + rows)
        q = torch.arange(qb0 * block, qb1 * block, device=dev)
        m = allowed(doc_p, seg_p, q[:, None], kv[None, :]).view(qb1 - qb0, block, nb, block)
        real = (q < L).view(qb1 - qb0, block, 1, 1) & (kv < L).view(1, 1, nb, block)
        any_parts.append(m.any(dim=3).any(dim=1))
        # "full" only where every real pair is allowed; a block cut by L counts as partial (mask applied)
        all_parts.append((m | ~real).all(dim=3).all(dim=1) & real.all(dim=3).all(dim=1))
    any_b = torch.cat(any_parts)  # [nb q blocks, nb kv blocks]
    full_b = torch.cat(all_parts)
    partial_b = any_b & ~full_b

    def to_indices(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = b.sum(-1).to(torch.int32)
        # the visited kv blocks first, in increasing order (stable sort of "not visited")
        order = torch.sort((~b).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return num[None, None], order[None, None]

    kv_num, kv_idx = to_indices(partial_b)
    full_num, full_idx = to_indices(full_b)

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed(doc, seg, q_idx, kv_idx)

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(L, L))


@lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # automatic dynamic shapes: one static compile, a dynamic one once a second row length shows up
    # (learner.pad_packed_to_budget keeps every row one length: static kernels only)
    return torch.compile(flex_attention)


def _flex_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention function: query [b, Hq, L, D], key/value [b, Hkv, L, D] -> ([b, L, Hq, D], None)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if not isinstance(attention_mask, BlockMask):
        raise RuntimeError(f"{FLEX_IMPL} attention needs a FlexAttention BlockMask as attention_mask, got "
                           f"{type(attention_mask).__name__}: the learner builds it from the packed micro-batch")
    if getattr(module, "sliding_window", None):
        raise NotImplementedError(f"{FLEX_IMPL}: sliding-window layers are not supported")
    if dropout:
        raise NotImplementedError(f"{FLEX_IMPL}: attention dropout is not supported")
    fn = flex_attention if torch.compiler.is_compiling() else _compiled_flex()
    out = fn(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register_flex() -> None:
    """Make "agentloop_flex" a HF attention implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(FLEX_IMPL, _flex_attention_forward)


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask  # noqa: F401
    except ImportError:
        return False
    return True


def flex_head_dim_ok(head_dim: int | None) -> bool:
    """FlexAttention's Triton kernels need a head dimension of at least 16 and a power of two."""
    return head_dim is not None and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def resolve_attention(setting: str, device_type: str, head_dim: int | None = 64) -> str:
    """learner.attention after "auto": flex on CUDA when FlexAttention exists and supports the model's head
    dimension, packed_sdpa on CUDA otherwise, padded on CPU."""
    if setting == "auto":
        if device_type != "cuda":
            return "padded"
        return "flex" if flex_available() and flex_head_dim_ok(head_dim) else "packed_sdpa"
    if setting == "flex":
        if device_type != "cuda":
            raise ValueError("learner.attention=flex needs a CUDA learner (FlexAttention has no CPU backward)")
        if not flex_available():
            raise ValueError(f"learner.attention=flex: this torch ({torch.__version__}) has no FlexAttention")
        if not flex_head_dim_ok(head_dim):
            raise ValueError(f"learner.attention=flex: the model's head dimension {head_dim} is not supported by "
                             "FlexAttention (>= 16 and a power of two); use packed_sdpa")
    return setting


def model_attn_impl(attention: str) -> str:
    """The HF attn_implementation a resolved learner.attention needs."""
    return FLEX_IMPL if attention == "flex" else "sdpa"


def check_attn_impl(model: Any, attention: str) -> None:
    """Refuse a model whose attention would not honour our masks (e.g. eager adds a boolean mask as 0/1)."""
    want = model_attn_impl(attention)
    got = getattr(model.config, "_attn_implementation", None)
    if got != want:
        raise RuntimeError(f"learner.attention={attention} needs the model to run {want!r} attention, but it runs "
                           f"{got!r}, which would not apply the packed/shared-prompt mask")


def mask_for(mb: Any, attention: str, device: torch.device) -> Any:
    """What the model gets as attention_mask for micro-batch `mb` (built once per micro-batch and kept)."""
    if attention == "padded":
        return mb.attention_mask
    key = (attention, str(device))
    cached = mb.attn_cache.get(key)
    if cached is None:
        doc, seg = mb.doc_ids.to(device), mb.seg_ids.to(device)
        cached = block_mask(doc, seg) if attention == "flex" else dense_mask(doc, seg)
        mb.attn_cache[key] = cached
    return cached


__all__ = ["BLOCK", "FLEX_IMPL", "allowed", "block_mask", "check_attn_impl", "dense_mask", "flex_available",
           "flex_head_dim_ok",
           "mask_for", "model_attn_impl", "register_flex", "resolve_attention"]
