"""The step's batch as the orchestrator prepares it (agentloop.train.batch.format): the learner collates exactly the
micro-batches it laid out itself before (same tensors, every rank, every layout), from a compact safetensors file
that carries no text, of which each rank reads only its own rows."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from agentloop.records import EpisodeRecord
from agentloop.train.batch.episodes import prepare_episodes, staleness_metrics
from agentloop.train.batch.format import FORMAT, BatchFormatError, BatchLayout, RankBatch, TrainBatch
from agentloop.train.batch.packing import mini_batch_indices, mini_batch_totals, randperm
from agentloop.train.batch.prepare import prepare_batch
from agentloop.train.config import AlgoConfig
from agentloop.train.flops import RowCost
from agentloop.train.trainer.collate import collate_micro_batches, plan_micro_batches

COST = RowCost(per_token=2e5, per_pair=300.0)


def records(step: int = 3, groups: int = 4, n: int = 3, seed: int = 0) -> list[EpisodeRecord]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for u in range(groups):
        prompt = torch.randint(5, 90, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
        for rep in range(n):
            k = int(torch.randint(2, 14, (1,), generator=g))
            mask = [1] * k
            if k > 6:
                mask[3:5] = [0, 0]  # a tool's tokens
            out.append(EpisodeRecord(
                prompt_ids=prompt, response_ids=torch.randint(5, 90, (k,), generator=g).tolist(), response_mask=mask,
                response_logprobs=[float(-torch.rand(1, generator=g)) if m else 0.0 for m in mask],
                token_versions=[step - 1 - (j % 2) if m else None for j, m in enumerate(mask)],
                reward=float(torch.rand(1, generator=g) > 0.5), episode_id=f"{u}-{rep}", index=u, uid=10 + u,
                repeat=rep, data_source="t", loop="x", seed=rep, step=step, extra={"messages": [{"role": "user", "content": "x" * 500}]}))
    out.append(out[0].model_copy(update={"error": "RuntimeError: boom", "reward": None, "repeat": 9}))
    return out


FIELDS = ("input_ids", "attention_mask", "position_ids", "targets", "loss_mask", "advantages", "rollout_logprobs",
          "weights", "ret_end", "versions", "seq_ids", "doc_ids", "seg_ids")


def assert_same(a, b):
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), f
    for f in ("episode_ids", "spans", "row_lengths", "row_attn_sq", "items"):
        assert getattr(a, f) == getattr(b, f), f


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("share", ["off", "on", "auto"])
@pytest.mark.parametrize("world,minis", [(1, 1), (2, 2), (3, 1)])
def test_each_rank_collates_what_it_planned_itself_before(layout, share, world, minis):
    """The old learner path (prepare_episodes, mini_batch_indices, plan_micro_batches on every rank) against the
    batch prepared by the orchestrator, written as a file's bytes, and read and collated by each rank."""
    algo = AlgoConfig()
    recs = records()
    lay = BatchLayout(world=world, layout=layout, share=share, row_cost=(COST.per_token, COST.per_pair), budget=40,
                      pad_multiple=8 if layout == "packed" else 1, pad_id=3, mini_batches=minis, seed=7)
    data = prepare_batch(recs, algo, lay, 3).to_bytes()

    prepared = prepare_episodes(recs, algo)
    eps = prepared.episodes
    old_minis = mini_batch_indices(len(eps), minis, seed=7 * 1_000_003 + 3)
    for rank in range(world):
        mine = RankBatch.read(data, rank)
        assert mine.minis == old_minis and mine.rank == rank
        for j, idxs in enumerate(old_minis):
            old = plan_micro_batches(eps, idxs, "token-mean", budget=40, rank=rank, world=world, pad_id=3,
                                     share=share, cost=COST, layout=layout, pad_multiple=lay.pad_multiple)
            tok, seq = mini_batch_totals(mine.episodes, idxs)
            new = collate_micro_batches(mine.episodes, mine.my_micro_batches(j), "token-mean", num_tokens=tok,
                                        num_seqs=seq, pad_id=3, layout=layout, pad_multiple=lay.pad_multiple)
            assert len(old) == len(new)
            for a, b in zip(old, new):
                assert_same(a, b)


def test_each_rank_reads_only_its_own_rows():
    recs = records(groups=16, n=8)
    lay = BatchLayout(world=4, budget=64)
    batch = prepare_batch(recs, AlgoConfig(), lay, 3)
    data = batch.to_bytes()
    e = batch.episodes
    whole = sum(getattr(e, k).nbytes for k in ("prompt_len", "size", "model_tokens", "advantage", "reward",
                                                "has_versions", "start", "rstart"))
    whole += sum(getattr(batch, k).nbytes for k in ("uid", "ok_rewards", "ok_groups", "ok_lengths", "ok_episode"))
    seen: list[int] = []
    for rank in range(4):
        mine = RankBatch.read(data, rank)
        held = [i for i in range(mine.num_episodes) if mine.episodes.start[i] >= 0]
        assert held == sorted(i for mb in mine.plan[0][rank] for row in mb for i in row)
        for i in held:  # its rows are the orchestrator's episodes, token for token
            assert mine.episodes[i].ids.tolist() == batch.tokens(i)
        other = next(i for i in range(mine.num_episodes) if i not in held)
        with pytest.raises(IndexError, match="another learner rank's"):
            mine.episodes[other]
        # what it read: the header, the per-episode and per-record arrays, its own slice of each token array
        header = 8 + int.from_bytes(data[:8], "little")
        token_bytes = 4 * len(mine.episodes.ids) + (1 + 4 + 4) * len(mine.episodes.response_mask)
        assert mine.read_bytes == header + whole + token_bytes
        assert token_bytes < 0.4 * (len(data) - header - whole)  # about a quarter of the rows, not all of them
        seen += held
        # in memory (Learner.train_step): the same share, as views
        assert batch.for_rank(rank).episodes[held[-1]].ids.tolist() == batch.tokens(held[-1])
    assert sorted(seen) == list(range(batch.num_episodes))  # every episode on exactly one rank


