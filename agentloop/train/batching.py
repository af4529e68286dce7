"""Episode records -> advantages -> mini-batches -> per-rank micro-batches (packed or padded tensors).

Map:
    Episode            one usable record, flattened (ids, masks, rollout logprobs, advantage, versions)
    prepare_episodes   drop unscored records and infrastructure failures, group by uid, compute advantages
    staleness_metrics  version lag per token (asynchronous rollouts)
    mini_batch_indices deterministic shuffle + split of a step's episodes into mini-batches
    shard_for_rank     token-balanced split of a mini-batch over ranks (same answer on every rank)
    pack_greedy        first-fit-decreasing packing of sequences under a token budget
    RowCost, share_items   which episodes share one row (same prompt tokens), see "Shared prompts"
    collate            padded tensors of one micro-batch, a row per episode (2-D attention mask)
    collate_shared     the same with rows of one prompt + several responses (4-D attention mask)
    collate_packed     one row holding every row of the micro-batch back to back, no padding between
                       them: position ids restart per row, and `doc_ids`/`seg_ids` say what may attend
                       to what (agentloop.train.attention turns them into a block or dense mask)
    episode_return     per-token reward -> its return to the end of the episode (KL in the reward)
    plan_ranks         every rank's micro-batches of one mini-batch (rows of episode indices, pure), padded
                       with empty micro-batches so every rank runs the same number of forward/backward
                       passes (FSDP collectives would hang otherwise): the orchestrator plans a step
    collate_micro_batches  one rank's planned micro-batches as tensors (the learner)
    plan_micro_batches both, for one rank

Alignment: a sequence is prompt_ids + response_ids = s[0..n-1]. The model input is s[0..n-2]
and `targets[j] = s[j+1]`, so logits at position j give the logprob of target j. Response token
k sits at s[P+k] (P = prompt length) and is predicted at j = P+k-1: `loss_mask[j]`,
`advantages[j]`, `rollout_logprobs[j]` all live at that j.

Shared prompts. The episodes of a GRPO group start with the same prompt tokens; in the built-in
calculator task that is ~360 of ~400 tokens. A shared row holds that prompt once and then one
segment per response, and the attention mask lets each segment see the prompt and itself only:

    row       s[0..P-2] | s1[P-1..] | s2[P-1..] | ...      (segment i = s_i[P-1 .. len_i-2])
    position  0 .. P-2  | P-1 ..    | P-1 ..    |
    attends   causal    | prompt + own causal part

Segment i's first token is the prompt's last one, repeated (one token per response), so every
row position still predicts exactly one target and the [b, L] alignment above holds with the
segment's start in place of P-1. Each token sees the same context at the same position as in its
own row, so logprobs and gradients are those of the unshared layout (up to float summation order);
the linear layers and the LM head run on the prompt once instead of once per response. With a dense
mask (padded, packed_sdpa) the masked pairs of the row are still computed, which `RowCost` weighs
against the tokens saved when `learner.share_prompt` is auto; FlexAttention skips them block-wise.

Packed layout (learner.attention flex / packed_sdpa). The rows above are laid back to back in one
row of the micro-batch, padded only at the end (to `pad_multiple`). Per position: `doc_ids` = which
row (-1 on the end padding), `seg_ids` = 0 on a row's prompt part and on an unshared row, i >= 1 on
segment i of a shared row. Position q may attend to k iff doc[q] == doc[k], k <= q, and seg[k] is 0
or seg[q] (agentloop.train.attention.allowed).

Gradient accumulation: `weights` are `losses.token_weights` computed with the *mini-batch's*
global counts (all ranks), so sum over micro-batches and ranks of `sum(weights * l)` is the
mini-batch loss in every aggregation mode. FSDP averages gradients over ranks, so the learner
multiplies each micro-batch loss by the world size.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from agentloop.errors import failure_kind
from agentloop.records import EpisodeRecord
from agentloop.train.advantages import Advantages, compute_advantages, group_ids
from agentloop.train.config import AlgoConfig, LossAggMode
from agentloop.train.flops import RowCost
from agentloop.train.losses import LossOutput, policy_loss, token_weights

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
    versions: list[int] | None = None
    """Per response token: the weight version that sampled it, -1 where unknown or mask 0; None when the
    record carries no token versions (synchronous rollouts)."""

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
    ok_rewards: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    """Rewards of every usable record (the advantage estimator's input, episodes without model tokens
    and dropped groups included), for estimators run again later (agentloop.train.verl_order)."""
    ok_groups: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    """Their group numbers."""
    ok_lengths: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    """Their model-token counts."""
    ok_episode: list[int] = field(default_factory=list)
    """Per usable record, its index in `episodes`, -1 when it is not there."""
    uids: list[int] = field(default_factory=list)
    """Per episode, its record's uid (the GRPO group; -1 when the record has none)."""


