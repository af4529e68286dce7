"""Atomic file writes: a reader sees the old content or the new one, never a torn file (temp + fsync + rename)."""

from __future__ import annotations

import json
import os
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
