"""The step's batch as the orchestrator prepares it (agentloop.train.batch.format): the learner collates exactly the
micro-batches it laid out itself before (same tensors, every rank, every layout), from a compact binary form
that carries no text."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from agentloop.records import EpisodeRecord
from agentloop.train.batch.episodes import prepare_episodes, staleness_metrics
from agentloop.train.batch.format import BatchFormatError, BatchLayout, TrainBatch
from agentloop.train.batch.packing import mini_batch_indices, mini_batch_totals
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
    batch prepared by the orchestrator, sent as bytes, and collated by each rank."""
    algo = AlgoConfig()
    recs = records()
    lay = BatchLayout(world=world, layout=layout, share=share, row_cost=(COST.per_token, COST.per_pair), budget=40,
                      pad_multiple=8 if layout == "packed" else 1, pad_id=3, mini_batches=minis, seed=7)
    batch = TrainBatch.decode(prepare_batch(recs, algo, lay, 3).encode())

    prepared = prepare_episodes(recs, algo)
    eps = prepared.episodes
    old_minis = mini_batch_indices(len(eps), minis, seed=7 * 1_000_003 + 3)
    assert batch.minis == old_minis
    mine = batch.episodes()
    for j, idxs in enumerate(old_minis):
        for rank in range(world):
            old = plan_micro_batches(eps, idxs, "token-mean", budget=40, rank=rank, world=world, pad_id=3,
                                     share=share, cost=COST, layout=layout, pad_multiple=lay.pad_multiple)
            tok, seq = mini_batch_totals(mine, idxs)
            new = collate_micro_batches(mine, batch.plan[j][rank], "token-mean", num_tokens=tok, num_seqs=seq,
                                        pad_id=3, layout=layout, pad_multiple=lay.pad_multiple)
            assert len(old) == len(new)
            for a, b in zip(old, new):
                assert_same(a, b)


def test_the_batch_holds_the_metrics_and_what_verls_order_re_estimates_from():
    algo = AlgoConfig()
    recs = records()
    batch = TrainBatch.decode(prepare_batch(recs, algo, BatchLayout(), 3).encode())
    prepared = prepare_episodes(recs, algo)
    want = {**prepared.metrics, **staleness_metrics(prepared.episodes, 3)}
    assert batch.metrics == pytest.approx(want) and "async/staleness_mean" in batch.metrics
    again = batch.prepared()
    for f in ("ok_rewards", "ok_groups", "ok_lengths"):
        assert torch.equal(getattr(again, f), getattr(prepared, f)), f
    assert again.ok_episode == prepared.ok_episode
    assert batch.uid.tolist() == [10 + i // 3 for i in range(12)]  # the errored record is no episode
    assert [e.advantage for e in again.episodes] == [e.advantage for e in prepared.episodes]


def test_the_binary_form_is_compact_and_refuses_what_it_cannot_read():
    recs = records(groups=16, n=8)
    data = prepare_batch(recs, AlgoConfig(), BatchLayout(), 3).encode()
    as_records = sum(len(r.model_dump_json()) for r in recs)
    assert len(data) * 4 < as_records, (len(data), as_records)  # token arrays, not records with their text
    assert b"xxxxxxxx" not in data
    with pytest.raises(BatchFormatError, match="magic"):
        TrainBatch.decode(b"JUNK" + data[4:])
    with pytest.raises(BatchFormatError, match="truncated"):
        TrainBatch.decode(data[: len(data) // 2])
    header_len = int(np.frombuffer(data[8:16], dtype="<u8")[0])
    newer = data[:4] + np.array([2], dtype="<u4").tobytes() + data[8:]
    with pytest.raises(BatchFormatError, match="format 2"):
        TrainBatch.decode(newer)
    assert json.loads(data[16:16 + header_len])["step"] == 3


def test_an_empty_step_is_a_batch_too():
    recs = [r.model_copy(update={"reward": None}) for r in records(groups=1)]
    batch = TrainBatch.decode(prepare_batch(recs, AlgoConfig(), BatchLayout(world=2), 5).encode())
    assert batch.num_episodes == 0 and batch.minis == [] and batch.plan == []
    assert batch.metrics["batch/unscored"] == len(recs) - 1