def prepare_episodes(records: list[EpisodeRecord], algo: AlgoConfig) -> Prepared:
    """Exclude unscored records and those failed for a cause outside the policy, compute advantages per
    GRPO group (uid, else (step, index)).

    A policy failure (agentloop.errors.failure_kind: an episode timeout) that the orchestrator scored at
    `reward.failure_score` stays: it takes part in its group's baseline, and in the loss with the
    tokens it sampled. Episodes without model tokens (or without any tokens) take part in their group's
    baseline but not in the loss. An episode of several segments (records sharing its episode_id,
    openai_agent_loop) is one episode to the estimator (its reward counted once in the group's baseline,
    its length the sum of theirs); each segment is then a sequence of the loss with the episode's advantage
    (so under token-mean every model token weighs the same, under seq-mean-* each segment counts as a
    sequence). (`algo.use_kl_in_reward` re-estimates per record: there each segment counts as an episode.)
    """
    ok = [r for r in records if r.reward is not None and failure_kind(r.error, r.finish_reason) != "infra"]
    kept = {id(r) for r in ok}
    failed = sum(1 for r in records if r.error is not None and id(r) not in kept)
    group = [("uid", r.uid) if r.uid is not None else (r.step, r.index) for r in ok]
    groups = group_ids(group)
    episodes: dict[tuple[object, str], list[int]] = {}  # (group, episode id) -> its records in `ok`
    for i, (g, r) in enumerate(zip(group, ok)):
        episodes.setdefault((g, r.episode_id), []).append(i)
    per_episode = compute_advantages([float(ok[idx[0]].reward) for idx in episodes.values()],
                                     group_ids([g for g, _ in episodes]),
                                     [sum(ok[i].num_model_tokens for i in idx) for idx in episodes.values()], algo)
    which = torch.zeros(len(ok), dtype=torch.int64)
    for e, idx in enumerate(episodes.values()):
        which[idx] = e
    adv = Advantages(values=per_episode.values[which], keep=per_episode.keep[which],
                     zero_variance=per_episode.zero_variance[which])
    entered = [bool(k) and r.num_model_tokens > 0 and bool(r.prompt_ids) for r, k in zip(ok, adv.keep.tolist())]
    ok_episode, n = [], 0
    for e in entered:
        ok_episode.append(n if e else -1)
        n += e
    eps = [
        Episode(
            ids=list(r.prompt_ids) + list(r.response_ids),
            prompt_len=len(r.prompt_ids),
            response_mask=list(r.response_mask),
            rollout_logprobs=list(r.response_logprobs),
            advantage=float(a),
            reward=float(r.reward),
            versions=[-1 if v is None else int(v) for v in r.token_versions] if r.token_versions else None,
        )
        for r, a, e in zip(ok, adv.values.tolist(), entered)
        if e
    ]
    rewards = [float(r.reward) for r in ok]
    metrics = {
        "batch/records": float(len(records)),
        "batch/failed": float(failed),
        "batch/policy_failed": float(sum(1 for r in ok if r.error is not None)),
        "batch/unscored": float(len(records) - failed - len(ok)),
        "batch/episodes": float(len(eps)),
        "batch/model_tokens": float(sum(e.model_tokens for e in eps)),
        "batch/seq_len_mean": sum(len(e.ids) for e in eps) / max(len(eps), 1),
        "reward/mean": sum(rewards) / max(len(rewards), 1),
        **adv.metrics(),
    }
    return Prepared(episodes=eps, metrics=metrics,
                    ok_rewards=torch.tensor(rewards, dtype=torch.float64), ok_groups=groups,
                    ok_lengths=torch.tensor([r.num_model_tokens for r in ok], dtype=torch.int64),
                    ok_episode=ok_episode, uids=[-1 if r.uid is None else r.uid for r, e in zip(ok, entered) if e])


