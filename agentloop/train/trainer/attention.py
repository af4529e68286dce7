"""Attention over packed micro-batches: which position may see which, as variable-length segments for
FlashAttention (CUDA), a FlexAttention block mask (CUDA) or a dense boolean mask (any device), and the HF
attention functions that run the first two.

Map:
    allowed            the rule on (doc_ids, seg_ids) of agentloop.train.trainer.collate's packed layout
    dense_mask         [1, 1, L, L] boolean mask for SDPA (learner.attention=packed_sdpa)
    block_mask         FlexAttention BlockMask, built a band of query blocks at a time (never L x L at once)
    FLEX_IMPL, register_flex   "agentloop_flex": a HF attention function that calls compiled flex_attention
                       with the block mask given as the model's attention_mask, and refuses anything else
    VarlenLayout, varlen_layout   the packed row as FlashAttention varlen segments: one query segment per
                       prompt / unshared sequence / response, each with its key range (a response's keys =
                       its prompt's + its own, causal aligned to the end)
    varlen_attn        [T, H, D] varlen attention with autograd: the FlashAttention-2 kernels of aten on
                       CUDA (a custom op, so compiled decoder layers keep it in their graph), an exact
                       per-segment SDPA reference elsewhere
    VARLEN_IMPL, register_varlen   "agentloop_varlen": the HF attention function; the layout comes as the
                       model call's `agentloop_varlen` keyword (HF passes extra keywords down to attention)
    resolve_attention  learner.attention "auto" -> varlen (CUDA with aten's FlashAttention and a head dim
                       it supports), flex (CUDA, FlexAttention, head dim >= 16 and a power of 2),
                       packed_sdpa (other CUDA models) or padded (CPU)
    model_attn_impl, check_attn_impl   which HF implementation a layout needs, and the check that the
                       loaded model runs it (an eager model would add a boolean mask as numbers)

Block sparsity: a query block only visits key blocks holding some allowed pair; blocks where every pair
is allowed skip the mask function too. Responses of a shared prompt (seg >= 1) never see each other, so
their cross blocks are skipped: sharing a prompt costs no masked-pair FLOPs beyond partial blocks.

Varlen: FlashAttention computes no masked pair at all. A response segment's keys are gathered as
[its prompt's keys, its own keys] (the prompt's K/V copied once per response: Hkv x D values per prompt
token, small next to the attention itself; the gather's backward sums the copies' gradients), and
FlashAttention-2's causal rule for more keys than queries (aligned to the end: query i sees keys up to
i + (keys - queries)) is exactly "the whole prompt and my own past". Why not flex everywhere: on H100
its kernels ran these short, 513-token segments at ~30 TFLOP/s (RESULTS_learner.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

FLEX_IMPL = "agentloop_flex"
VARLEN_IMPL = "agentloop_varlen"
VARLEN_KWARG = "agentloop_varlen"
LONGEST_KWARG = "agentloop_longest"
"""Flex: the model call's keyword holding the longest sequence of the packed row (a sliding window that long or
longer never cuts; agentloop.train.model_support refuses models whose window could)."""
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


def _window(module: Any, kwargs: dict[str, Any]) -> int | None:
    """The layer's sliding window: passed to the attention function (Mistral) or kept on the module (Gemma-2)."""
    return kwargs.get("sliding_window") or getattr(module, "sliding_window", None)


