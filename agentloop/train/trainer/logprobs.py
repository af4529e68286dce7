"""Per-token log-probabilities and entropy without [tokens x vocabulary] float32 tensors.

Map:
    ChunkedLogprobs    autograd Function: final hidden states + LM head weight -> logprob of each target
                       (and the entropy), chunk by chunk; the backward pass recomputes each chunk's logits
    chunked_logprobs   the functional entry (fused=True: each chunk's math through torch.compile)
    LogprobHead        patches a HF causal LM's output layer so the model's own forward returns
                       [b, L, 2] = (logprob, entropy) instead of logits while a request is set (`use`)
    HeadTransform      (agentloop.train.model_support) what a model does to its head's output before the softmax
                       (Granite, Cohere scale it, Gemma-2 soft-caps it): the head applies it itself, in every
                       chunk and in its plain path

Why inside the model's forward: under FSDP2 the LM head weight (tied to the embedding in small Qwen
models) belongs to the root module, which gathers it for its forward and reduce-scatters its gradient
after the backward; computing the logprobs in the head's place keeps that life cycle untouched.

Memory: a chunk of c tokens holds its logits in the compute dtype and two float32 [c x V] buffers at a
time (forward and backward); nothing of size tokens x V is saved for the backward pass (only the
per-token log-sum-exp and entropy). The logits are those of the unchunked head (the same bf16 matmul,
then float32), so logprobs match; gradients differ only by the order of float summation over chunks.

With z = logits / T, p = softmax(z), logp_y = z_y - lse(z), H = lse(z) - sum(p z):
    d logp_y / dz = onehot(y) - p,    dH / dz = -p * (log p + H),    d/dlogits = d/dz / T.
With a head transform, logits = f(x) of the raw head output x = hidden @ W^T: f(x) = s x, then
c tanh(f / c) when soft-capped, so d/dx = d/dz * s / T (times 1 - tanh^2 when soft-capped).
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from agentloop.train.model_support import HeadTransform

IDENTITY = HeadTransform()


def _tempered(x: torch.Tensor, acc: torch.dtype, temperature: float, scale: float, softcap: float | None,
              deriv: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """z = f(x) / T of a chunk's raw head output x [c, V], in `acc`, and (deriv, soft-capped heads only) the soft
    cap's derivative 1 - tanh^2 [c, V]. Works in x's buffer when x is already in `acc` (a fresh matmul result)."""
    x = x.to(acc)
    d = None
    if scale != 1.0:
        x.mul_(scale)
    if softcap is not None:
        x = torch.tanh(x.div_(softcap))
        if deriv:
            d = x.square().neg_().add_(1.0)
        x.mul_(softcap)
    if temperature != 1.0:
        x.div_(temperature)
    return x, d


def _fwd_chunk(z: torch.Tensor, targets: torch.Tensor, temperature: float, want_entropy: bool,
               scale: float = 1.0, softcap: float | None = None):
    """(logp, lse, entropy or None) of one chunk's raw head output z [c, V] (any float dtype; float32 math or
    wider), through the head transform (scale, softcap)."""
    acc = torch.promote_types(z.dtype, torch.float32)
    z = z.to(acc)
    if scale != 1.0:
        z = z * scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    ent = lse - (torch.exp(z - lse.unsqueeze(-1)) * z).sum(-1) if want_entropy else None
    return logp, lse, ent


def _bwd_chunk(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None,
               g_logp: torch.Tensor | None, g_ent: torch.Tensor | None, temperature: float,
               scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """d loss / d raw head output of one chunk, in the input's dtype, from z [c, V] and the saved lse / entropy."""
    acc = lse.dtype
    x = z.to(acc)
    if scale != 1.0:
        x = x * scale
    t = None
    if softcap is not None:
        t = torch.tanh(x / softcap)
        x = t * softcap
    logq = x / temperature - lse.unsqueeze(-1)
    p = torch.exp(logq)
    g = torch.zeros_like(p)
    if g_logp is not None:
        gl = g_logp.to(acc).unsqueeze(-1)
        onehot = torch.arange(z.shape[-1], device=z.device).unsqueeze(0) == targets.unsqueeze(-1)
        g = g + torch.where(onehot, gl, 0.0) - p * gl
    if g_ent is not None:
        g = g - p * (logq + ent.unsqueeze(-1)) * g_ent.to(acc).unsqueeze(-1)
    g = g / temperature
    if scale != 1.0:
        g = g * scale
    if t is not None:
        g = g * (1.0 - t * t)
    return g.to(z.dtype)


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
                chunk: int, want_entropy: bool, fused: bool = False, scale: float = 1.0,
                softcap: float | None = None):
        n = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # float32 math for bf16 models, as logits.float()
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        ent = torch.empty(n if want_entropy else 0, dtype=acc, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            if fused:
                lp_c, lse_c, ent_c = _Fused.call("fwd", hidden[s:e] @ weight.t(), targets[s:e], temperature,
                                                 want_entropy, scale, softcap)
                logp[s:e], lse[s:e] = lp_c, lse_c
                if want_entropy:
                    ent[s:e] = ent_c
                continue
            z, _ = _tempered(hidden[s:e] @ weight.t(), acc, temperature, scale, softcap)
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
        ctx.scale, ctx.softcap = scale, softcap
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        return logp, ent, lse

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g_lse):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        T, chunk, scale, softcap = ctx.temperature, ctx.chunk, ctx.scale, ctx.softcap
        use_ent = ctx.want_entropy and g_ent is not None
        none = (None,) * 9
        if g_logp is None and not use_ent:
            return none
        n = hidden.shape[0]
        acc = lse.dtype
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            hc = hidden[s:e]
            if ctx.fused:
                gz = _Fused.call("bwd", hc @ weight.t(), targets[s:e], lse[s:e], ent[s:e] if use_ent else None,
                                 None if g_logp is None else g_logp[s:e], g_ent[s:e] if use_ent else None, T,
                                 scale, softcap)
                if grad_h is not None:
                    grad_h[s:e] = gz @ weight
                if grad_w is not None:
                    grad_w.add_((gz.t() @ hc).to(acc))
                continue
            z, dcap = _tempered(hc @ weight.t(), acc, T, scale, softcap, deriv=True)
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
            if scale != 1.0:
                gs.mul_(scale)
            if dcap is not None:
                gs.mul_(dcap)
            gz = gs.to(weight.dtype)
            del gs, p, z, logq, dcap
            if grad_h is not None:
                grad_h[s:e] = gz @ weight
            if grad_w is not None:
                grad_w.add_((gz.t() @ hc).to(acc))
            del gz
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype)) + none[2:]


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                     chunk: int = 2048, entropy: bool = False, fused: bool = False,
                     transform: HeadTransform = IDENTITY) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprob [N], entropy [N] or None) of `targets` [N] under logits = f(hidden [N, H] @ weight [V, H]^T) / T,
    f the model's head transform (identity for most models).

    fused: each chunk's elementwise math through torch.compile (GPU), else eager with in-place buffers."""
    logp, ent, _ = ChunkedLogprobs.apply(hidden, weight, targets, float(temperature), int(chunk), bool(entropy),
                                         bool(fused), float(transform.scale),
                                         None if transform.softcap is None else float(transform.softcap))
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
    it is the plain linear layer followed by `transform` (generation and anything else keep working).

    A model whose forward transforms the head's output itself (Gemma-2's soft cap, Granite's and Cohere's
    scales) would transform the [b, L, 2] of a request too: agentloop.train.model_support switches that off in
    the model and hands the transform here. `output` is the tensor the last request returned, so a caller can
    check that the model's forward passed it through unchanged (`returned_as_is`)."""

    def __init__(self, model: Any, transform: HeadTransform = IDENTITY):
        head = model.get_output_embeddings()
        if head is None or not isinstance(head, torch.nn.Linear):
            raise ValueError(f"{type(model).__name__}: no linear output layer to compute logprobs from")
        if head.bias is not None:
            raise ValueError(f"{type(model).__name__}: the chunked logprob head does not support an LM head bias")
        self.module = head
        self.transform = transform
        self.request: _Request | None = None
        self.output: torch.Tensor | None = None
        self._checked = False
        original = head.forward
        owner = self

        def forward(mod: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
            req = owner.request
            if req is None:
                out = original(hidden)
                return out if owner.transform.identity else owner.transform.apply(out)
            b, L, H = hidden.shape
            targets = req.targets.reshape(-1)
            if targets.numel() != b * L:
                raise ValueError(f"logprob head: {targets.numel()} targets for {b}x{L} positions")
            logp, ent = chunked_logprobs(hidden.reshape(b * L, H), mod.weight, targets, temperature=req.temperature,
                                         chunk=req.chunk, entropy=req.entropy, fused=req.fused,
                                         transform=owner.transform)
            if ent is None:
                ent = torch.zeros_like(logp)
            elif not req.entropy_grad:
                ent = ent.detach()
            # stacked last, so the output is no view (FSDP2 warns about views it cannot hook)
            owner.output = torch.stack([logp.view(b, L), ent.view(b, L)], dim=-1)
            return owner.output

        head.forward = types.MethodType(forward, head)

    @contextlib.contextmanager
    def use(self, targets: torch.Tensor, *, entropy: bool, entropy_grad: bool, temperature: float,
            chunk: int, fused: bool = False) -> Iterator[None]:
        self.request = _Request(targets, entropy, entropy_grad, temperature, chunk, fused)
        self.output = None
        try:
            yield
        finally:
            self.request = None

    def returned_as_is(self, logits: torch.Tensor) -> bool:
        """Whether the model's forward returned the last request's output unchanged (and forgets it). A
        neutralized scale still divides by 1.0 (a new tensor, equal values): values are compared, on the first
        request only (the comparison waits for the device; the forward's code path is the same every time)."""
        out, self.output = self.output, None
        if out is None:
            return False
        if logits is out or self._checked:
            return True
        self._checked = logits.shape == out.shape and bool(torch.equal(logits.detach(), out.detach()))
        return self._checked


__all__ = ["ChunkedLogprobs", "HeadTransform", "LogprobHead", "chunked_logprobs"]
