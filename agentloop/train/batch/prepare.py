"""The orchestrator's preparation of a step's batch: its usable records -> the TrainBatch the learner trains on.

The orchestrator holds the step's GRPO groups, so it computes what the learner would otherwise rebuild from whole
records: the episodes that enter the loss with their advantages (batch.episodes), the step's batch metrics, the
mini-batches and every rank's packed micro-batches (batch.packing), for the learner's layout (BatchLayout, which
the learner reports when it is ready).

Map:
    prepare_batch  records -> TrainBatch (the same functions the learner ran before, so it trains the same numbers)
"""

from __future__ import annotations

import numpy as np

from agentloop.records import EpisodeRecord
from agentloop.train.batch.episodes import Episode, Prepared, prepare_episodes, staleness_metrics
from agentloop.train.batch.format import BatchLayout, TrainBatch
from agentloop.train.batch.packing import mini_batch_indices, plan_ranks
from agentloop.train.config import AlgoConfig
from agentloop.train.flops import RowCost


def prepare_batch(records: list[EpisodeRecord], algo: AlgoConfig, layout: BatchLayout, step: int) -> TrainBatch:
    """The step's batch from its usable records: advantages per GRPO group (prepare_episodes), staleness numbers,
    the mini-batch split and every rank's micro-batches, as the learner laid them out before it received them
    ready-made (so the learner's numbers are unchanged)."""
    prepared = prepare_episodes(list(records), algo)
    eps = prepared.episodes
    metrics = dict(prepared.metrics)
    metrics.update(staleness_metrics(eps, step))
    minis = mini_batch_indices(len(eps), layout.mini_batches, seed=layout.seed * 1_000_003 + step) if eps else []
    cost = RowCost(*layout.row_cost) if layout.row_cost is not None else None
    plan = [plan_ranks(eps, idxs, budget=layout.budget, world=layout.world, share=layout.share, cost=cost)
            for idxs in minis]
    return _pack(step, layout, eps, prepared, minis, plan, metrics)


def _pack(step: int, layout: BatchLayout, eps: list[Episode], prepared: Prepared, minis: list[list[int]],
          plan: list, metrics: dict[str, float]) -> TrainBatch:
    n = len(eps)
    lens = [len(e.ids) for e in eps]
    rlens = [len(e.response_mask) for e in eps]
    for i, e in enumerate(eps):
        if lens[i] - e.prompt_len != rlens[i]:
            raise ValueError(f"episode {i}: {lens[i] - e.prompt_len} response tokens but {rlens[i]} mask entries")
    flat = [t for e in eps for t in e.ids]
    return TrainBatch(
        step=step, layout=layout,
        ids=np.asarray(flat, dtype=np.int32) if flat else np.zeros(0, np.int32),
        id_off=np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]).astype(np.int64),
        prompt_len=np.asarray([e.prompt_len for e in eps], dtype=np.int32),
        response_mask=np.asarray([m for e in eps for m in e.response_mask], dtype=np.uint8),
        logprobs=np.asarray([x for e in eps for x in e.rollout_logprobs], dtype=np.float32),
        versions=np.asarray([v for e in eps for v in (e.versions if e.versions is not None
                                                      else [-1] * len(e.response_mask))], dtype=np.int32),
        has_versions=np.asarray([e.versions is not None for e in eps], dtype=np.uint8),
        advantage=np.asarray([e.advantage for e in eps], dtype=np.float64),
        reward=np.asarray([e.reward for e in eps], dtype=np.float64),
        uid=np.asarray(prepared.uids, dtype=np.int64).reshape(n),
        ok_rewards=prepared.ok_rewards.numpy().astype(np.float64),
        ok_groups=prepared.ok_groups.numpy().astype(np.int64),
        ok_lengths=prepared.ok_lengths.numpy().astype(np.int64),
        ok_episode=np.asarray(prepared.ok_episode, dtype=np.int64),
        minis=[list(m) for m in minis], plan=plan, metrics=metrics)


__all__ = ["prepare_batch"]
