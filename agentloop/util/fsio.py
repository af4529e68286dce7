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
    """Put the finished directory `tmp` (built in `path`'s parent) at `path`, so that a reader (a server loading
    weights, a run comparing them) finds `path` at every moment, old or new, never half-written and never missing.
    An existing `path` is swapped with `tmp` in one step (Linux's renameat2 RENAME_EXCHANGE) and the old one, now at
    `tmp`, removed after; where the kernel or filesystem cannot swap, it is moved aside first (a moment without
    `path`: a learner retraining a step after a resume replaces a directory a server may still serve)."""
    if path.exists() and _exchange(tmp, path):
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (renameat2 with RENAME_EXCHANGE); False where that is not available."""
    import ctypes
    import sys

    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # glibc < 2.28
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0
