"""The pure-torch sgl_kernel CPU ops, each against a straightforward loop reference."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from agentloop.inference.sglang_cpu import OPS, register, site_dir


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    register()


def test_register_is_idempotent_and_defines_every_op() -> None:
    assert register() == []
    for name in OPS:  # defined with a CPU kernel, not just a schema
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"sgl_kernel::{name}", "CPU"), name


def test_site_dir_provides_common_ops_module() -> None:
    assert (site_dir() / "common_ops.py").is_file()
    sys.path.insert(0, str(site_dir()))
    try:
        sys.modules.pop("common_ops", None)
        importlib.import_module("common_ops")  # registers (already registered: no-op)
    finally:
        sys.path.remove(str(site_dir()))
        sys.modules.pop("common_ops", None)


def _assign_reference(req_pool_indices, req_to_token, start, end, out_cache_loc):
    pt = 0
    for i in range(len(req_pool_indices)):
        n = int(end[i] - start[i])
        req_to_token[int(req_pool_indices[i]), int(start[i]) : int(end[i])] = out_cache_loc[pt : pt + n]
        pt += n


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_assign_req_to_token_pool(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    pool_len = 32
    table = torch.randint(0, 1000, (8, pool_len), generator=g, dtype=dtype)
    req = torch.tensor([5, 0, 3, 7])
    start = torch.tensor([0, 10, 31, 4])
    end = torch.tensor([3, 17, 32, 4])  # the last request writes nothing
    out = torch.randint(0, 10_000, (int((end - start).sum()) + 5,), generator=g)  # extra tail is ignored
    expected = table.clone()
    _assign_reference(req, expected, start, end, out)
    torch.ops.sgl_kernel.assign_req_to_token_pool_cpu(req, table, start, end, out, pool_len)
    assert torch.equal(table, expected)


def test_assign_req_to_token_pool_empty_batch() -> None:
    table = torch.zeros(2, 4, dtype=torch.int32)
    empty = torch.empty(0, dtype=torch.int64)
    torch.ops.sgl_kernel.assign_req_to_token_pool_cpu(empty, table, empty, empty, empty, 4)
    assert not table.any()


def test_copy_all_layer_kv_cache() -> None:
    g = torch.Generator().manual_seed(1)
    buffers = [
        torch.randn(16, 2, 4, generator=g),
        torch.randn(16, 2, 4, generator=g).to(torch.bfloat16),
        torch.randn(16, 8, generator=g).to(torch.float16),
    ]
    expected = [b.clone() for b in buffers]
    tgt = torch.tensor([0, 3, 9, 15])
    src = torch.tensor([3, 9, 1, 2])  # overlaps tgt: reads happen before writes
    for e in expected:
        snapshot = e.clone()
        for t, s in zip(tgt.tolist(), src.tolist()):
            e[t] = snapshot[s]
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers])
    torch.ops.sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, e in zip(buffers, expected):
        assert torch.equal(b, e)


def _murmur_reference(seed: int, pos: int, col: int) -> int:
    m = 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & m

    h = 0
    for k in (seed & m, (seed >> 32) & m, pos & m, col & m):
        k = rotl((k * 0xCC9E2D51) & m, 15)
        k = (k * 0x1B873593) & m
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & m
    h ^= 16
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def test_murmur_hash32() -> None:
    seeds = [0, 42, 2**31 + 5, 2**40 + 3, 2**63 - 1]
    positions = [0, 1, 7, 4095, 123456]
    cols = list(range(0, 2048, 97)) + [2**31 - 1]
    seed_t = torch.tensor(seeds, dtype=torch.int64).to(torch.uint64)
    got = torch.ops.sgl_kernel.murmur_hash32_cpu.default(seed_t, torch.tensor(positions), torch.tensor(cols))
    assert got.dtype == torch.uint32 and got.shape == (len(seeds), len(cols))
    want = [[_murmur_reference(s, p, c) for c in cols] for s, p in zip(seeds, positions)]
    assert got.to(torch.int64).tolist() == want
