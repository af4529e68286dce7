"""The training backend: one in-process torch model per Tinker training client, on the service's device.

A `TrainingModel` is the base model loaded from its local HF directory (transformers), with agentloop's LoRA layers
(agentloop.train.lora) on the projections the request's LoraConfig names, or, as our extension, every weight
trainable (full weights). It runs synchronously (the service calls it on its one training thread, in each model's
request order):

    forward_backward(req)   the target tokens' logprobs (one padded forward of the batch), Tinker's loss per datum
                            (agentloop.tinker.losses), summed, backward: gradients ACCUMULATE until optim_step
                            (forward_only: no graph); -> per-datum outputs (logprobs, elementwise_loss) + metrics
    optim_step(AdamParams)  Adam (torch AdamW: decoupled weight decay, as Tinker's) with the request's lr, betas,
                            eps, weight_decay, grad_clip_norm (0: no clipping); then the gradients are zeroed
    save_for_sampler(dir)   LoRA: a PEFT adapter directory (what SGLang loads by name); full: an HF directory
    save_state / load_state the trainable tensors and (optionally) Adam's state, one torch file

Simplified, and said so in docs/tinker.md: LoRA adapts attention and MLP projections; `train_unembed` is accepted
but the LM head takes no adapter here; the whole batch is one forward (no micro-batching).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from agentloop.tinker.losses import get_loss
from agentloop.tinker.wire import FwdBwdRequest

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class ModelSpec(BaseModel):
    """What a training model is: its base, and LoRA (rank, which layers) or full weights."""

    base_model: str
    """The name the client asked for (the service's served model name or its local path)."""
    model_path: str
    """The local HF directory it is loaded from."""
    lora_rank: int | None = Field(default=32, ge=1)
    """LoRA rank; None: full weights (our extension)."""
    lora_alpha: float = 32.0
    """LoRA alpha (scale alpha / rank), the same in the adapter files SGLang reads."""
    train_attn: bool = True
    """Adapters on q/k/v/o."""
    train_mlp: bool = True
    """Adapters on gate/up/down."""
    seed: int = 0
    """Seed of the adapters' A matrices."""

    @property
    def is_lora(self) -> bool:
        return self.lora_rank is not None

    def lora_config(self) -> Any:
        from agentloop.train.config import LoraConfig

        targets = (ATTN if self.train_attn else ()) + (MLP if self.train_mlp else ())
        return LoraConfig(enabled=True, rank=self.lora_rank or 1, alpha=self.lora_alpha, target_modules=list(targets),
                          seed=self.seed)


class TrainingModel:
    """One training client's model and optimizer (module doc)."""

    def __init__(self, spec: ModelSpec, device: str = "cpu", dtype: str = "float32"):
        import torch
        from transformers import AutoModelForCausalLM

        self.spec = spec
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=self.dtype)
        if spec.is_lora:
            from agentloop.train.lora import initial_adapter, inject_lora

            cfg = spec.lora_config()
            names = inject_lora(model, cfg)
            init = initial_adapter(model.state_dict(), names, cfg.rank, spec.seed)
            model.load_state_dict({k: v.to(self.dtype) for k, v in init.items()}, strict=False)
        else:
            model.requires_grad_(True)
        self.model = model.to(self.device)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.steps = 0

    # ------------------------------------------------------------------ passes

    def _logprobs(self, datums: list[Any], grad: bool) -> list[Any]:
        import torch

        n = max(len(d.tokens) for d in datums)
        ids = torch.zeros(len(datums), n, dtype=torch.long)
        mask = torch.zeros(len(datums), n, dtype=torch.long)
        tgt = torch.zeros(len(datums), n, dtype=torch.long)
        for i, d in enumerate(datums):
            t = d.inputs.get("target_tokens")
            if t is None:
                raise ValueError("every datum needs loss_fn_inputs['target_tokens']")
            t = np.asarray(t).reshape(-1)
            if len(t) != len(d.tokens):
                raise ValueError(f"target_tokens has {len(t)} entries for a model input of {len(d.tokens)} tokens "
                                 "(Tinker: one target per input position)")
            ids[i, :len(d.tokens)] = torch.tensor(d.tokens)
            mask[i, :len(d.tokens)] = 1
            tgt[i, :len(d.tokens)] = torch.from_numpy(t.astype(np.int64))
        with torch.set_grad_enabled(grad):
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tgt.to(self.device).unsqueeze(-1)).squeeze(-1)
        return [lp[i, :len(d.tokens)] for i, d in enumerate(datums)]

    def forward_backward(self, req: FwdBwdRequest) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """Per-datum outputs and the batch's metrics (`loss:sum`); gradients accumulate unless forward_only."""
        import torch

        if not req.data:
            raise ValueError("forward_backward got no data")
        loss_fn = get_loss(req.loss_fn)
        lps = self._logprobs(req.data, grad=not req.forward_only)
        losses = [loss_fn(lp, d.inputs, req.loss_fn_config) for lp, d in zip(lps, req.data)]
        total = torch.stack(losses).sum()
        if not req.forward_only:
            total.backward()
        outs = []
        for lp, d in zip(lps, req.data):
            lpn = lp.detach().float().cpu().numpy()
            out = {"logprobs": lpn}
            if req.loss_fn == "cross_entropy":
                out["elementwise_loss"] = -lpn * np.asarray(d.inputs["weights"], dtype=np.float32).reshape(-1)
            outs.append(out)
        return outs, {"loss:sum": float(total.detach())}

    def optim_step(self, adam: Any) -> dict[str, float]:
        """One Adam step with `adam` (the SDK's AdamParams); the gradients are zeroed after."""
        import torch

        for g in self.optimizer.param_groups:
            g["lr"] = float(adam.learning_rate)
            g["betas"] = (float(adam.beta1), float(adam.beta2))
            g["eps"] = float(adam.eps)
            g["weight_decay"] = float(adam.weight_decay)
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads \
            else 0.0
        if adam.grad_clip_norm and adam.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, float(adam.grad_clip_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm:mean": norm, "step": float(self.steps)}

    # ------------------------------------------------------------------ files

    def trainable_state(self) -> dict[str, Any]:
        return {n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def save_for_sampler(self, out: Path) -> Path:
        """LoRA: a PEFT adapter directory; full weights: an HF model directory (config, tokenizer, safetensors)."""
        out = Path(out)
        if self.spec.is_lora:
            from agentloop.train.lora import save_adapter

            return save_adapter(out, self.trainable_state(), self.spec.lora_config(), base_model=self.spec.model_path)
        from agentloop.models.loading import copy_aux_files
        from agentloop.util.fsio import replace_dir

        tmp = out.with_name(f".{out.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp, safe_serialization=True)
        copy_aux_files(Path(self.spec.model_path), tmp)
        replace_dir(tmp, out)
        return out

    def save_state(self, out: Path) -> Path:
        """The trainable tensors, Adam's state and the spec, in `out/` (state.pt + spec.json)."""
        import torch

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.trainable_state(), "optimizer": self.optimizer.state_dict(), "steps": self.steps},
                   out / "state.pt")
        (out / "spec.json").write_text(self.spec.model_dump_json(indent=1))
        return out

    def load_state(self, src: Path, optimizer: bool) -> None:
        """Load a `save_state` directory's tensors (and Adam's state when `optimizer`)."""
        import torch

        blob = torch.load(Path(src) / "state.pt", map_location="cpu", weights_only=True)
        missing = set(self.trainable_state()) - set(blob["model"])
        if missing:
            raise ValueError(f"checkpoint {src} does not hold {sorted(missing)[:3]}... of this model (LoRA rank or "
                             "layers differ?)")
        self.model.load_state_dict(blob["model"], strict=False)
        if optimizer:
            self.optimizer.load_state_dict(blob["optimizer"])
            self.steps = int(blob.get("steps", 0))


def read_spec(src: Path) -> ModelSpec:
    """The ModelSpec a `save_state` directory was written with."""
    return ModelSpec.model_validate(json.loads((Path(src) / "spec.json").read_text()))
