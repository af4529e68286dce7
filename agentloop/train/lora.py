"""LoRA for the learner and the servers: our own small adapter layers, their PEFT-format files, the merge.

A LoRA-wrapped projection keeps its base weight (frozen) and adds a low-rank update:
    y = x W^T (+ b) + scale * (dropout(x) A^T) B^T,   A: [rank, in], B: [out, rank], scale = alpha / rank
B starts at zero, so a fresh adapter's model is the base model exactly (tests/unit/test_lora.py).

The wrapped module stays an `nn.Linear` (its class is swapped for `LoraLinear`, a subclass), so the base weights
keep their HF names (`...q_proj.weight`) and two child linears add `...q_proj.lora_A.weight` and
`...q_proj.lora_B.weight`: PEFT's names without the `base_model.model.` prefix and the adapter name. SGLang's
LoRA serving (--enable-lora, /load_lora_adapter) reads the PEFT directory `save_adapter` writes; its scale is
lora_alpha / r, as here (no rsLoRA).

Map:
    LoraLinear            the wrapped projection (forward above; dropout only in a pass that builds a graph)
    inject_lora           swap the target projections of a model (on any device, the meta one included)
    lora_targets          which modules a config wraps (names), refusing a config that wraps nothing
    init_lora_state       the initial adapter tensors (A: PEFT's Kaiming-uniform from a seed, B: zero)
    is_lora_key, base_key what a state-dict key is
    adapter_state         the adapter's tensors of a full state dict, under PEFT's names
    save_adapter          a PEFT adapter directory (adapter_config.json + adapter_model.safetensors), atomically
    merge_state           base weights + scale * B A, the adapter keys dropped (an HF state dict)
    merge_adapter_dir     the same offline: a base HF directory + an adapter directory -> a merged HF directory
    server_args           the SGLang flags a LoRA run's servers need
    adapter_name          the served name of adapter version v (what /generate's lora_path names)
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from agentloop.util.fsio import replace_dir

PEFT_PREFIX = "base_model.model."
"""PEFT's prefix of every adapter key (the base model's names follow)."""
ADAPTER_PREFIX = "agentloop-v"
"""Served adapter names: agentloop-v<version>."""


def adapter_name(version: int) -> str:
    """The name adapter version `version` is loaded under on the servers (`lora_path` of /generate)."""
    return f"{ADAPTER_PREFIX}{int(version)}"


def adapter_name_taken(message: Any) -> bool:
    """Whether SGLang refused an adapter load because its name is taken (its scheduler: "... because it is already
    loaded"; its registry: "LoRA with name ... already exists"): an older load of the same version, a resumed run's
    or an earlier run's on the same servers, which the caller unloads before loading again."""
    text = str(message)
    return "already loaded" in text or "already exists" in text


def is_lora_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def base_key(lora_key: str) -> str:
    """`...q_proj.lora_A.weight` -> `...q_proj.weight` (the projection the adapter key belongs to)."""
    mod = lora_key.split(".lora_A.")[0] if ".lora_A." in lora_key else lora_key.split(".lora_B.")[0]
    return mod + ".weight"


def _linear_cls():
    import torch

    class LoraLinear(torch.nn.Linear):
        """An nn.Linear with a LoRA branch (module doc). Built by `inject_lora`, never directly."""

        lora_scale: float
        lora_dropout: float

        def forward(self, x):
            y = torch.nn.functional.linear(x, self.weight, self.bias)
            h = x
            if self.lora_dropout > 0 and self.training and torch.is_grad_enabled():
                h = torch.nn.functional.dropout(h, p=self.lora_dropout)
            return y + self.lora_B(self.lora_A(h)) * self.lora_scale

    return LoraLinear


_LORA_LINEAR: Any = None


def lora_linear_cls():
    """The LoraLinear class (built on first use, so importing this module needs no torch)."""
    global _LORA_LINEAR
    if _LORA_LINEAR is None:
        _LORA_LINEAR = _linear_cls()
    return _LORA_LINEAR


def lora_targets(model: Any, target_modules: Iterable[str]) -> list[str]:
    """Names of the nn.Linear modules whose last name part is in `target_modules`; ValueError when none is."""
    import torch

    wanted = set(target_modules)
    names = [n for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in wanted and n != "lm_head"]
    if not names:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"learner.lora.target_modules={sorted(wanted)} matches no linear layer of "
                         f"{type(model).__name__}; its linear layers are named {linears}")
    found = {n.rsplit(".", 1)[-1] for n in names}
    missing = wanted - found
    if missing:
        raise ValueError(f"learner.lora.target_modules names {sorted(missing)}, which {type(model).__name__} "
                         f"does not have (it has {sorted(found)} among the wanted ones)")
    return names


