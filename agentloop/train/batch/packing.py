"""Which episodes train together: mini-batches, rows (shared prompts), every rank's micro-batches. Pure: episode
indices in, episode indices out; the orchestrator plans a step for all ranks, each rank turns its own share into
tensors (agentloop.train.trainer.collate).

Map:
    mini_batch_indices deterministic shuffle + split of a step's episodes into mini-batches
    shard_for_rank     token-balanced split of a mini-batch over ranks (same answer on every rank)
    pack_greedy        first-fit-decreasing packing of sequences under a token budget
    item_length, item_attn_sq   a row's real tokens and its attention term (the FLOP model's)
    share_items        which episodes share one row (same prompt tokens; agentloop.train.trainer.collate,
                       "Shared prompts"), weighed by the FLOP model's RowCost when learner.share_prompt is auto
    mini_batch_totals  a mini-batch's model tokens and sequences: the denominators of its loss weights
    plan_ranks         every rank's micro-batches of one mini-batch (rows of episode indices), padded with
                       empty micro-batches so every rank runs the same number of forward/backward passes
                       (FSDP collectives would hang otherwise)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from agentloop.train.batch.episodes import Episode
from agentloop.train.flops import RowCost

Lengths = Sequence[int] | Mapping[int, int]
"""Lengths indexed by the ids being packed (episode indices, or a row's first episode)."""


def mini_batch_indices(n: int, mini_batches: int, *, seed: int) -> list[list[int]]:
    """Shuffle 0..n-1 with `seed` and cut into `mini_batches` near-equal parts (empty parts dropped)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g).tolist()
    k = max(1, min(mini_batches, n))
    parts = [perm[i * n // k:(i + 1) * n // k] for i in range(k)]
    return [p for p in parts if p]


def shard_for_rank(idxs: list[int], lengths: Lengths, rank: int, world: int) -> list[int]:
    """Greedy token balance: longest first, each to the least-loaded rank (lowest rank on ties)."""
    load = [0] * world
    mine: list[int] = []
    for i in sorted(idxs, key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda q: (load[q], q))
        load[r] += lengths[i]
        if r == rank:
            mine.append(i)
    return mine


def pack_greedy(idxs: list[int], lengths: Lengths, budget: int) -> list[list[int]]:
    """First-fit decreasing: bins whose summed lengths stay <= budget; an over-long item is alone."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(idxs, key=lambda i: (-lengths[i], i)):
        for b in range(len(bins)):
            if lengths[i] <= room[b]:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


ShareMode = Literal["auto", "on", "off"]


def item_length(episodes: list[Episode], item: list[int]) -> int:
    """Real tokens of the row that holds `item`: one episode's length, or prompt + segments."""
    if len(item) == 1:
        return episodes[item[0]].length
    p = episodes[item[0]].prompt_len - 1
    return p + sum(episodes[i].length - p for i in item)


def item_attn_sq(episodes: list[Episode], item: list[int]) -> int:
    """The FLOP model's attention term of the row holding `item` (MicroBatch.row_attn_sq)."""
    if len(item) == 1:
        return episodes[item[0]].length ** 2
    p = episodes[item[0]].prompt_len - 1
    return p * p + sum(episodes[i].length ** 2 - p * p for i in item)


def share_items(
    episodes: list[Episode],
    idxs: list[int],
    *,
    budget: int,
    share: ShareMode = "off",
    cost: RowCost | None = None,
) -> list[list[int]]:
    """The rows of a mini-batch: lists of episode indices, several only where they share a prompt.

    Episodes share a row when their prompt tokens are identical (in practice, a GRPO group). A group
    whose shared row would exceed `budget` is cut into chunks (first-fit decreasing on response
    length); with share=auto a chunk is shared only where `cost` says it is cheaper. Rows come out
    sorted by their first episode index, so share=off gives the plain one-row-per-episode plan.
    """
    if share == "off":
        return sorted([i] for i in idxs)
    if share == "auto" and cost is None:
        raise ValueError("share='auto' needs a RowCost")
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i in idxs:
        e = episodes[i]
        by_prompt.setdefault(tuple(e.ids[:e.prompt_len]), []).append(i)
    items: list[list[int]] = []
    for members in by_prompt.values():
        p = episodes[members[0]].prompt_len - 1
        if len(members) == 1 or budget - p <= 0:
            items.extend([i] for i in members)
            continue
        n = {i: episodes[i].length - p for i in members}
        for chunk in pack_greedy(members, n, budget - p):
            if len(chunk) > 1 and (share == "on" or cost.sharing_pays(p, [n[i] for i in chunk])):
                items.append(sorted(chunk))
            else:
                items.extend([i] for i in chunk)
    return sorted(items)


def mini_batch_totals(episodes: list[Episode], idxs: Sequence[int]) -> tuple[float, float]:
    """(model tokens, sequences with model tokens) of the mini-batch `idxs`: the denominators of its weights."""
    return (float(sum(episodes[i].model_tokens for i in idxs)),
            float(sum(1 for i in idxs if episodes[i].model_tokens > 0)))


def plan_ranks(
    episodes: list[Episode],
    idxs: list[int],
    *,
    budget: int,
    world: int = 1,
    share: ShareMode = "off",
    cost: RowCost | None = None,
) -> list[list[list[list[int]]]]:
    """Every rank's micro-batches of the mini-batch `idxs`: [rank][micro-batch][row] -> episode indices, each
    rank padded with empty micro-batches to the count of the busiest one (FSDP collectives would hang otherwise).

    Rows are `share_items`; a rank's rows are token-balanced (`shard_for_rank`) and packed under `budget`
    (`pack_greedy`). Pure: the orchestrator plans a step for all ranks, each rank collates its own
    (`collate_micro_batches`)."""
    items = share_items(episodes, idxs, budget=budget, share=share, cost=cost)
    # Rows are indexed by their first episode, so share=off packs exactly as a row per episode.
    lengths = {it[0]: item_length(episodes, it) for it in items}
    by_first = {it[0]: it for it in items}
    plans = [pack_greedy(shard_for_rank(list(by_first), lengths, r, world), lengths, budget) for r in range(world)]
    n_max = max(len(p) for p in plans)
    return [[[by_first[f] for f in firsts] for firsts in p + [[] for _ in range(n_max - len(p))]] for p in plans]


__all__ = ["Lengths", "ShareMode", "item_attn_sq", "item_length", "mini_batch_indices", "mini_batch_totals",
           "pack_greedy", "plan_ranks", "shard_for_rank", "share_items"]
