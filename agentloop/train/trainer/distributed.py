"""The learner's process group: which device, joining torchrun's group (or making a one-rank one), and the one
object broadcast rank 0 uses to tell the other ranks what it heard (the serve loop's messages, the facts of a
final save).

Map:
    resolve_device     learner.device after auto (cuda when there is one)
    init_distributed   join torchrun's process group, or make a single-rank one
    broadcast          rank 0's object on every rank
"""

from __future__ import annotations

import os
from typing import Any

from agentloop.train.config import LearnerConfig


def resolve_device(cfg: LearnerConfig) -> str:
    import torch

    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def init_distributed(cfg: LearnerConfig, device: str) -> bool:
    """Join torchrun's group (env RANK/WORLD_SIZE) or create a one-rank group on an in-memory store.

    Returns True when this call created the group (so `Learner.close` destroys it); an already
    initialised group is reused as is.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
    kw: dict[str, Any] = {}
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        kw["device_id"] = torch.device("cuda", local)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, **kw)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
    return True


def broadcast(obj: Any, device) -> Any:
    """Rank 0's `obj` on every rank (pickled through torch.distributed; as is with one rank)."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


__all__ = ["broadcast", "init_distributed", "resolve_device"]
