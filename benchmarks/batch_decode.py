"""Per-rank batch decode time: from the step's batch file on disk to one learner rank's micro-batch tensors (before
the device copy), for a synthetic step (GRPO groups sharing a prompt), at several world sizes. CPU only.

    python benchmarks/batch_decode.py [--episodes 512] [--group 8] [--prompt 700] [--response 200] [--repeat 5]

Two paths, whichever the installed agentloop has:
    file form 2 (safetensors, agentloop.train.batch.format.RankBatch): each rank reads the per-episode arrays and
        its own rows of the file, then collates them (agentloop.train.trainer.collate)
    file form 1 (the ALTB binary, before): rank 0 read and decoded the whole file, broadcast the decoded batch
        (a pickle: timed as dumps on rank 0, loads on the others), and every rank rebuilt every episode as Python
        lists (TrainBatch.episodes()) before collating its own
Printed per world size: the slowest rank's time and rank 0's (the median of --repeat runs), the bytes each rank
read or received, and the file's size. Results: benchmarks/RESULTS_batch_decode.md.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from agentloop.records import EpisodeRecord
from agentloop.train.batch.format import BatchLayout, TrainBatch
from agentloop.train.batch.packing import mini_batch_totals
from agentloop.train.batch.prepare import prepare_batch
from agentloop.train.config import AlgoConfig
from agentloop.train.trainer.collate import collate_micro_batches


def records(n: int, group: int, prompt: int, response: int, seed: int = 0) -> list[EpisodeRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n // group):
        p = rng.integers(5, 30000, size=prompt).tolist()
        for k in range(group):
            r = int(rng.integers(response // 2, response * 3 // 2))
            mask = [1] * r
            mask[r // 3:r // 3 + 20] = [0] * min(20, r - r // 3)  # a tool's tokens
            out.append(EpisodeRecord(
                prompt_ids=p, response_ids=rng.integers(5, 30000, size=r).tolist(), response_mask=mask,
                response_logprobs=[float(-x) if m else 0.0 for x, m in zip(rng.random(r), mask)],
                token_versions=[3 if m else None for m in mask], reward=float(rng.random() > 0.5),
                episode_id=f"{g}-{k}", index=g, uid=g, repeat=k, data_source="bench", loop="bench", seed=k, step=5))
    return out


def collate_rank(eps, batch, rank: int, layout: BatchLayout) -> int:
    """This rank's micro-batches of every mini-batch as tensors, as Learner._collate builds them; their count."""
    n = 0
    for j, idxs in enumerate(batch.minis):
        tok, seq = mini_batch_totals(eps, idxs)
        mbs = collate_micro_batches(eps, batch.plan[j][rank], "token-mean", num_tokens=tok, num_seqs=seq,
                                    pad_id=layout.pad_id, layout=layout.layout, pad_multiple=layout.pad_multiple)
        n += len(mbs)
    return n


def decode_new(path: Path, rank: int, layout: BatchLayout) -> tuple[float, int]:
    from agentloop.train.batch.format import RankBatch

    t = time.perf_counter()
    mine = RankBatch.read(path, rank)
    collate_rank(mine.episodes, mine, rank, layout)
    return time.perf_counter() - t, mine.read_bytes


def decode_old(path: Path, rank: int, layout: BatchLayout, world: int) -> tuple[float, int]:
    t = time.perf_counter()
    if rank == 0:
        data = path.read_bytes()
        batch = TrainBatch.decode(data)
        got = len(data)
        if world > 1:
            blob = pickle.dumps(batch)
    else:  # what rank 0 broadcast: its pickle, made outside this rank's clock
        t_off = time.perf_counter()
        blob = pickle.dumps(TrainBatch.decode(path.read_bytes()))
        t += time.perf_counter() - t_off
        batch = pickle.loads(blob)
        got = len(blob)
    eps = batch.episodes()
    collate_rank(eps, batch, rank, layout)
    return time.perf_counter() - t, got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=512)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=700)
    ap.add_argument("--response", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--worlds", default="1,2,4,8")
    ap.add_argument("--layout", choices=["packed", "padded"], default="packed")
    a = ap.parse_args(argv)
    new = not hasattr(TrainBatch, "decode")
    recs = records(a.episodes, a.group, a.prompt, a.response)
    print(f"file form {'2 (safetensors, rank rows)' if new else '1 (ALTB, pickle broadcast)'}: {a.episodes} "
          f"episodes, groups of {a.group}, prompt {a.prompt}, response ~{a.response} tokens, {a.layout} rows")
    with tempfile.TemporaryDirectory() as d:
        for world in [int(w) for w in a.worlds.split(",")]:
            layout = BatchLayout(world=world, layout=a.layout, share="on" if a.layout == "packed" else "off",
                                 row_cost=(1.0, 1.0), budget=16384, pad_multiple=128 if a.layout == "packed" else 1,
                                 mini_batches=1, seed=0)
            batch = prepare_batch(recs, AlgoConfig(), layout, 5)
            path = Path(d) / f"batch-{world}"
            path.write_bytes(batch.to_bytes() if new else batch.encode())
            times: dict[int, list[float]] = {r: [] for r in range(world)}
            got: dict[int, int] = {}
            for _ in range(a.repeat):
                for r in range(world):
                    s, b = decode_new(path, r, layout) if new else decode_old(path, r, layout, world)
                    times[r].append(s)
                    got[r] = b
            med = {r: statistics.median(v) for r, v in times.items()}
            slow = max(med, key=med.get)
            print(f"  world {world}: slowest rank {slow} {med[slow] * 1e3:.1f} ms, rank 0 {med[0] * 1e3:.1f} ms; "
                  f"bytes per rank {min(got.values()):,}-{max(got.values()):,} of a {path.stat().st_size:,}-byte file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