def test_the_mini_batch_shuffle_is_torchs_randperm_without_torch():
    for seed in (0, 7, 7 * 1_000_003 + 3, 2**33 + 5):
        for n in (0, 1, 2, 9, 130):
            want = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
            assert randperm(n, seed).tolist() == want, (seed, n)


def test_the_batch_holds_the_metrics_and_what_verls_order_re_estimates_from():
    algo = AlgoConfig()
    recs = records()
    batch = TrainBatch.load(prepare_batch(recs, algo, BatchLayout(), 3).to_bytes())
    prepared = prepare_episodes(recs, algo)
    want = {**prepared.metrics, **staleness_metrics(prepared.episodes, 3)}
    assert batch.metrics == pytest.approx(want) and "async/staleness_mean" in batch.metrics
    again = batch.prepared()
    for f in ("ok_rewards", "ok_groups", "ok_lengths", "ok_episode"):
        assert np.array_equal(getattr(again, f), getattr(prepared, f)), f
    assert batch.uid.tolist() == [10 + i // 3 for i in range(12)]  # the errored record is no episode
    assert [e.advantage for e in again.episodes] == [e.advantage for e in prepared.episodes]
    assert batch.unversioned == -1  # every model token carries its version


def test_the_file_is_safetensors_compact_and_refused_when_it_is_not_this_format(tmp_path):
    from safetensors import safe_open

    recs = records(groups=16, n=8)
    data = prepare_batch(recs, AlgoConfig(), BatchLayout(), 3).to_bytes()
    as_records = sum(len(r.model_dump_json()) for r in recs)
    assert len(data) * 4 < as_records, (len(data), as_records)  # token arrays, not records with their text
    assert b"xxxxxxxx" not in data
    (tmp_path / "b.safetensors").write_bytes(data)
    with safe_open(str(tmp_path / "b.safetensors"), framework="numpy") as f:  # the library's own reader reads it
        assert f.metadata()["step"] == "3" and f.metadata()["format"] == FORMAT
        assert f.get_tensor("ids").dtype == np.int32
    with pytest.raises(BatchFormatError, match="not a batch file"):
        RankBatch.read(b"JUNK" + data[4:], 0)
    with pytest.raises(BatchFormatError, match="truncated"):
        RankBatch.read(data[: len(data) // 2], 0)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["__metadata__"]["format"] = "agentloop-batch/9"
    newer = json.dumps(header, separators=(",", ":")).encode()
    assert len(newer) <= n
    newer += b" " * (n - len(newer))
    with pytest.raises(BatchFormatError, match="agentloop-batch/9"):
        RankBatch.read(data[:8] + newer[:n] + data[8 + n:], 0)
    with pytest.raises(BatchFormatError, match="planned for 1 rank"):
        RankBatch.read(data, 1)


def test_an_empty_step_is_a_batch_too():
    recs = [r.model_copy(update={"reward": None}) for r in records(groups=1)]
    batch = TrainBatch.load(prepare_batch(recs, AlgoConfig(), BatchLayout(world=2), 5).to_bytes())
    assert batch.num_episodes == 0 and batch.minis == [] and batch.plan == []
    assert batch.metrics["batch/unscored"] == len(recs) - 1
    assert RankBatch.read(prepare_batch(recs, AlgoConfig(), BatchLayout(world=2), 5).to_bytes(), 1).num_episodes == 0


def test_the_orchestrators_batch_preparation_needs_no_torch():
    """prepare_batch (advantages, the shuffle, the plan, the file) on the orchestrator's side: numpy only."""
    code = ("import sys\n"
            "from agentloop.train.batch.format import BatchLayout, RankBatch\n"
            "from agentloop.train.batch.prepare import prepare_batch\n"
            "from agentloop.train.config import AlgoConfig\n"
            "from agentloop.records import EpisodeRecord\n"
            "recs = [EpisodeRecord(prompt_ids=[1, 2, 3], response_ids=[4, 5], response_mask=[1, 1],\n"
            "        response_logprobs=[-0.1, -0.2], reward=float(k), episode_id=f'0-{k}', index=0, uid=0, repeat=k,\n"
            "        data_source='t', loop='x', seed=k, step=1) for k in range(4)]\n"
            "data = prepare_batch(recs, AlgoConfig(), BatchLayout(world=2, mini_batches=2), 1).to_bytes()\n"
            "assert RankBatch.read(data, 1).num_episodes == 4\n"
            "import agentloop.train.orchestrator.loop\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
