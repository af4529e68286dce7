"""Episode records -> advantages -> mini-batches -> per-rank micro-batches of padded tensors.

Map:
    Episode            one usable record, flattened (ids, masks, rollout logprobs, advantage)
    prepare_episodes   drop failed/unscored records, group by (step, index), compute advantages
    mini_batch_indices deterministic shuffle + split of a step's episodes into mini-batches
    shard_for_rank     token-balanced split of a mini-batch over ranks (same answer on every rank)
    pack_greedy        first-fit-decreasing packing of sequences under a token budget
    collate            padded tensors of one micro-batch
    plan_micro_batches all of the above for one rank and one mini-batch, padded with empty
                       micro-batches so every rank runs the same number of forward/backward passes
                       (FSDP collectives would hang otherwise)

Alignment: a sequence is prompt_ids + response_ids = s[0..n-1]. The model input is s[0..n-2]
and `targets[j] = s[j+1]`, so logits at position j give the logprob of target j. Response token
k sits at s[P+k] (P = prompt length) and is predicted at j = P+k-1: `loss_mask[j]`,
`advantages[j]`, `rollout_logprobs[j]` all live at that j.

Gradient accumulation: `weights` are `losses.token_weights` computed with the *mini-batch's*
global counts (all ranks), so sum over micro-batches and ranks of `sum(weights * l)` is the
mini-batch loss in every aggregation mode. FSDP averages gradients over ranks, so the learner
multiplies each micro-batch loss by the world size.

Simplified: micro-batches are right-padded rectangles, not varlen-packed rows; the budget
counts real tokens, so padding can add compute (sorting by length keeps it small).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentloop.records import EpisodeRecord
from agentloop.train.advantages import compute_advantages, group_ids
from agentloop.train.config import AlgoConfig, LossAggMode
from agentloop.train.losses import token_weights


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
        group_ids([(r.step, r.index) for r in ok]),
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


def shard_for_rank(idxs: list[int], lengths: list[int], rank: int, world: int) -> list[int]:
    """Greedy token balance: longest first, each to the least-loaded rank (lowest rank on ties)."""
    load = [0] * world
    mine: list[int] = []
    for i in sorted(idxs, key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda q: (load[q], q))
        load[r] += lengths[i]
        if r == rank:
            mine.append(i)
    return mine


def pack_greedy(idxs: list[int], lengths: list[int], budget: int) -> list[list[int]]:
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
    old_logprobs: torch.Tensor | None = None
    """Filled by the learner (recompute mode) before the first update."""
    ref_logprobs: torch.Tensor | None = None
    """Filled by the learner when kl_coef > 0."""

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

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
    """Tensors for episodes[idxs]; `num_tokens`/`num_seqs` are the mini-batch totals for weights.

    An empty `idxs` gives a one-token padding micro-batch whose weights are all zero.
    """
    rows = [episodes[i] for i in idxs]
    b = max(len(rows), 1)
    L = max([e.length for e in rows] + [1])
    input_ids = torch.full((b, L), pad_id, dtype=torch.long)
    targets = torch.full((b, L), pad_id, dtype=torch.long)
    attn = torch.zeros((b, L), dtype=torch.long)
    pos = torch.zeros((b, L), dtype=torch.long)
    mask = torch.zeros((b, L), dtype=torch.float32)
    adv = torch.zeros((b, L), dtype=torch.float32)
    rlp = torch.zeros((b, L), dtype=torch.float32)
    if not rows:
        attn[0, 0] = 1
    for r, e in enumerate(rows):
        n = e.length
        ids = torch.tensor(e.ids, dtype=torch.long)
        input_ids[r, :n] = ids[:-1]
        targets[r, :n] = ids[1:]
        attn[r, :n] = 1
        pos[r, :n] = torch.arange(n)
        s = e.prompt_len - 1
        k = len(e.response_mask)
        mask[r, s:s + k] = torch.tensor(e.response_mask, dtype=torch.float32)
        rlp[r, s:s + k] = torch.tensor(e.rollout_logprobs, dtype=torch.float32)
        adv[r, s:s + k] = e.advantage
    adv *= mask
    w = token_weights(mask, mode, num_tokens=num_tokens, num_seqs=num_seqs)
    return MicroBatch(input_ids, attn, pos, targets, mask, adv, rlp, w, list(idxs))


def plan_micro_batches(
    episodes: list[Episode],
    idxs: list[int],
    mode: LossAggMode,
    *,
    budget: int,
    rank: int = 0,
    world: int = 1,
    pad_id: int = 0,
) -> list[MicroBatch]:
    """This rank's micro-batches of the mini-batch `idxs`, padded to the count of the busiest rank."""
    lengths = [e.length for e in episodes]
    num_tokens = float(sum(episodes[i].model_tokens for i in idxs))
    num_seqs = float(sum(1 for i in idxs if episodes[i].model_tokens > 0))
    plans = [pack_greedy(shard_for_rank(idxs, lengths, r, world), lengths, budget) for r in range(world)]
    n_max = max(len(p) for p in plans)
    mine = plans[rank] + [[] for _ in range(n_max - len(plans[rank]))]
    return [collate(episodes, b, mode, num_tokens=num_tokens, num_seqs=num_seqs, pad_id=pad_id) for b in mine]


__all__ = [
    "Episode",
    "MicroBatch",
    "Prepared",
    "collate",
    "mini_batch_indices",
    "pack_greedy",
    "plan_micro_batches",
    "prepare_episodes",
    "shard_for_rank",
]
