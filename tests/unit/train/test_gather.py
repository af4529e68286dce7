"""gather_to_rank0: many dim-0-sharded DTensors (FSDP2's layout) gathered in one collective equal their full
tensors, uneven and empty shards included (two gloo ranks)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.multiprocessing as mp

from agentloop.train.trainer.gather import shard_rows

SHAPES = [(5, 3), (1, 4), (4,), (7, 2, 2), (2, 6)]


def _rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from agentloop.train.trainer.gather import gather_to_rank0

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(0)
        full = {f"t{i}": torch.randn(s, generator=g) for i, s in enumerate(SHAPES)}
        full["half"] = torch.randn(3, 5, generator=g).to(torch.bfloat16)
        named = [(k, distribute_tensor(v, mesh, [Shard(0)])) for k, v in full.items()]
        named.append(("plain", torch.arange(6.0)))
        got = gather_to_rank0(named, rank)
        if rank == 0:
            torch.save({"got": got, "want": {**full, "plain": torch.arange(6.0)}}, out)
        else:
            assert got == {}
    finally:
        dist.destroy_process_group()


def test_shard_rows_follow_torch_chunk():
    for n in range(0, 9):
        for world in (1, 2, 3, 4):
            want = [len(c) for c in torch.arange(n).chunk(world)] if n else []
            want += [0] * (world - len(want))
            assert [shard_rows(n, world, r) for r in range(world)] == want, (n, world)


def test_one_collective_gathers_uneven_shards_to_rank_0(tmp_path: Path):
    out = tmp_path / "got.pt"
    init = f"file://{tmp_path / 'store'}"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_rank, args=(2, init, str(out)), nprocs=2, join=True, start_method="spawn")
    res = torch.load(out)
    assert list(res["got"]) == list(res["want"])
    for k, v in res["want"].items():
        assert res["got"][k].dtype == v.dtype and res["got"][k].shape == v.shape, k
        torch.testing.assert_close(res["got"][k], v, rtol=0, atol=0, msg=k)
