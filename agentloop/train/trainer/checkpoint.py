"""Resumable learner checkpoints: model + optimizer (sharded DCP), step, data position, RNG states;
written synchronously or in the background, always atomically.

Layout under a checkpoints root (the mailbox learner uses RUN_DIR/checkpoints):

    step-000004/            a complete checkpoint (only complete ones carry this name)
        .metadata, __0_0.distcp ...   torch.distributed.checkpoint files: {"model", "optim"}
        rng-rank0.pt ...              python/numpy/torch(/cuda) RNG states of each rank
        meta.json                     {"step", "data_position", "world_size", "time", "extra"}
    step-000006.tmp/        a save in progress (ignored; removed by the next save)
    step-000004.prev/       a complete checkpoint being replaced by a new save of the same step: it
                            counts as step 4 while no step-000004/ exists (a kill between the renames)

A save writes everything into `step-N.tmp`, then rank 0 writes meta.json and renames the
directory to `step-N` (one atomic rename), so a kill at any point leaves the previous complete
checkpoint as the latest. Re-saving an existing step renames the old one to `step-N.prev` first and
deletes it only after the new one is in place. Old complete checkpoints beyond `keep` are deleted
afterwards.

Background saves (`CheckpointWriter`, learner.checkpoint_background): DCP's async_save copies the state to
host memory (pinned, on a side stream, on CUDA) and writes the files from a thread; training goes on
and only the next optimizer step waits for the copy (`wait_staged`). Its collectives run on a gloo
group of their own, never on the training group. Rank 0 finalizes (meta.json + rename) once the write
is complete (`poll`), which is also when all ranks' files are on disk (DCP gathers every rank's result
before its metadata). One save is in flight at a time.

Every rank must call `save_checkpoint` / `load_checkpoint` / `CheckpointWriter.save` (they are
collective). The sharded DCP format loads into any world size.
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
from typing import Any, Callable

import torch
import torch.distributed as dist

_NAME = re.compile(r"^step-(\d{6,})(\.prev)?$")


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


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under root, oldest first (a `.prev` one only where its step has no other)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / "meta.json").is_file():
            step = int(m.group(1))
            if m.group(2) is None or step not in found:
                found[step] = p
    return [found[s] for s in sorted(found)]


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


_between_renames: Callable[[], None] | None = None
"""Test hook: called between the two renames of a re-save (to kill the process there)."""


def _publish(root: Path, tmp: Path, final: Path, meta: dict[str, Any], keep: int | None) -> None:
    """Rank 0: meta.json into tmp, then tmp -> final atomically; an existing final is kept as .prev until
    the new one is in place."""
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    prev = final.with_name(final.name + ".prev")
    if final.exists():  # re-saving a step (e.g. after a resume)
        shutil.rmtree(prev, ignore_errors=True)
        os.replace(final, prev)
        if _between_renames is not None:
            _between_renames()
    os.replace(tmp, final)
    shutil.rmtree(prev, ignore_errors=True)
    if keep is not None:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def _prepare(root: Path, step: int) -> tuple[Path, Path]:
    """Collective: a fresh step-N.tmp (stale .tmp dirs removed) and each rank's RNG file in it."""
    final = root / checkpoint_name(step)
    tmp = root / (checkpoint_name(step) + ".tmp")
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    torch.save(_rng_state(), tmp / f"rng-rank{_rank()}.pt")
    return tmp, final


def _meta(step: int, data_position: Any, extra: dict[str, Any] | None) -> dict[str, Any]:
    return {"step": step, "data_position": data_position, "world_size": _world(), "time": time.time(),
            "extra": extra or {}}


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
    tmp, final = _prepare(root, step)
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
    _barrier()
    if _rank() == 0:
        _publish(root, tmp, final, _meta(step, data_position, extra), keep)
    _barrier()
    return final


@dataclass
class _Pending:
    step: int
    tmp: Path
    final: Path
    meta: dict[str, Any]
    staged: Any
    """Future: the host copy of the state is complete (None when async_save staged synchronously)."""
    written: Any
    """Future: every rank's files and the metadata are written."""
    started: float
    stager: Any = None
    """This save's stager (CheckpointWriter._new_stager), closed once the files are written."""