def _flex_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention function: query [b, Hq, L, D], key/value [b, Hkv, L, D] -> ([b, L, Hq, D], None)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if not isinstance(attention_mask, BlockMask):
        raise RuntimeError(f"{FLEX_IMPL} attention needs a FlexAttention BlockMask as attention_mask, got "
                           f"{type(attention_mask).__name__}: the learner builds it from the packed micro-batch")
    window, longest = _window(module, kwargs), kwargs.get(LONGEST_KWARG)
    if window and (longest is None or longest > window):
        raise NotImplementedError(f"{FLEX_IMPL}: a sliding window of {window} tokens on sequences of up to {longest} "
                                  "tokens is not supported (a window at least as long as every sequence is)")
    if dropout:
        raise NotImplementedError(f"{FLEX_IMPL}: attention dropout is not supported")
    # Uncompiled flex materializes the scores (a reference, for CPU tests); on CPU compiled flex gave NaN under
    # torch 2.14 where eager is exact, and the learner never runs flex on CPU.
    fn = flex_attention if torch.compiler.is_compiling() or not query.is_cuda else _compiled_flex()
    out = fn(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register_flex() -> None:
    """Make "agentloop_flex" a HF attention implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(FLEX_IMPL, _flex_attention_forward)


# ---- varlen (FlashAttention) ----------------------------------------------------------------------

@dataclass
class VarlenLayout:
    """A packed row as FlashAttention varlen segments (on the row's device)."""

    cu_q: torch.Tensor
    """int32 [n + 1]: query segment boundaries; the segments tile the row in order (no query gather)."""
    cu_k: torch.Tensor
    """int32 [n + 1]: boundaries of each segment's keys in the gathered key/value tensor."""
    max_q: int
    """Longest query segment."""
    max_k: int
    """Longest key range."""
    kv_index: torch.Tensor | None
    """int64 [total keys]: row position of each gathered key; None when every segment's keys are its own
    queries (no shared prompt: no gather)."""


def varlen_layout(doc: torch.Tensor, seg: torch.Tensor, device: torch.device | str | None = None) -> VarlenLayout:
    """Segments of `allowed` on a packed row: a run of equal (doc, seg) is one query segment; a response
    (seg >= 1) attends to its doc's prompt run (seg 0) and to itself causally, anything else to itself.
    End padding (doc < 0) is one segment attending causally to itself, as in `dense_mask`."""
    dc, sc = doc.cpu(), seg.cpu()
    L = dc.numel()
    # run starts: where (doc, seg) changes (vectorized: a packed row is ~30k positions, its runs a few dozen)
    cut = ((dc[1:] != dc[:-1]) | (sc[1:] != sc[:-1])).nonzero().flatten().add(1).tolist()
    bounds = [0] + cut + [L] if L else [0]
    runs = list(zip(bounds[:-1], bounds[1:]))
    d, s = dc[bounds[:-1]].tolist(), sc[bounds[:-1]].tolist()
    prompt: dict[int, tuple[int, int]] = {}
    cu_q, cu_k = [0], [0]
    pieces: list[tuple[int, int]] = []
    shared = False
    max_q = max_k = 0
    for (a, b), doc_id, seg_id in zip(runs, d, s):
        keys = [(a, b)]
        if seg_id == 0:
            if doc_id >= 0:
                prompt[doc_id] = (a, b)
        else:
            if doc_id not in prompt:
                raise ValueError(f"packed row: segment {seg_id} of item {doc_id} at {a} has no prompt part before it")
            keys = [prompt[doc_id], (a, b)]
            shared = True
        n_k = sum(y - x for x, y in keys)
        pieces.extend(keys)
        cu_q.append(b)
        cu_k.append(cu_k[-1] + n_k)
        max_q, max_k = max(max_q, b - a), max(max_k, n_k)
    dev = device if device is not None else doc.device
    kv_index = None
    if shared:
        kv_index = torch.cat([torch.arange(x, y) for x, y in pieces]).to(dev)
    return VarlenLayout(torch.tensor(cu_q, dtype=torch.int32, device=dev),
                        torch.tensor(cu_k, dtype=torch.int32, device=dev), max_q, max_k, kv_index)


@torch.library.custom_op("agentloop::flash_varlen_fwd", mutates_args=())
def _flash_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                      max_q: int, max_k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, _rng, _unused, _dbg = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
    return out, lse


@_flash_varlen_fwd.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("agentloop::flash_varlen_bwd", mutates_args=())
def _flash_varlen_bwd(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # no dropout: the kernel never reads the RNG state
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        g.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, rng, unused, scale=scale)
    return dq, dk, dv


@_flash_varlen_bwd.register_fake
def _(g, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.max_q, ctx.max_k, ctx.scale = max_q, max_k, scale


def _flash_backward(ctx, g_out, _g_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _flash_varlen_bwd(g_out, q, k, v, out, lse, cu_q, cu_k, ctx.max_q, ctx.max_k, ctx.scale)
    return dq, dk, dv, None, None, None, None, None


_flash_varlen_fwd.register_autograd(_flash_backward, setup_context=_flash_setup)


def _reference_varlen(q, k, v, cu_q, cu_k, scale):
    """The same attention per segment through SDPA with an explicit end-aligned causal mask (exact, slow)."""
    import torch.nn.functional as F

    outs = []
    rep = q.shape[1] // k.shape[1]
    for i in range(cu_q.numel() - 1):
        qa, qb, ka, kb = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        nq, nk = qb - qa, kb - ka
        qi = q[qa:qb].transpose(0, 1)
        ki = k[ka:kb].transpose(0, 1).repeat_interleave(rep, dim=0)
        vi = v[ka:kb].transpose(0, 1).repeat_interleave(rep, dim=0)
        m = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=m, scale=scale).transpose(0, 1))
    return torch.cat(outs)


def varlen_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: VarlenLayout, scale: float) -> torch.Tensor:
    """Attention of the layout's segments: q [T, Hq, D] (row order), k/v [T, Hkv, D] (row order; gathered
    here when a segment reads its prompt) -> [T, Hq, D]. Hq a multiple of Hkv (GQA). CUDA: FlashAttention-2
    (bf16/fp16); other devices: `_reference_varlen`."""
    if layout.kv_index is not None:
        k, v = k.index_select(0, layout.kv_index), v.index_select(0, layout.kv_index)
    if q.is_cuda:
        out, _lse = _flash_varlen_fwd(q.contiguous(), k.contiguous(), v.contiguous(), layout.cu_q, layout.cu_k,
                                      layout.max_q, layout.max_k, float(scale))
        return out
    return _reference_varlen(q, k, v, layout.cu_q, layout.cu_k, scale)


def _varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention function: query [1, Hq, L, D], key/value [1, Hkv, L, D] -> ([1, L, Hq, D], None)."""
    layout = kwargs.get(VARLEN_KWARG)
    if not isinstance(layout, VarlenLayout):
        raise RuntimeError(f"{VARLEN_IMPL} attention needs the model call's {VARLEN_KWARG}= keyword (a VarlenLayout "
                           f"of the packed micro-batch), got {type(layout).__name__}")
    if attention_mask is not None:
        raise RuntimeError(f"{VARLEN_IMPL}: an attention_mask would be ignored; the layout carries the boundaries")
    window = _window(module, kwargs)
    if window and layout.max_k > window:
        raise NotImplementedError(f"{VARLEN_IMPL}: a sliding window of {window} tokens on a sequence of {layout.max_k} "
                                  "tokens is not supported (a window at least as long as every sequence is)")
    if dropout:
        raise NotImplementedError(f"{VARLEN_IMPL}: attention dropout is not supported")
    if query.shape[0] != 1:
        raise RuntimeError(f"{VARLEN_IMPL}: a packed micro-batch is one row, got batch {query.shape[0]}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = varlen_attn(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), layout, scale)
    return out.unsqueeze(0), None


def register_varlen() -> None:
    """Make "agentloop_varlen" a HF attention implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_IMPL, _varlen_attention_forward)


