"""Episode records -> advantages -> mini-batches -> per-rank micro-batches of padded tensors.

Map:
    Episode            one usable record, flattened (ids, masks, rollout logprobs, advantage)
    prepare_episodes   drop failed/unscored records, group by (step, index), compute advantages
    mini_batch_indices deterministic shuffle + split of a step's episodes into mini-batches
    shard_for_rank     token-balanced split of a mini-batch over ranks (same answer on every rank)
    pack_greedy        first-fit-decreasing packing of sequences under a token budget
    RowCost, share_items   which episodes share one row (same prompt tokens), see "Shared prompts"
    collate            padded tensors of one micro-batch, a row per episode (2-D attention mask)
    collate_shared     the same with rows of one prompt + several responses (4-D attention mask)
    plan_micro_batches all of the above for one rank and one mini-batch, padded with empty
                       micro-batches so every rank runs the same number of forward/backward passes
                       (FSDP collectives would hang otherwise)

Alignment: a sequence is prompt_ids + response_ids = s[0..n-1]. The model input is s[0..n-2]
and `targets[j] = s[j+1]`, so logits at position j give the logprob of target j. Response token
k sits at s[P+k] (P = prompt length) and is predicted at j = P+k-1: `loss_mask[j]`,
`advantages[j]`, `rollout_logprobs[j]` all live at that j.

Shared prompts. The episodes of a GRPO group start with the same prompt tokens; in the built-in
calculator task that is ~360 of ~400 tokens. A shared row holds that prompt once and then one
segment per response, and a 4-D attention mask lets each segment see the prompt and itself only:

    row       s[0..P-2] | s1[P-1..] | s2[P-1..] | ...      (segment i = s_i[P-1 .. len_i-2])
    position  0 .. P-2  | P-1 ..    | P-1 ..    |
    attends   causal    | prompt + own causal part

Segment i's first token is the prompt's last one, repeated (one token per response), so every
row position still predicts exactly one target and the [b, L] alignment above holds with the
segment's start in place of P-1. Each token sees the same context at the same position as in its
own row, so logprobs and gradients are those of the unshared layout (up to float summation order);
the linear layers and the LM head run on the prompt once instead of once per response. The cost:
a dense masked attention over the whole row (no flash kernel, masked pairs still computed), which
`RowCost` weighs against the tokens saved when `learner.share_prompt` is auto.

Gradient accumulation: `weights` are `losses.token_weights` computed with the *mini-batch's*
global counts (all ranks), so sum over micro-batches and ranks of `sum(weights * l)` is the
mini-batch loss in every aggregation mode. FSDP averages gradients over ranks, so the learner
multiplies each micro-batch loss by the world size.

Simplified: micro-batches are right-padded rectangles, not varlen-packed rows; the budget
counts real tokens, so padding can add compute (sorting by length keeps it small).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from agentloop.records import EpisodeRecord
from agentloop.train.advantages import compute_advantages, group_ids
from agentloop.train.config import AlgoConfig, LossAggMode
from agentloop.train.flops import RowCost
from agentloop.train.losses import token_weights

Lengths = Sequence[int] | Mapping[int, int]
"""Lengths indexed by the ids being packed (episode indices, or a row's first episode)."""


@dataclass
class Episode:
    ids: list[int]
    """prompt_ids + response_ids."""
    prompt_len: int
    response_mask: list[int]
    rollout_logprobs: list[float]
    advantage: float
    reward: float

    @property
    def length(self) -> int:
        """Tokens the model reads (the last token is only a target)."""
        return len(self.ids) - 1

    @property
    def model_tokens(self) -> int:
        return sum(self.response_mask)


@dataclass
class Prepared:
    episodes: list[Episode]
    """Episodes that enter the loss (failed, unscored and dropped ones removed)."""
    metrics: dict[str, float]


def prepare_episodes(records: list[EpisodeRecord], algo: AlgoConfig) -> Prepared:
    """Exclude failed (`error` set) and unscored records, compute advantages per (step, index) group.

    Episodes without model tokens take part in their group's baseline but not in the loss.
    """
    ok = [r for r in records if r.error is None and r.reward is not None and r.prompt_ids]
    failed = sum(1 for r in records if r.error is not None)
    adv = compute_advantages(
        [float(r.reward) for r in ok],
        group_ids([("uid", r.uid) if r.uid is not None else (r.step, r.index) for r in ok]),
        [r.num_model_tokens for r in ok],
        algo,
    )
    eps = [
        Episode(
            ids=list(r.prompt_ids) + list(r.response_ids),
            prompt_len=len(r.prompt_ids),
            response_mask=list(r.response_mask),
            rollout_logprobs=list(r.response_logprobs),
            advantage=float(a),
            reward=float(r.reward),
        )
        for r, a, k in zip(ok, adv.values.tolist(), adv.keep.tolist())
        if k and r.num_model_tokens > 0
    ]
    rewards = [float(r.reward) for r in ok]
    metrics = {
        "batch/records": float(len(records)),
        "batch/failed": float(failed),
        "batch/unscored": float(len(records) - failed - len(ok)),
        "batch/episodes": float(len(eps)),
        "batch/model_tokens": float(sum(e.model_tokens for e in eps)),
        "batch/seq_len_mean": sum(len(e.ids) for e in eps) / max(len(eps), 1),
        "reward/mean": sum(rewards) / max(len(rewards), 1),
        **adv.metrics(),
    }
    return Prepared(episodes=eps, metrics=metrics)


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


@dataclass
class MicroBatch:
    """Padded tensors of one forward/backward, all [b, L] with the alignment of the module doc."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor
    weights: torch.Tensor
    episode_ids: list[int]
    """Indices into the step's episode list (empty for a padding micro-batch)."""
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    """Per episode_ids entry: (row, start, k), its k response tokens sit at [row, start:start+k]."""
    row_lengths: list[int] = field(default_factory=list)
    """Real (non-padding) positions of each row: what the forward pass computes."""
    old_logprobs: torch.Tensor | None = None
    """Filled by the learner (recompute mode) before the first update."""
    ref_logprobs: torch.Tensor | None = None
    """Filled by the learner when kl_coef > 0."""

    @property
    def tokens(self) -> int:
        return sum(self.row_lengths)

    @property
    def shared_rows(self) -> int:
        """Rows that hold a prompt and more than one response."""
        return sum(1 for n in Counter(row for row, _, _ in self.spans).values() if n > 1)

    @property
    def shared(self) -> bool:
        """Rows hold shared prompts (a 4-D attention mask) rather than one episode each."""
        return self.attention_mask.dim() == 4

    def to(self, device: torch.device) -> "MicroBatch":
        for name in ("input_ids", "attention_mask", "position_ids", "targets", "loss_mask", "advantages",
                     "rollout_logprobs", "weights", "old_logprobs", "ref_logprobs"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self


def collate(
    episodes: list[Episode],
    idxs: list[int],
    mode: LossAggMode,
    *,
    num_tokens: float,
    num_seqs: float,
    pad_id: int = 0,
) -> MicroBatch:
    """Tensors for episodes[idxs], a row each; `num_tokens`/`num_seqs` are the mini-batch totals for weights.

    An empty `idxs` gives a one-token padding micro-batch whose weights are all zero.
    """
    return _collate_rows(episodes, [[i] for i in idxs], mode, num_tokens=num_tokens, num_seqs=num_seqs,
                         pad_id=pad_id, shared=False)


ShareMode = Literal["auto", "on", "off"]


def item_length(episodes: list[Episode], item: list[int]) -> int:
    """Real tokens of the row that holds `item`: one episode's length, or prompt + segments."""
    if len(item) == 1:
        return episodes[item[0]].length
    p = episodes[item[0]].prompt_len - 1
    return p + sum(episodes[i].length - p for i in item)


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


def collate_shared(
    episodes: list[Episode],
    items: list[list[int]],
    mode: LossAggMode,
    *,
    num_tokens: float,
    num_seqs: float,
    pad_id: int = 0,
) -> MicroBatch:
    """Tensors of rows that each hold one prompt and the segments of `items[r]` (module doc)."""
    return _collate_rows(episodes, items, mode, num_tokens=num_tokens, num_seqs=num_seqs, pad_id=pad_id,
                         shared=True)


def _collate_rows(
    episodes: list[Episode],
    items: list[list[int]],
    mode: LossAggMode,
    *,
    num_tokens: float,
    num_seqs: float,
    pad_id: int,
    shared: bool,
) -> MicroBatch:
    """Row r = the prompt of items[r] once, then a segment per episode (module doc). A row of one
    episode is that episode's plain sequence, so `shared` only decides the attention mask: 2-D
    padding mask (causal inside the model) or 4-D, each segment seeing the prompt and itself."""
    lengths = [item_length(episodes, it) for it in items]
    b, L = max(len(items), 1), max(lengths + [1])
    input_ids = torch.full((b, L), pad_id, dtype=torch.long)
    targets = torch.full((b, L), pad_id, dtype=torch.long)
    attn = torch.zeros((b, 1, L, L) if shared else (b, L), dtype=torch.bool if shared else torch.long)
    pos = torch.zeros((b, L), dtype=torch.long)
    mask = torch.zeros((b, L), dtype=torch.float32)
    adv = torch.zeros((b, L), dtype=torch.float32)
    rlp = torch.zeros((b, L), dtype=torch.float32)
    w = torch.zeros((b, L), dtype=torch.float64)
    causal = torch.ones((L, L), dtype=torch.bool).tril() if shared else None
    spans: list[tuple[int, int, int]] = []
    episode_ids: list[int] = []
    if not items:
        attn[0, 0] = 1
    for r, item in enumerate(items):
        first = episodes[item[0]]
        p = first.prompt_len - 1
        head = torch.tensor(first.ids[:p + 1], dtype=torch.long)
        input_ids[r, :p] = head[:p]
        targets[r, :p] = head[1:]
        pos[r, :p] = torch.arange(p)
        if shared:
            attn[r, 0, :p, :p] = causal[:p, :p]
        a = p
        for i in item:
            e = episodes[i]
            k = e.length - p
            if k != len(e.response_mask):
                raise ValueError(f"episode {i}: {k} response positions but {len(e.response_mask)} mask entries")
            ids = torch.tensor(e.ids, dtype=torch.long)
            input_ids[r, a:a + k] = ids[p:p + k]
            targets[r, a:a + k] = ids[p + 1:p + 1 + k]
            pos[r, a:a + k] = torch.arange(p, p + k)
            if shared:
                attn[r, 0, a:a + k, :p] = True
                attn[r, 0, a:a + k, a:a + k] = causal[:k, :k]
            m = torch.tensor(e.response_mask, dtype=torch.float32)
            mask[r, a:a + k] = m
            rlp[r, a:a + k] = torch.tensor(e.rollout_logprobs, dtype=torch.float32)
            adv[r, a:a + k] = e.advantage * m
            w[r, a:a + k] = token_weights(m.unsqueeze(0), mode, num_tokens=num_tokens, num_seqs=num_seqs)[0]
            spans.append((r, a, k))
            episode_ids.append(i)
            a += k
        if shared:
            # Padding queries see only themselves: a fully masked row would make SDPA return NaN, and
            # NaN * 0 weight is still NaN in the backward pass.
            pad = torch.arange(a, L)
            attn[r, 0, pad, pad] = True
        else:
            attn[r, :a] = 1
    return MicroBatch(input_ids, attn, pos, targets, mask, adv, rlp, w, episode_ids, spans=spans,
                      row_lengths=lengths)


def plan_micro_batches(
    episodes: list[Episode],
    idxs: list[int],
    mode: LossAggMode,
    *,
    budget: int,
    rank: int = 0,
    world: int = 1,
    pad_id: int = 0,
    share: ShareMode = "off",
    cost: RowCost | None = None,
) -> list[MicroBatch]:
    """This rank's micro-batches of the mini-batch `idxs`, padded to the count of the busiest rank.

    Rows are `share_items`; a micro-batch with a shared row gets the 4-D mask for all its rows.
    """
    num_tokens = float(sum(episodes[i].model_tokens for i in idxs))
    num_seqs = float(sum(1 for i in idxs if episodes[i].model_tokens > 0))
    items = share_items(episodes, idxs, budget=budget, share=share, cost=cost)
    # Rows are indexed by their first episode, so share=off packs exactly as a row per episode.
    lengths = {it[0]: item_length(episodes, it) for it in items}
    by_first = {it[0]: it for it in items}
    plans = [pack_greedy(shard_for_rank(list(by_first), lengths, r, world), lengths, budget) for r in range(world)]
    n_max = max(len(p) for p in plans)
    mine = plans[rank] + [[] for _ in range(n_max - len(plans[rank]))]
    out = []
    for firsts in mine:
        rows = [by_first[f] for f in firsts]
        out.append(_collate_rows(episodes, rows, mode, num_tokens=num_tokens, num_seqs=num_seqs, pad_id=pad_id,
                                 shared=any(len(it) > 1 for it in rows)))
    return out


__all__ = [
    "Episode",
    "MicroBatch",
    "Prepared",
    "RowCost",
    "ShareMode",
    "collate",
    "collate_shared",
    "item_length",
    "mini_batch_indices",
    "pack_greedy",
    "plan_micro_batches",
    "prepare_episodes",
    "shard_for_rank",
    "share_items",
]