def inject_lora(model: Any, cfg: Any) -> list[str]:
    """Wrap the target projections of `model` with LoRA branches of `cfg` (a LoraConfig); every other parameter is
    frozen (requires_grad False), the adapters trainable. The adapters are created on the device of their base
    weight (the meta device included: a state-dict load fills them). Returns the wrapped modules' names."""
    import torch

    cls = lora_linear_cls()
    names = lora_targets(model, cfg.target_modules)
    model.requires_grad_(False)
    mods = dict(model.named_modules())
    for n in names:
        lin = mods[n]
        dev, dt = lin.weight.device, lin.weight.dtype
        lin.__class__ = cls
        lin.lora_A = torch.nn.Linear(lin.in_features, cfg.rank, bias=False, device=dev, dtype=dt)
        lin.lora_B = torch.nn.Linear(cfg.rank, lin.out_features, bias=False, device=dev, dtype=dt)
        lin.lora_scale = float(cfg.alpha) / cfg.rank
        lin.lora_dropout = float(cfg.dropout)
        if dev.type != "meta":
            init = init_lora_state(lin.in_features, lin.out_features, cfg.rank, seed=0)
            with torch.no_grad():
                lin.lora_A.weight.copy_(init[0])
                lin.lora_B.weight.zero_()
    return names


def init_lora_state(in_features: int, out_features: int, rank: int, *, seed: int) -> tuple[Any, Any]:
    """(A, B) float32 initial tensors: A as PEFT's default (Kaiming-uniform, a = sqrt(5)), B zero."""
    import torch

    g = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on [rank, in]: gain*sqrt(3/fan_in)
    a = (torch.rand(rank, in_features, generator=g) * 2 - 1) * bound
    return a, torch.zeros(out_features, rank)


def initial_adapter(state: Mapping[str, Any], names: Iterable[str], rank: int, seed: int) -> dict[str, Any]:
    """The initial adapter tensors of the wrapped modules `names` (full, float32), given the base state dict
    (for the shapes): module i's A is seeded with seed + i, so every rank and every run starts alike."""
    out = {}
    for i, n in enumerate(sorted(names)):
        w = state[n + ".weight"]
        a, b = init_lora_state(int(w.shape[1]), int(w.shape[0]), rank, seed=seed + i)
        out[n + ".lora_A.weight"] = a
        out[n + ".lora_B.weight"] = b
    return out


def adapter_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The adapter tensors of a full model state dict, under PEFT's names."""
    return {PEFT_PREFIX + k: v for k, v in state.items() if is_lora_key(k)}