def varlen_available() -> bool:
    """aten has the FlashAttention-2 varlen kernels and this machine has a GPU they run on (sm80+)."""
    if not hasattr(torch.ops.aten, "_flash_attention_forward") or not torch.cuda.is_available():
        return False
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability()[0] >= 8


def varlen_head_dim_ok(head_dim: int | None) -> bool:
    """FlashAttention-2: head dimension a multiple of 8, at most 256."""
    return head_dim is not None and 8 <= head_dim <= 256 and head_dim % 8 == 0


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask  # noqa: F401
    except ImportError:
        return False
    return True


def flex_head_dim_ok(head_dim: int | None) -> bool:
    """FlexAttention's Triton kernels need a head dimension of at least 16 and a power of two."""
    return head_dim is not None and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def resolve_attention(setting: str, device_type: str, head_dim: int | None = 64, dtype: Any = None) -> str:
    """learner.attention after "auto": on CUDA varlen when aten's FlashAttention runs here, the head dimension
    suits it and the compute dtype is bf16/fp16, else flex when FlexAttention supports the head dimension,
    else packed_sdpa; padded on CPU. An explicit choice the machine or model cannot run is an error."""
    half = dtype in (None, torch.bfloat16, torch.float16)
    if setting == "auto":
        if device_type != "cuda":
            return "padded"
        if half and varlen_available() and varlen_head_dim_ok(head_dim):
            return "varlen"
        return "flex" if flex_available() and flex_head_dim_ok(head_dim) else "packed_sdpa"
    if setting == "flex":
        if device_type != "cuda":
            raise ValueError("learner.attention=flex needs a CUDA learner (FlexAttention has no CPU backward)")
        if not flex_available():
            raise ValueError(f"learner.attention=flex: this torch ({torch.__version__}) has no FlexAttention")
        if not flex_head_dim_ok(head_dim):
            raise ValueError(f"learner.attention=flex: the model's head dimension {head_dim} is not supported by "
                             "FlexAttention (>= 16 and a power of two); use packed_sdpa")
    if setting == "varlen":
        if not varlen_head_dim_ok(head_dim):
            raise ValueError(f"learner.attention=varlen: the model's head dimension {head_dim} is not supported by "
                             "FlashAttention-2 (a multiple of 8, at most 256); use flex or packed_sdpa")
        if device_type == "cuda":
            if not varlen_available():
                raise ValueError(f"learner.attention=varlen: this torch ({torch.__version__}) or GPU has no "
                                 "FlashAttention-2 kernels (sm80 or newer); use flex or packed_sdpa")
            if not half:
                raise ValueError(f"learner.attention=varlen: FlashAttention needs bf16/fp16 compute, the learner "
                                 f"computes in {dtype}; set learner.dtype=bfloat16 or use flex")
    return setting


