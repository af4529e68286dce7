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
from agentloop.train.batch.episodes import Episodes, Prepared, prepare_episodes, staleness_metrics
from agentloop.train.batch.format import BatchLayout, TrainBatch
from agentloop.train.batch.packing import mini_batch_indices, plan_ranks
from agentloop.train.config import AlgoConfig
from agentloop.train.flops import RowCost


def prepare_batch(records: list[EpisodeRecord], algo: AlgoConfig, layout: BatchLayout, step: int) -> TrainBatch:
    """The step's batch from its usable records: advantages per GRPO group (prepare_episodes), staleness numbers,
    the mini-batch split and every rank's micro-batches, as the learner laid them out before it received them
    ready-made (so the learner's numbers are unchanged). numpy only: the orchestrator never imports torch."""
    prepared = prepare_episodes(list(records), algo)
    eps = prepared.episodes
    metrics = dict(prepared.metrics)
    metrics.update(staleness_metrics(eps, step))
    minis = mini_batch_indices(len(eps), layout.mini_batches, seed=layout.seed * 1_000_003 + step) if eps else []
    cost = RowCost(*layout.row_cost) if layout.row_cost is not None else None
    plan = [plan_ranks(eps, idxs, budget=layout.budget, world=layout.world, share=layout.share, cost=cost)
            for idxs in minis]
    return _pack(step, layout, eps, prepared, minis, plan, metrics)


def _pack(step: int, layout: BatchLayout, eps: Episodes, prepared: Prepared, minis: list[list[int]],
          plan: list, metrics: dict[str, float]) -> TrainBatch:
    """The batch with its token arrays laid out rank by rank (agentloop.train.batch.format): each rank's episodes
    back to back, in the order of its micro-batches, so a rank's rows are one slice of each array."""
    n = len(eps)
    resp = eps.size.astype(np.int64) - eps.prompt_len
    order_by_rank: list[list[int]] = [[] for _ in range(layout.world)]
    for per_rank in plan:
        for r, micro_batches in enumerate(per_rank):
            order_by_rank[r].extend(i for rows in micro_batches for row in rows for i in row)
    order = [i for mine in order_by_rank for i in mine]
    if sorted(order) != list(range(n)):
        raise ValueError(f"step {step}: the plan does not hold each of the {n} episodes exactly once")
    start = np.zeros(n, dtype=np.int64)
    rstart = np.zeros(n, dtype=np.int64)
    ranks: list[tuple[int, int, int, int]] = []
    t = r = 0
    for mine in order_by_rank:
        t0, r0 = t, r
        for i in mine:
            start[i], rstart[i] = t, r
            t += int(eps.size[i])
            r += int(resp[i])
        ranks.append((t0, t, r0, r))

    def gather(arr: np.ndarray, at: np.ndarray, count: np.ndarray) -> np.ndarray:
        parts = [arr[at[i]:at[i] + count[i]] for i in order]
        return np.concatenate(parts) if parts else arr[:0].copy()

    size = eps.size.astype(np.int64)
    laid = Episodes(prompt_len=eps.prompt_len, size=eps.size, model_tokens=eps.model_tokens, advantage=eps.advantage,
                    reward=eps.reward, has_versions=eps.has_versions, start=start, rstart=rstart,
                    ids=gather(eps.ids, eps.start, size), response_mask=gather(eps.response_mask, eps.rstart, resp),
                    logprobs=gather(eps.logprobs, eps.rstart, resp), versions=gather(eps.versions, eps.rstart, resp))
    # the first episode with a model token of unknown weight version (algo.proximal=interpolate refuses it)
    bad = np.concatenate([[0], np.cumsum((eps.response_mask > 0) & (eps.versions < 0), dtype=np.int64)])
    unknown = (eps.has_versions == 0) | (bad[eps.rstart + resp] > bad[eps.rstart]) if n else np.zeros(0, bool)
    return TrainBatch(step=step, layout=layout, episodes=laid, uid=prepared.uids, ok_rewards=prepared.ok_rewards,
                      ok_groups=prepared.ok_groups, ok_lengths=prepared.ok_lengths, ok_episode=prepared.ok_episode,
                      minis=[list(m) for m in minis], plan=plan, metrics=metrics,
                      unversioned=int(np.argmax(unknown)) if unknown.any() else -1, ranks=ranks)


__all__ = ["prepare_batch"]
