"""Which episodes train together: mini-batches, rows (shared prompts), every rank's micro-batches. Pure: episode
indices in, episode indices out; the orchestrator plans a step for all ranks, each rank turns its own share into
tensors (agentloop.train.trainer.collate).

Map:
    mini_batch_indices deterministic shuffle + split of a step's episodes into mini-batches (torch.randperm's
                       permutation, computed with numpy: randperm)
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

import numpy as np

from agentloop.train.batch.episodes import Episode, Episodes
from agentloop.train.flops import RowCost

EpisodeSeq = Episodes | Sequence[Episode]
"""A step's episodes: flat arrays, or a list of Episode."""

Lengths = Sequence[int] | Mapping[int, int]
"""Lengths indexed by the ids being packed (episode indices, or a row's first episode)."""


def _mt19937_key(seed: int) -> np.ndarray:
    """MT19937's state after init_genrand(seed mod 2^32): how torch.Generator().manual_seed(seed) seeds it."""
    s = seed & 0xFFFFFFFF
    key = [s]
    for j in range(1, 624):
        s = (1812433253 * (s ^ (s >> 30)) + j) & 0xFFFFFFFF
        key.append(s)
    return np.array(key, dtype=np.uint32)


def randperm(n: int, seed: int) -> np.ndarray:
    """torch.randperm(n, generator=torch.Generator().manual_seed(seed)) without torch: the same Mersenne Twister
    stream and the same Fisher-Yates walk (swap i with i + random() % (n - i)), so a step's mini-batches are the
    ones the learner drew itself before (tests/unit/train/test_batch_plan.py checks it against torch)."""
    bits = np.random.MT19937()
    bits.state = {"bit_generator": "MT19937", "state": {"key": _mt19937_key(seed), "pos": 624}}
    perm = np.arange(n, dtype=np.int64)
    draws = bits.random_raw(n - 1).tolist() if n > 1 else []
    for i, z in enumerate(draws):
        j = i + z % (n - i)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def mini_batch_indices(n: int, mini_batches: int, *, seed: int) -> list[list[int]]:
    """Shuffle 0..n-1 with `seed` (`randperm`) and cut into `mini_batches` near-equal parts (empty parts
    dropped)."""
    perm = randperm(n, seed).tolist()
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


def _length(episodes: EpisodeSeq, i: int) -> int:
    return int(episodes.size[i]) - 1 if isinstance(episodes, Episodes) else episodes[i].length


def _prompt_len(episodes: EpisodeSeq, i: int) -> int:
    return int(episodes.prompt_len[i]) if isinstance(episodes, Episodes) else episodes[i].prompt_len


def item_length(episodes: EpisodeSeq, item: list[int]) -> int:
    """Real tokens of the row that holds `item`: one episode's length, or prompt + segments."""
    if len(item) == 1:
        return _length(episodes, item[0])
    p = _prompt_len(episodes, item[0]) - 1
    return p + sum(_length(episodes, i) - p for i in item)


def item_attn_sq(episodes: EpisodeSeq, item: list[int]) -> int:
    """The FLOP model's attention term of the row holding `item` (MicroBatch.row_attn_sq)."""
    if len(item) == 1:
        return _length(episodes, item[0]) ** 2
    p = _prompt_len(episodes, item[0]) - 1
    return p * p + sum(_length(episodes, i) ** 2 - p * p for i in item)


def share_items(
    episodes: EpisodeSeq,
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
    by_prompt: dict[bytes, list[int]] = {}
    for i in idxs:
        e = episodes[i]
        by_prompt.setdefault(np.asarray(e.ids[:e.prompt_len], dtype=np.int64).tobytes(), []).append(i)
    items: list[list[int]] = []
    for members in by_prompt.values():
        p = _prompt_len(episodes, members[0]) - 1
        if len(members) == 1 or budget - p <= 0:
            items.extend([i] for i in members)
            continue
        n = {i: _length(episodes, i) - p for i in members}
        for chunk in pack_greedy(members, n, budget - p):
            if len(chunk) > 1 and (share == "on" or cost.sharing_pays(p, [n[i] for i in chunk])):
                items.append(sorted(chunk))
            else:
                items.extend([i] for i in chunk)
    return sorted(items)


def mini_batch_totals(episodes: EpisodeSeq, idxs: Sequence[int]) -> tuple[float, float]:
    """(model tokens, sequences with model tokens) of the mini-batch `idxs`: the denominators of its weights."""
    if isinstance(episodes, Episodes):
        m = episodes.model_tokens[np.asarray(idxs, dtype=np.int64)].astype(np.int64)
        return float(m.sum()), float((m > 0).sum())
    return (float(sum(episodes[i].model_tokens for i in idxs)),
            float(sum(1 for i in idxs if episodes[i].model_tokens > 0)))


def plan_ranks(
    episodes: EpisodeSeq,
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


__all__ = ["EpisodeSeq", "Lengths", "ShareMode", "item_attn_sq", "item_length", "mini_batch_indices",
           "mini_batch_totals", "pack_greedy", "plan_ranks", "randperm", "shard_for_rank", "share_items"]