def staleness_metrics(episodes: list[Episode], step: int, *, max_lag_bucket: int = 4) -> dict[str, float]:
    """Version lag per model token, lag = (step - 1) - version (step s trains the weights of version
    s - 1), over the tokens whose version is known: `async/staleness_mean`, `async/staleness_max`,
    `async/lag_share_<k>` for k < max_lag_bucket and `async/lag_share_<max_lag_bucket>+` (shares of those
    tokens), and `async/version_known_frac` (of all model tokens). Empty when no episode carries versions.
    Computed from the full episode list, so every rank gets the same numbers without a collective."""
    if not any(e.versions is not None for e in episodes):
        return {}
    lags: Counter[int] = Counter()
    known = total = 0
    for e in episodes:
        total += e.model_tokens
        if e.versions is None:
            continue
        for m, v in zip(e.response_mask, e.versions):
            if m and v >= 0:
                lags[(step - 1) - v] += 1
                known += 1
    out = {"async/version_known_frac": known / max(total, 1)}
    if known:
        if min(lags) < 0:
            raise ValueError(f"step {step}: a token was sampled by weight version {step - 1 - min(lags)}, newer than "
                             f"the weights this step starts from (version {step - 1})")
        out["async/staleness_mean"] = sum(k * n for k, n in lags.items()) / known
        out["async/staleness_max"] = float(max(lags))
        for k in range(max_lag_bucket):
            out[f"async/lag_share_{k}"] = lags.get(k, 0) / known
        out[f"async/lag_share_{max_lag_bucket}+"] = sum(n for k, n in lags.items() if k >= max_lag_bucket) / known
    return out



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
    """Tensors of one forward/backward, all [b, L] with the alignment of the module doc.

    Padded layout: a row per `items` entry, right-padded, `attention_mask` 2-D (a row per episode) or 4-D
    (shared rows). Packed layout: b = 1, every item back to back, `attention_mask` None and `doc_ids` /
    `seg_ids` set.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
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
    """Real (non-padding) positions of each item (a row of the padded layout, a stretch of the packed
    one): what the forward pass computes."""
    row_attn_sq: list[int] = field(default_factory=list)
    """Per item, the attention term of the FLOP model: S^2 for a sequence of S input tokens; for a shared
    row with prompt part p and segments k_i, p^2 + sum((p + k_i)^2 - p^2), the pairs a row per episode
    would need less the repeated prompt's (agentloop.train.flops)."""
    items: list[list[int]] = field(default_factory=list)
    """The rows' episode indices (several where a prompt is shared)."""
    ret_end: torch.Tensor | None = None
    """[b, L] int64: one past the last position of the episode span each position belongs to (the
    position + 1 outside spans): `episode_return` sums a per-token value from a token to there."""
    versions: torch.Tensor | None = None
    """[b, L] int64 weight version of each target token, -1 where unknown (None: no episode has versions)."""
    seq_ids: torch.Tensor | None = None
    """[b, L] int64: the index into `spans` / `episode_ids` of the episode each position belongs to, -1
    outside every span (per-episode sums: sequence-level importance weights, rejection, KL in the reward)."""
    doc_ids: torch.Tensor | None = None
    """Packed layout, [L] int32: which item each position belongs to, -1 on the end padding."""
    seg_ids: torch.Tensor | None = None
    """Packed layout, [L] int32: 0 on prompt parts and unshared items, i on segment i of a shared item."""
    old_logprobs: torch.Tensor | None = None
    """Filled by the learner (recompute mode) before the first update."""
    ref_logprobs: torch.Tensor | None = None
    """Filled by the learner when kl_coef > 0."""
    model_mask: torch.Tensor | None = None
    """The loss mask before `algo.rollout_rs` rejected tokens from it (set by agentloop.train.verl_order): a
    sequence-level importance weight sums its episode's log-ratios over these, as verl's does."""
    attn_cache: dict = field(default_factory=dict)
    """The attention mask built from doc_ids/seg_ids for a device, kept for the step's later passes."""

    @property
    def packed(self) -> bool:
        return self.doc_ids is not None

    @property
    def tokens(self) -> int:
        return sum(self.row_lengths)

    @property
    def shared_rows(self) -> int:
        """Items that hold a prompt and more than one response."""
        return sum(1 for it in self.items if len(it) > 1)

    @property
    def shared(self) -> bool:
        """Some item holds a shared prompt (padded layout: a 4-D attention mask)."""
        return self.shared_rows > 0

    def loss(self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, algo: AlgoConfig, *,
             entropy: torch.Tensor | None = None) -> LossOutput:
        """`losses.policy_loss` on this micro-batch's tensors (its mask, weights, behaviour and reference logprobs,
        episodes and pre-rejection mask), given the current logprobs, the ratio's denominator and the advantages:
        the learner's loss of one forward/backward."""
        return policy_loss(logp, old_logp, advantages, self.loss_mask, self.weights, algo,
                           rollout_logp=self.rollout_logprobs, ref_logp=self.ref_logprobs, entropy=entropy,
                           seq_ids=self.seq_ids, n_seqs=len(self.spans), seq_mask=self.model_mask)

    def to(self, device: torch.device) -> "MicroBatch":
        for name in ("input_ids", "attention_mask", "position_ids", "targets", "loss_mask", "advantages",
                     "rollout_logprobs", "weights", "old_logprobs", "ref_logprobs", "model_mask", "ret_end",
                     "versions", "seq_ids", "doc_ids", "seg_ids"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device, non_blocking=True))
        return self


