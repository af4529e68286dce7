"""Per-token log-probabilities and entropy without [tokens x vocabulary] float32 tensors.

Map:
    ChunkedLogprobs    autograd Function: final hidden states + LM head weight -> logprob of each target
                       (and the entropy), chunk by chunk; the backward pass recomputes each chunk's logits
    chunked_logprobs   the functional entry (fused=True: each chunk's math through torch.compile)
    LogprobHead        patches a HF causal LM's output layer so the model's own forward returns
                       [b, L, 2] = (logprob, entropy) instead of logits while a request is set (`use`)

Why inside the model's forward: under FSDP2 the LM head weight (tied to the embedding in small Qwen
models) belongs to the root module, which gathers it for its forward and reduce-scatters its gradient
after the backward; computing the logprobs in the head's place keeps that life cycle untouched.

Memory: a chunk of c tokens holds its logits in the compute dtype and two float32 [c x V] buffers at a
time (forward and backward); nothing of size tokens x V is saved for the backward pass (only the
per-token log-sum-exp and entropy). The logits are those of the unchunked head (the same bf16 matmul,
then float32), so logprobs match; gradients differ only by the order of float summation over chunks.

With z = logits / T, p = softmax(z), logp_y = z_y - lse(z), H = lse(z) - sum(p z):
    d logp_y / dz = onehot(y) - p,    dH / dz = -p * (log p + H),    d/dlogits = d/dz / T.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Any, Iterator

import torch


def _fwd_chunk(z: torch.Tensor, targets: torch.Tensor, temperature: float, want_entropy: bool):
    """(logp, lse, entropy or None) of one chunk's logits z [c, V] (any float dtype; float32 math or wider)."""
    acc = torch.promote_types(z.dtype, torch.float32)
    z = z.to(acc) / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    ent = lse - (torch.exp(z - lse.unsqueeze(-1)) * z).sum(-1) if want_entropy else None
    return logp, lse, ent


def _bwd_chunk(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None,
               g_logp: torch.Tensor | None, g_ent: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """d loss / d logits of one chunk, in the logits' dtype, from z [c, V] and the saved lse / entropy."""
    acc = lse.dtype
    logq = z.to(acc) / temperature - lse.unsqueeze(-1)
    p = torch.exp(logq)
    g = torch.zeros_like(p)
    if g_logp is not None:
        gl = g_logp.to(acc).unsqueeze(-1)
        onehot = torch.arange(z.shape[-1], device=z.device).unsqueeze(0) == targets.unsqueeze(-1)
        g = g + torch.where(onehot, gl, 0.0) - p * gl
    if g_ent is not None:
        g = g - p * (logq + ent.unsqueeze(-1)) * g_ent.to(acc).unsqueeze(-1)
    return (g / temperature).to(z.dtype)


class _Fused:
    """torch.compile'd `_fwd_chunk` / `_bwd_chunk` (one or two fused passes over a chunk's logits instead of
    ~8 elementwise ones); compiled on first use, and on any compile error the eager path is used from then on."""

    fwd: Any = None
    bwd: Any = None
    failed: str | None = None

    @classmethod
    def call(cls, which: str, *args):
        # plain tensors in (no autograd history: the Function's own backward is the gradient)
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        if cls.failed is None:
            try:
                if cls.fwd is None:
                    cls.fwd = torch.compile(_fwd_chunk, dynamic=None)
                    cls.bwd = torch.compile(_bwd_chunk, dynamic=None)
                return (cls.fwd if which == "fwd" else cls.bwd)(*args)
            except Exception as e:  # noqa: BLE001 - a compiler failure must not stop training: eager is exact
                cls.failed = f"{type(e).__name__}: {e}"
                import warnings

                warnings.warn(f"logprob head: torch.compile failed, using the eager path ({cls.failed[:300]})",
                              RuntimeWarning, stacklevel=2)
        return (_fwd_chunk if which == "fwd" else _bwd_chunk)(*args)


class ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, want_entropy: bool, fused: bool = False):
        n = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # float32 math for bf16 models, as logits.float()
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        ent = torch.empty(n if want_entropy else 0, dtype=acc, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            if fused:
                lp_c, lse_c, ent_c = _Fused.call("fwd", hidden[s:e] @ weight.t(), targets[s:e], temperature,
                                                 want_entropy)
                logp[s:e], lse[s:e] = lp_c, lse_c
                if want_entropy:
                    ent[s:e] = ent_c
                continue
            z = (hidden[s:e] @ weight.t()).to(acc)
            if temperature != 1.0:
                z.div_(temperature)
            lse_c = torch.logsumexp(z, dim=-1)
            lse[s:e] = lse_c
            logp[s:e] = z.gather(-1, targets[s:e].unsqueeze(-1)).squeeze(-1) - lse_c
            if want_entropy:
                # H = lse - sum(p * z), p = exp(z - lse)
                pz = torch.exp(z - lse_c.unsqueeze(-1)).mul_(z).sum(-1)
                ent[s:e] = lse_c - pz
            del z
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.chunk, ctx.want_entropy, ctx.fused = temperature, chunk, want_entropy, fused
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        return logp, ent, lse

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g_lse):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        use_ent = ctx.want_entropy and g_ent is not None
        if g_logp is None and not use_ent:
            return None, None, None, None, None, None, None
        n = hidden.shape[0]
        acc = lse.dtype
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            hc = hidden[s:e]
            if ctx.fused:
                gz = _Fused.call("bwd", hc @ weight.t(), targets[s:e], lse[s:e], ent[s:e] if use_ent else None,
                                 None if g_logp is None else g_logp[s:e], g_ent[s:e] if use_ent else None, T)
                if grad_h is not None:
                    grad_h[s:e] = gz @ weight
                if grad_w is not None:
                    grad_w.add_((gz.t() @ hc).to(acc))
                continue
            z = (hc @ weight.t()).to(acc)
            if T != 1.0:
                z.div_(T)
            logq = z.sub_(lse[s:e].unsqueeze(-1))  # in place: log p
            p = torch.exp(logq)
            gs = None
            if use_ent:  # dH/dz = -p * (log p + H), times H's incoming gradient; reuses logq's buffer
                gs = logq.add_(ent[s:e].unsqueeze(-1)).mul_(p).mul_(-g_ent[s:e].to(acc).unsqueeze(-1))
            if g_logp is not None:  # dlogp_y/dz = onehot(y) - p; reuses p's buffer
                gl = g_logp[s:e].to(acc).unsqueeze(-1)
                gp = p.mul_(-gl).scatter_add_(-1, targets[s:e].unsqueeze(-1), gl)
                gs = gp if gs is None else gs.add_(gp)
            if T != 1.0:
                gs.div_(T)
            gz = gs.to(weight.dtype)
            del gs, p, z, logq
            if grad_h is not None:
                grad_h[s:e] = gz @ weight
            if grad_w is not None:
                grad_w.add_((gz.t() @ hc).to(acc))
            del gz
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                     chunk: int = 2048, entropy: bool = False,
                     fused: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprob [N], entropy [N] or None) of `targets` [N] under logits = hidden [N, H] @ weight [V, H]^T / T.

    fused: each chunk's elementwise math through torch.compile (GPU), else eager with in-place buffers."""
    logp, ent, _ = ChunkedLogprobs.apply(hidden, weight, targets, float(temperature), int(chunk), bool(entropy),
                                         bool(fused))
    return logp, (ent if entropy else None)