def adapter_config(cfg: Any, base_model: str | None) -> dict[str, Any]:
    """adapter_config.json of a LoraConfig: what PEFT and SGLang read."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
            "lora_dropout": cfg.dropout, "target_modules": sorted(cfg.target_modules), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
            "base_model_name_or_path": base_model}


def _own(t: Any) -> Any:
    """`t`, copied only when it is a view into a larger storage (safetensors refuses tensors sharing memory). A
    copy of every tensor was most of a rank-32 0.5B adapter's save: 1008 clones took 3.0 s of 4.3 s for three
    saves on the CPU, and the save took 1.8 s of a 1.8 s push on an H200 (GPU acceptance, call 11)."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def save_adapter(path: str | Path, state: Mapping[str, Any], cfg: Any, *, dtype: Any = None,
                 base_model: str | None = None) -> Path:
    """Write the PEFT adapter of a full state dict (or one holding only the adapter keys, our names) to `path`:
    adapter_config.json and adapter_model.safetensors, in a temp dir renamed into place (a server never reads a
    partial adapter). `dtype`: the tensors' dtype on disk (default: as given)."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {k: _own((v if dtype is None else v.to(dtype)).detach().contiguous())
               for k, v in adapter_state(state).items()}
    if not tensors:
        raise ValueError("save_adapter: the state dict holds no LoRA tensors (lora_A / lora_B keys)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config(cfg, base_model), indent=1))
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def merge_state(state: Mapping[str, Any], scale: float, dtype: Any = None) -> dict[str, Any]:
    """An HF state dict of the merged model: each wrapped weight W becomes W + scale * B A (computed in float32,
    cast back to W's dtype, or to `dtype` when given), the adapter keys dropped.

    In a 16-bit dtype the merged weights are rounded: the merged model is then not exactly the policy the servers
    sample with the adapter (they add the unmerged branch); on the untrained tiny model (bf16 weights) its
    logprobs moved by up to 2.7e-3, where a float32 merge matches the servers within 1e-6
    (tests/integration/test_lora_real.py)."""
    import torch

    out = {k: v for k, v in state.items() if not is_lora_key(k)}
    for k in state:
        if ".lora_A." not in k:
            continue
        bk = base_key(k)
        a = state[k].float()
        b = state[k.replace(".lora_A.", ".lora_B.")].float()
        w = out[bk]
        out[bk] = (w.float() + scale * (b @ a)).to(dtype or w.dtype) if isinstance(w, torch.Tensor) else w
    return out


def read_adapter(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(adapter_config.json, tensors under our names: the PEFT prefix and any `.default` adapter name dropped)."""
    from safetensors.torch import load_file

    path = Path(path)
    conf = json.loads((path / "adapter_config.json").read_text())
    raw = load_file(str(path / "adapter_model.safetensors"))
    out = {}
    for k, v in raw.items():
        k = k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k
        out[k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")] = v
    return conf, out


def merge_adapter_dir(base: str | Path, adapter: str | Path, out: str | Path, *, dtype: Any = None) -> Path:
    """Offline export: the HF directory `base` with the PEFT adapter directory `adapter` merged in, written to
    `out` (every file of `base` copied, its safetensors rewritten with the merged weights). `dtype` (a torch
    dtype): the merged weights' dtype (default: each base weight's own); a 16-bit base merged in its own dtype is
    rounded (merge_state), torch.float32 keeps the adapter's policy exactly (config.json then says float32)."""
    from safetensors.torch import load_file, save_file

    base, out = Path(base), Path(out)
    conf, lora = read_adapter(adapter)
    if conf.get("use_rslora") or conf.get("use_dora"):
        raise ValueError(f"{adapter}: rsLoRA / DoRA adapters are not merged here (use_rslora / use_dora set)")
    scale = float(conf["lora_alpha"]) / int(conf["r"])
    files = sorted(base.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{base} holds no *.safetensors weights to merge into")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        todo = {base_key(k) for k in lora if ".lora_A." in k}
        for f in base.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy2(f, tmp / f.name)
        for f in files:
            sd = load_file(str(f))
            part = {k: v for k, v in lora.items() if base_key(k) in sd}
            merged = merge_state({**sd, **part}, scale, dtype)
            if dtype is not None:
                merged = {k: v.to(dtype) for k, v in merged.items()}
            todo -= {base_key(k) for k in part}
            save_file(merged, str(tmp / f.name), metadata={"format": "pt"})
        if todo:
            raise ValueError(f"{adapter} adapts {sorted(todo)[:3]}..., which {base} has no weight for")
        if dtype is not None and (tmp / "config.json").is_file():
            hf = json.loads((tmp / "config.json").read_text())
            name = str(dtype).removeprefix("torch.")
            hf.update({k: name for k in ("dtype", "torch_dtype") if k in hf} or {"dtype": name})
            (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def server_args(cfg: Any, device: str) -> list[str]:
    """SGLang flags for servers that serve this run's adapters (LoraConfig `cfg`): LoRA on, the rank and the
    target modules of our adapters; on CPU the torch-native LoRA kernels (the default ones are Triton's)."""
    args = ["--enable-lora", "--max-lora-rank", str(cfg.rank), "--lora-target-modules", *sorted(cfg.target_modules)]
    if device == "cpu":
        args += ["--lora-backend", "torch_native"]
    return args


__all__ = ["ADAPTER_PREFIX", "PEFT_PREFIX", "adapter_config", "adapter_name", "adapter_name_taken",
           "adapter_state", "base_key",
           "init_lora_state", "initial_adapter", "inject_lora", "is_lora_key", "lora_linear_cls", "lora_targets",
           "merge_adapter_dir", "merge_state", "read_adapter", "save_adapter", "server_args"]
