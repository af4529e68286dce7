"""A rank's planned micro-batches (rows of episode indices, agentloop.train.batch.packing) -> tensors of one
forward/backward each, packed or padded; the learner's side of a step's batch.

Map:
    MicroBatch         the tensors of one forward/backward, and `loss` (losses.policy_loss on them)
    collate            padded tensors of one micro-batch, a row per episode (2-D attention mask)
    collate_shared     the same with rows of one prompt + several responses (4-D attention mask)
    collate_packed     one row holding every row of the micro-batch back to back, no padding between
                       them: position ids restart per row, and `doc_ids`/`seg_ids` say what may attend
                       to what (agentloop.train.trainer.attention turns them into a block or dense mask)
    episode_return     per-token reward -> its return to the end of the episode (KL in the reward)
    kl_reward_advantages   KL in the reward: the per-token penalty and the advantages it lowers
    collate_micro_batches  one rank's planned micro-batches as tensors
    plan_micro_batches plan_ranks then collate_micro_batches, for one rank

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
or seg[q] (agentloop.train.trainer.attention.allowed).

Gradient accumulation: `weights` are `losses.token_weights` computed with the *mini-batch's*
global counts (all ranks), so sum over micro-batches and ranks of `sum(weights * l)` is the
mini-batch loss in every aggregation mode. FSDP averages gradients over ranks, so the learner
multiplies each micro-batch loss by the world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from agentloop.train.batch.episodes import Episode
from agentloop.train.batch.packing import ShareMode, item_attn_sq, item_length, mini_batch_totals, plan_ranks
from agentloop.train.config import AlgoConfig, LossAggMode
from agentloop.train.flops import RowCost
from agentloop.train.trainer.losses import LossOutput, policy_loss, token_weights


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
    """The loss mask before `algo.rollout_rs` rejected tokens from it (set by agentloop.train.trainer.verl_order): a
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


Layout = Literal["padded", "packed"]


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
    "MicroBatch",
    "collate",
    "collate_micro_batches",
    "collate_packed",
    "collate_shared",
    "episode_return",
    "kl_reward_advantages",
    "plan_micro_batches",
]