class CheckpointWriter:
    """Checkpoints written in the background, one at a time (module doc). Collective calls: `save`;
    `wait_staged`, `poll` and `wait` are local and may run on any rank at any time."""

    def __init__(self, root: str | Path, *, keep: int | None, device_type: str):
        self.root = Path(root)
        self.keep = keep
        self.cuda = device_type == "cuda"
        self.pending: _Pending | None = None
        self.last_written_s: float | None = None
        """Seconds from `save` to the files being complete, for the last finalized checkpoint."""
        self._group = None
        if dist.is_available() and dist.is_initialized():
            # async_save's collectives run in its writer thread: they need a CPU backend and a group of their
            # own (never the one the training collectives use from the main thread at the same time).
            self._group = dist.new_group(backend="gloo")

    def _new_stager(self) -> Any:
        """A stager for one save (None on a torch without one: async_save's own synchronous staging).

        One per save, closed when its files are written: torch 2.11's DefaultStager clears its copy
        table when a staging ends, so a second save through the same stager failed (KeyError: <class
        'type'>, on the GPU at the second checkpoint of a run)."""
        try:
            from torch.distributed.checkpoint.staging import (
                DefaultStager,
                StagingOptions,
            )

            return DefaultStager(StagingOptions(use_pinned_memory=self.cuda, use_shared_memory=False,
                                                use_async_staging=self.cuda, use_non_blocking_copy=self.cuda))
        except (ImportError, TypeError):
            return None

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, data_position: Any = None,
             extra: dict[str, Any] | None = None) -> Path:
        """Collective: start the checkpoint of `step` (after the previous one is complete) and return
        its final path (which exists once `poll` or `wait` has finalized it)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.wait()
        tmp, final = _prepare(self.root, step)
        msd, osd = get_state_dict(model, optimizer)
        kw: dict[str, Any] = {"checkpoint_id": str(tmp), "process_group": self._group}
        stager = self._new_stager()
        if stager is not None:
            kw["async_stager"] = stager
        try:
            resp = dcp.async_save({"model": msd, "optim": osd}, **kw)
        except BaseException:
            if stager is not None:
                stager.close()
            raise
        staged, written = (resp.staging_completion, resp.upload_completion) if hasattr(resp, "upload_completion") \
            else (None, resp)
        self.pending = _Pending(step, tmp, final, _meta(step, data_position, extra), staged, written,
                                time.perf_counter(), stager)
        return final

    def wait_staged(self) -> None:
        """Block until the pending save has copied the state (call before changing weights or optimizer)."""
        p = self.pending
        if p is not None and p.staged is not None:
            p.staged.result()
            p.staged = None

    def poll(self) -> Path | None:
        """Finalize the pending save if its files are written; returns the path of a checkpoint finalized now."""
        p = self.pending
        if p is None or not p.written.done():
            return None
        return self._finish()

    def wait(self) -> Path | None:
        """Block until the pending save is written, then finalize it."""
        if self.pending is None:
            return None
        self.wait_staged()
        self.pending.written.result()
        return self._finish()

    def _finish(self) -> Path:
        p = self.pending
        assert p is not None
        self.pending = None
        try:
            p.written.result()  # raises the writer's exception, if any
        finally:
            if p.stager is not None:
                p.stager.close()  # its host buffers go with it
        if _rank() == 0:
            if _before_publish is not None:
                _before_publish()
            _publish(self.root, p.tmp, p.final, p.meta, self.keep)
        self.last_written_s = time.perf_counter() - p.started
        return p.final

    def close(self) -> None:
        """Finish the pending save (its stager's host buffers are released with it)."""
        self.wait()


_before_publish: Callable[[], None] | None = None
"""Test hook: called on rank 0 when a background save's files are written, before meta.json and the rename."""


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
    "CheckpointWriter",
    "checkpoint_name",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_meta",
    "save_checkpoint",
]