def model_attn_impl(attention: str) -> str:
    """The HF attn_implementation a resolved learner.attention needs."""
    return {"flex": FLEX_IMPL, "varlen": VARLEN_IMPL}.get(attention, "sdpa")


def check_attn_impl(model: Any, attention: str) -> None:
    """Refuse a model whose attention would not honour our masks (e.g. eager adds a boolean mask as 0/1)."""
    want = model_attn_impl(attention)
    got = getattr(model.config, "_attn_implementation", None)
    if got != want:
        raise RuntimeError(f"learner.attention={attention} needs the model to run {want!r} attention, but it runs "
                           f"{got!r}, which would not apply the packed/shared-prompt mask")


def attention_inputs(mb: Any, attention: str, device: torch.device) -> dict[str, Any]:
    """The attention keywords of the model call for micro-batch `mb`: its attention_mask (padded: the
    collated mask; flex: a BlockMask; packed_sdpa: a dense mask) or, for varlen, no mask and the
    VarlenLayout under `agentloop_varlen`. Built once per micro-batch and device, kept for later passes."""
    if attention == "padded":
        return {"attention_mask": mb.attention_mask}
    key = (attention, str(device))
    cached = mb.attn_cache.get(key)
    if cached is None:
        if attention == "varlen":
            cached = {"attention_mask": None, VARLEN_KWARG: varlen_layout(mb.doc_ids, mb.seg_ids, device)}
        else:
            doc, seg = mb.doc_ids.to(device), mb.seg_ids.to(device)
            cached = {"attention_mask": block_mask(doc, seg) if attention == "flex" else dense_mask(doc, seg)}
            if attention == "flex":  # positions restart per sequence: the longest is the largest position + 1
                cached[LONGEST_KWARG] = int(mb.position_ids.max()) + 1 if mb.position_ids.numel() else 0
        mb.attn_cache[key] = cached
    return cached


__all__ = ["BLOCK", "FLEX_IMPL", "LONGEST_KWARG", "VARLEN_IMPL", "VARLEN_KWARG", "VarlenLayout", "allowed",
           "attention_inputs", "block_mask", "check_attn_impl", "dense_mask", "flex_available", "flex_head_dim_ok",
           "model_attn_impl", "register_flex", "register_varlen", "resolve_attention", "varlen_attn",
           "varlen_available", "varlen_head_dim_ok", "varlen_layout"]