def episode_return(mb: MicroBatch, values: torch.Tensor) -> torch.Tensor:
    """Per position, the sum of `values` ([b, L]) from that position to the end of its episode's span
    (0 outside spans if `values` is 0 there): the return of a per-token reward, gamma = 1."""
    assert mb.ret_end is not None
    b, L = values.shape
    # suffix[j] = sum of values[j:]; one zero column so ret_end == L is a valid index
    suffix = torch.cat([values.flip(-1).cumsum(-1).flip(-1), values.new_zeros(b, 1)], dim=-1)
    return suffix[:, :L] - suffix.gather(-1, mb.ret_end)


def kl_reward_advantages(mb: MicroBatch, advantages: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor,
                         coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """KL in the reward (algo.kl_type=k1_reward): each model token's reward gets -coef * (old - ref) (k1 under
    the proximal policy), and its advantage drops by that penalty's return to the end of its episode.
    Returns (advantages, per-token penalty), both zero off the loss mask."""
    m = mb.loss_mask
    pen = coef * (old_logp.detach() - ref_logp.detach()).to(torch.float32) * m
    return (advantages - episode_return(mb, pen)) * m, pen


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
Layout = Literal["padded", "packed"]


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


def collate_packed(
    episodes: list[Episode],
    items: list[list[int]],
    mode: LossAggMode,
    *,
    num_tokens: float,
    num_seqs: float,
    pad_id: int = 0,
    pad_multiple: int = 1,
) -> MicroBatch:
    """One packed row: `items` back to back (each a plain sequence or a shared prompt + segments), the
    row's length rounded up to `pad_multiple` (module doc, "Packed layout")."""
    return _collate_rows(episodes, items, mode, num_tokens=num_tokens, num_seqs=num_seqs, pad_id=pad_id,
                         shared=False, packed=True, pad_multiple=pad_multiple)


def _collate_rows(
    episodes: list[Episode],
    items: list[list[int]],
    mode: LossAggMode,
    *,
    num_tokens: float,
    num_seqs: float,
    pad_id: int,
    shared: bool,
    packed: bool = False,
    pad_multiple: int = 1,
) -> MicroBatch:
    """Item r = the prompt of items[r] once, then a segment per episode (module doc). Padded layout: a row
    per item; a row of one episode is that episode's plain sequence, so `shared` only decides the attention
    mask: 2-D padding mask (causal inside the model) or 4-D, each segment seeing the prompt and itself.
    Packed layout: every item in row 0, one after the other."""
    lengths = [item_length(episodes, it) for it in items]
    if packed:
        b = 1
        L = max(sum(lengths), 1)
        L = -(-L // pad_multiple) * pad_multiple
    else:
        b, L = max(len(items), 1), max(lengths + [1])
    # Filled as numpy arrays from the episodes' lists (slice assignment runs in C; a torch.tensor per field
    # and episode cost ~0.15 s per step at 512 episodes), turned into tensors once at the end.
    input_ids = np.full((b, L), pad_id, dtype=np.int64)
    targets = np.full((b, L), pad_id, dtype=np.int64)
    if packed:
        attn = None
    else:
        attn = torch.zeros((b, 1, L, L) if shared else (b, L), dtype=torch.bool if shared else torch.long)
    pos = np.zeros((b, L), dtype=np.int64)
    mask = np.zeros((b, L), dtype=np.float32)
    adv = np.zeros((b, L), dtype=np.float32)
    rlp = np.zeros((b, L), dtype=np.float32)
    w = np.zeros((b, L), dtype=np.float64)
    ret_end = np.tile(np.arange(1, L + 1, dtype=np.int64), (b, 1))
    seq_ids = np.full((b, L), -1, dtype=np.int64)
    has_versions = any(episodes[i].versions is not None for it in items for i in it)
    vers = np.full((b, L), -1, dtype=np.int64) if has_versions else None
    doc = np.full((L,), -1, dtype=np.int32) if packed else None
    seg = np.zeros((L,), dtype=np.int32) if packed else None
    causal = torch.ones((L, L), dtype=torch.bool).tril() if shared else None
    spans: list[tuple[int, int, int]] = []
    episode_ids: list[int] = []
    if not items and attn is not None:
        attn[0, 0] = 1
    off = 0
    for n, item in enumerate(items):
        r = 0 if packed else n
        first = episodes[item[0]]
        p = first.prompt_len - 1
        input_ids[r, off:off + p] = first.ids[:p]
        targets[r, off:off + p] = first.ids[1:p + 1]
        pos[r, off:off + p] = np.arange(p)
        if shared:
            attn[r, 0, :p, :p] = causal[:p, :p]
        if packed:
            doc[off:off + lengths[n]] = n
        a = off + p
        for j, i in enumerate(item):
            e = episodes[i]
            k = e.length - p
            if k != len(e.response_mask):
                raise ValueError(f"episode {i}: {k} response positions but {len(e.response_mask)} mask entries")
            input_ids[r, a:a + k] = e.ids[p:p + k]
            targets[r, a:a + k] = e.ids[p + 1:p + 1 + k]
            pos[r, a:a + k] = np.arange(p, p + k)
            if shared:
                attn[r, 0, a:a + k, :p] = True
                attn[r, 0, a:a + k, a:a + k] = causal[:k, :k]
            if packed and len(item) > 1:
                seg[a:a + k] = j + 1
            m = np.asarray(e.response_mask, dtype=np.float32)
            mask[r, a:a + k] = m
            rlp[r, a:a + k] = e.rollout_logprobs
            adv[r, a:a + k] = e.advantage * m
            w[r, a:a + k] = token_weights(torch.from_numpy(m)[None], mode, num_tokens=num_tokens,
                                          num_seqs=num_seqs)[0].numpy()
            ret_end[r, a:a + k] = a + k
            seq_ids[r, a:a + k] = len(spans)
            if vers is not None and e.versions is not None:
                vers[r, a:a + k] = e.versions
            spans.append((r, a, k))
            episode_ids.append(i)
            a += k
        if packed:
            off = a
        elif shared:
            # Padding queries see only themselves: a fully masked row would make SDPA return NaN, and
            # NaN * 0 weight is still NaN in the backward pass.
            pad = torch.arange(a, L)
            attn[r, 0, pad, pad] = True
        else:
            attn[r, :a] = 1
    t = torch.from_numpy
    return MicroBatch(t(input_ids), attn, t(pos), t(targets), t(mask), t(adv), t(rlp), t(w), episode_ids, spans=spans,
                      row_lengths=lengths, row_attn_sq=[item_attn_sq(episodes, it) for it in items],
                      items=[list(it) for it in items], ret_end=t(ret_end), seq_ids=t(seq_ids),
                      versions=None if vers is None else t(vers), doc_ids=None if doc is None else t(doc),
                      seg_ids=None if seg is None else t(seg))


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


def collate_micro_batches(
    episodes: list[Episode],
    micro_batches: list[list[list[int]]],
    mode: LossAggMode,
    *,
    num_tokens: float,
    num_seqs: float,
    pad_id: int = 0,
    layout: Layout = "padded",
    pad_multiple: int = 1,
) -> list[MicroBatch]:
    """Tensors of one rank's micro-batches (rows of episode indices, `plan_ranks`), with the mini-batch's totals
    `num_tokens` / `num_seqs`. Padded layout: a micro-batch with a shared row gets the 4-D mask for all its rows.
    Packed layout: each micro-batch is one packed row (`collate_packed`)."""
    out = []
    for rows in micro_batches:
        if layout == "packed":
            out.append(collate_packed(episodes, rows, mode, num_tokens=num_tokens, num_seqs=num_seqs,
                                      pad_id=pad_id, pad_multiple=pad_multiple))
        else:
            out.append(_collate_rows(episodes, rows, mode, num_tokens=num_tokens, num_seqs=num_seqs,
                                     pad_id=pad_id, shared=any(len(it) > 1 for it in rows)))
    return out


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
    layout: Layout = "padded",
    pad_multiple: int = 1,
) -> list[MicroBatch]:
    """This rank's micro-batches of the mini-batch `idxs`: `plan_ranks` then `collate_micro_batches`."""
    num_tokens, num_seqs = mini_batch_totals(episodes, idxs)
    mine = plan_ranks(episodes, idxs, budget=budget, world=world, share=share, cost=cost)[rank]
    return collate_micro_batches(episodes, mine, mode, num_tokens=num_tokens, num_seqs=num_seqs, pad_id=pad_id,
                                 layout=layout, pad_multiple=pad_multiple)


__all__ = [
    "Episode",
    "MicroBatch",
    "Prepared",
    "RowCost",
    "ShareMode",
    "collate",
    "collate_micro_batches",
    "collate_packed",
    "collate_shared",
    "episode_return",
    "kl_reward_advantages",
    "item_length",
    "mini_batch_indices",
    "mini_batch_totals",
    "pack_greedy",
    "plan_micro_batches",
    "plan_ranks",
    "prepare_episodes",
    "shard_for_rank",
    "share_items",
    "staleness_metrics",
]