@dataclass
class _Request:
    targets: torch.Tensor
    entropy: bool
    entropy_grad: bool
    temperature: float
    chunk: int
    fused: bool


class LogprobHead:
    """The model's output layer, patched: with a request set (`use`), its forward returns
    [b, L, 2] float32 = (logprob of targets[b, l], entropy or 0) instead of [b, L, V] logits; without one
    it is the plain linear layer (generation and anything else keep working)."""

    def __init__(self, model: Any):
        head = model.get_output_embeddings()
        if head is None or not isinstance(head, torch.nn.Linear):
            raise ValueError(f"{type(model).__name__}: no linear output layer to compute logprobs from")
        if head.bias is not None:
            raise ValueError(f"{type(model).__name__}: the chunked logprob head does not support an LM head bias")
        self.module = head
        self.request: _Request | None = None
        original = head.forward
        owner = self

        def forward(mod: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
            req = owner.request
            if req is None:
                return original(hidden)
            b, L, H = hidden.shape
            targets = req.targets.reshape(-1)
            if targets.numel() != b * L:
                raise ValueError(f"logprob head: {targets.numel()} targets for {b}x{L} positions")
            logp, ent = chunked_logprobs(hidden.reshape(b * L, H), mod.weight, targets, temperature=req.temperature,
                                         chunk=req.chunk, entropy=req.entropy, fused=req.fused)
            if ent is None:
                ent = torch.zeros_like(logp)
            elif not req.entropy_grad:
                ent = ent.detach()
            # stacked last, so the output is no view (FSDP2 warns about views it cannot hook)
            return torch.stack([logp.view(b, L), ent.view(b, L)], dim=-1)

        head.forward = types.MethodType(forward, head)

    @contextlib.contextmanager
    def use(self, targets: torch.Tensor, *, entropy: bool, entropy_grad: bool, temperature: float,
            chunk: int, fused: bool = False) -> Iterator[None]:
        self.request = _Request(targets, entropy, entropy_grad, temperature, chunk, fused)
        try:
            yield
        finally:
            self.request = None


__all__ = ["ChunkedLogprobs", "LogprobHead", "chunked_logprobs"]
