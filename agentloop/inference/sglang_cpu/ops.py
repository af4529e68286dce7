"""The fallback ops, in pure torch, registered as `torch.ops.sgl_kernel.<name>` on CPU.

Each op has the schema SGLang's Python wrappers (sgl_kernel/*.py) call it with. `register()`
defines only the ops not already defined, so it is idempotent and never clashes with a real
sgl_kernel CPU build.

    assign_req_to_token_pool_cpu   write new KV slot ids into rows of the req->token table
    copy_all_layer_kv_cache_cpu    move KV entries between slots in every layer's buffer
    murmur_hash32_cpu              per-(seed, position, column) hash behind seeded sampling
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import torch

__all__ = ["OPS", "assign_req_to_token_pool", "copy_all_layer_kv_cache", "murmur_hash32", "register"]


def assign_req_to_token_pool(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request i: `req_to_token[req_pool_indices[i], start[i]:end[i]] = ` the next
    `end[i] - start[i]` entries of `out_cache_loc` (requests consume it in order).

    `pool_len` (the row length) is implied by `req_to_token` here and only checked.
    """
    if req_to_token.dim() != 2 or req_to_token.shape[1] != pool_len:
        raise ValueError(f"req_to_token must be [*, {pool_len}], got {tuple(req_to_token.shape)}")
    lens = (end_offset - start_offset).to(torch.int64)
    total = int(lens.sum())
    if total == 0:
        return
    rows = torch.repeat_interleave(req_pool_indices.to(torch.int64), lens)
    seg_start = torch.cumsum(lens, 0) - lens  # where each request's run starts in out_cache_loc
    within = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(seg_start, lens)
    cols = torch.repeat_interleave(start_offset.to(torch.int64), lens) + within
    req_to_token[rows, cols] = out_cache_loc[:total].to(req_to_token.dtype)


def _raw_rows(ptr: int, stride_bytes: int, n_rows: int) -> torch.Tensor:
    """A [n_rows, stride_bytes] uint8 view of memory at address `ptr` (no copy)."""
    buf = (ctypes.c_uint8 * (n_rows * stride_bytes)).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(n_rows, stride_bytes)


def copy_all_layer_kv_cache(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every buffer b (address `data_ptrs[b]`, `strides[b]` bytes per slot) copy slot
    `src_loc[j]` to slot `tgt_loc[j]`, for all j. Sources are read before any write, so
    overlapping source/target sets behave as a simultaneous move.

    Simplified: SGLang hands over raw addresses, so each buffer is viewed through ctypes up to
    the highest slot touched; nothing outside those slots is read or written.
    """
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(f"tgt_loc has {tgt_loc.numel()} entries, src_loc {src_loc.numel()}")
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    n_rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = _raw_rows(int(ptr), int(stride), n_rows)
        rows[tgt] = rows[src]  # advanced indexing on the right copies first


_M32 = 0xFFFFFFFF


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _murmur3_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = (k * 0xCC9E2D51) & _M32
    k = _rotl32(k, 15)
    k = (k * 0x1B873593) & _M32
    h = _rotl32(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & _M32


def murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """[n, m] uint32 MurmurHash3-style hash of the 16-byte key (seed lo, seed hi, position, column)
    for every row i (seed[i], positions[i]) and column j (col_indices[j]).

    Computed in int64 holding 32-bit values: products wrap modulo 2**64 and are masked back to
    32 bits, so the low bits are exact; every value is masked non-negative before a right shift.
    """
    if seed.shape != positions.shape or seed.dim() != 1 or col_indices.dim() != 1:
        raise ValueError("seed and positions must be 1-D of equal length, col_indices 1-D")
    s = seed.to(torch.int64)  # a uint64 seed keeps its bit pattern
    lo = (s & _M32).view(-1, 1)
    hi = ((s >> 32) & _M32).view(-1, 1)  # arithmetic shift, then the mask drops the sign bits
    pos = (positions.to(torch.int64) & _M32).view(-1, 1)
    col = (col_indices.to(torch.int64) & _M32).view(1, -1)
    h = torch.zeros_like(lo)
    for k in (lo, hi, pos):
        h = _murmur3_mix(h, k)
    h = _murmur3_mix(h.expand(-1, col.shape[1]), col)
    h = h ^ 16  # key length in bytes
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    h = h ^ (h >> 16)
    return h.to(torch.uint32)


OPS: dict[str, tuple[str, Callable[..., torch.Tensor | None]]] = {
    "assign_req_to_token_pool_cpu": (
        "(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, Tensor end_offset,"
        " Tensor out_cache_loc, int pool_len) -> ()",
        assign_req_to_token_pool,
    ),
    "copy_all_layer_kv_cache_cpu": (
        "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()",
        copy_all_layer_kv_cache,
    ),
    "murmur_hash32_cpu": ("(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor", murmur_hash32),
}
"""Op name -> (schema without the name, implementation)."""

_lock = threading.Lock()
_libs: list[torch.library.Library] = []  # registrations live as long as their Library object


def register() -> list[str]:
    """Define every op of OPS not yet defined in namespace `sgl_kernel`; returns those defined now."""
    added: list[str] = []
    with _lock:
        todo = {n: v for n, v in OPS.items() if not _has_schema(n)}
        if not todo:
            return added
        lib = torch.library.Library("sgl_kernel", "FRAGMENT")
        for name, (schema, fn) in todo.items():
            lib.define(name + schema)
            lib.impl(name, fn, "CPU")
            added.append(name)
        _libs.append(lib)
    return added


def _has_schema(name: str) -> bool:
    try:
        torch._C._get_schema(f"sgl_kernel::{name}", "")
    except RuntimeError:
        return False
    return True
