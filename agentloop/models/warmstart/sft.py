"""Plain-torch SFT of the tiny model on the traces (assistant-only loss, shared-prefix batches)."""

from __future__ import annotations

import logging
import math
import random
import time
from typing import Any

from agentloop.models.warmstart.spec import Trace, WarmStartSpec

logger = logging.getLogger(__name__)


def _common_prefix_len(rows: list[list[int]]) -> int:
    n = min(len(r) for r in rows)
    first = rows[0]
    for i in range(n):
        t = first[i]
        if any(r[i] != t for r in rows):
            return i
    return n


def _forward_shared_prefix(model: Any, prefix: Any, suffix: Any, **kwargs: Any) -> tuple[Any, Any]:
    """(hidden states, KV cache) of `suffix` (B, S) continuing the one shared `prefix` (P,), run once.

    The prefix runs without autograd (its keys and values are constants of the step: the loss lies on
    assistant tokens after it, and skipping its backward saves about a quarter of a step); its KV cache
    is repeated across the batch. Extra kwargs (attention_mask over P + S, position_ids) go to the
    suffix's forward.
    """
    import torch

    with torch.no_grad():
        pre = model.model(input_ids=prefix[None], use_cache=True)
    cache = pre.past_key_values
    cache.batch_repeat_interleave(suffix.shape[0])
    out = model.model(input_ids=suffix, past_key_values=cache, use_cache=True, **kwargs)
    return out.last_hidden_state, out.past_key_values


def _lr_at(step: int, spec: WarmStartSpec) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    span = max(1, spec.steps - spec.warmup_steps)
    progress = min(1.0, (step - spec.warmup_steps) / span)
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_sft(model: Any, traces: list[Trace], spec: WarmStartSpec, pad_id: int) -> list[float]:
    """Fine-tune `model` (float32, in place) on `traces`; returns the loss of every step.

    Loss: mean next-token cross-entropy over the assistant tokens of the batch (mask 1 targets).
    Batches: `batch_size` traces in a seeded shuffled order, epoch after epoch; the prefix common to
    all traces is run once per step, the rest right-padded (causal attention never sees the padding of
    a row before its last real token, and padded targets carry no loss). The logits are computed only
    at the positions that have a target.
    """
    import torch
    import torch.nn.functional as F

    P = _common_prefix_len([t.ids for t in traces])
    if any(1 in t.mask[:P + 1] for t in traces):
        raise ValueError("an assistant token lies in the prefix shared by all traces")
    dev = next(model.parameters()).device
    prefix = torch.tensor(traces[0].ids[:P], device=dev)
    order_rng = random.Random(spec.seed + 1)
    order: list[int] = []
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=spec.weight_decay)
    losses: list[float] = []
    t0 = time.monotonic()
    for step in range(spec.steps):
        while len(order) < spec.batch_size:
            epoch = list(range(len(traces)))
            order_rng.shuffle(epoch)
            order += epoch
        batch = [traces[i] for i in order[:spec.batch_size]]
        del order[:spec.batch_size]
        S = max(len(t.ids) for t in batch) - P
        ids = torch.full((len(batch), S), pad_id, dtype=torch.long)
        tmask = torch.zeros((len(batch), S), dtype=torch.bool)
        for b, t in enumerate(batch):
            ids[b, :len(t.ids) - P] = torch.tensor(t.ids[P:])
            tmask[b, :len(t.ids) - P] = torch.tensor(t.mask[P:], dtype=torch.bool)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, spec)
        ids, tmask = ids.to(dev), tmask.to(dev)
        hidden, _ = _forward_shared_prefix(model, prefix, ids)
        sel = tmask[:, 1:]  # position j predicts token j + 1
        logits = model.lm_head(hidden[:, :-1][sel]).float()
        loss = F.cross_entropy(logits, ids[:, 1:][sel])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        if step % 20 == 0 or step == spec.steps - 1:
            logger.info("warm start step %d/%d loss %.4f lr %.2e (%.1fs)", step + 1, spec.steps, losses[-1],
                        _lr_at(step, spec), time.monotonic() - t0)
    model.eval()
    return losses
