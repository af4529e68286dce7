"""Atomic file writes: a reader sees the old content or the new one, never a torn file (temp + fsync + rename);
`replace_dir` does the same for a directory built beside its place."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (same directory temp file, fsync, rename)."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically (same directory temp file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    """`obj` as indented JSON, written atomically."""
    atomic_write_text(path, json.dumps(obj, indent=1, default=str))


def replace_dir(tmp: Path, path: Path) -> None:
    """Put the finished directory `tmp` (built in `path`'s parent) at `path`: an existing `path` is moved aside
    first and removed after, so a reader (a server loading weights) never sees a half-written directory."""
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, path)
