"""Resumable learner checkpoints: model + optimizer (sharded DCP), step, data position, RNG states.

Layout under a checkpoints root (the mailbox learner uses RUN_DIR/checkpoints):

    step-000004/            a complete checkpoint (only complete ones carry this name)
        .metadata, __0_0.distcp ...   torch.distributed.checkpoint files: {"model", "optim"}
        rng-rank0.pt ...              python/numpy/torch(/cuda) RNG states of each rank
        meta.json                     {"step", "data_position", "world_size", "time", "extra"}
    step-000006.tmp/        a save in progress (ignored; removed by the next save)

A save writes everything into `step-N.tmp`, then rank 0 writes meta.json and renames the
directory to `step-N` (one atomic rename), so a kill at any point leaves the previous complete
checkpoint as the latest. Old complete checkpoints beyond `keep` are deleted afterwards.

Every rank must call `save_checkpoint` / `load_checkpoint` (they are collective). The sharded
DCP format loads into any world size.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_NAME = re.compile(r"^step-(\d{6,})$")


@dataclass
class CheckpointMeta:
    path: Path
    step: int
    """Last training step included in the checkpoint."""
    data_position: Any
    """Opaque JSON value describing where the data stream stood after `step`."""
    world_size: int
    extra: dict[str, Any]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / "meta.json").is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    cks = list_checkpoints(root)
    return cks[-1] if cks else None


def read_meta(path: str | Path) -> CheckpointMeta:
    path = Path(path)
    d = json.loads((path / "meta.json").read_text())
    return CheckpointMeta(path=path, step=int(d["step"]), data_position=d.get("data_position"),
                          world_size=int(d.get("world_size", 1)), extra=d.get("extra", {}))


def _rng_state() -> dict[str, Any]:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    data_position: Any = None,
    extra: dict[str, Any] | None = None,
    keep: int | None = None,
) -> Path:
    """Collective: save a complete checkpoint of `step` and return its path (same on every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / (checkpoint_name(step) + ".tmp")
    rank = _rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng-rank{rank}.pt")
    _barrier()
    if rank == 0:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        meta = {"step": step, "data_position": data_position, "world_size": world,
                "time": time.time(), "extra": extra or {}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if final.exists():  # re-saving a step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep is not None:
            for old in list_checkpoints(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> CheckpointMeta:
    """Collective: load model + optimizer (+ this rank's RNG states when the world size matches)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    meta = read_meta(path)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = path / f"rng-rank{_rank()}.pt"
    if rng.is_file():
        # Our own file, holding numpy/python RNG tuples that weights_only cannot represent.
        _set_rng_state(torch.load(rng, weights_only=False))
    return meta


__all__ = [
    "CheckpointMeta",
    "checkpoint_name",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_meta",
    "save_checkpoint",
]
