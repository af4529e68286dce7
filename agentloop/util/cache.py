"""Build-once directories shared by processes: the model cache's one locking recipe."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import sys
import tempfile
from hashlib import sha256
from pathlib import Path
from types import ModuleType
from typing import Callable


def build_once(target: Path, build: Callable[[Path], None], *, marker: str = "config.json") -> Path:
    """Return `target`, first running `build(tmp_dir)` if `target/marker` is missing.

    Safe across processes: an fcntl lock serialises builders, the build happens in a temp dir
    next to the target and is renamed into place, so a reader sees either nothing or a complete
    directory; a failed build leaves nothing behind.
    """
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if (target / marker).is_file():
                return target
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
            try:
                build(tmp)
                for f in tmp.iterdir():
                    f.chmod(0o644)
                tmp.chmod(0o755)  # mkdtemp makes it 0700
                if target.exists():  # a broken leftover (no marker): replace it
                    shutil.rmtree(target)
                os.rename(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return target


def import_python_file(path: Path, prefix: str) -> ModuleType:
    """Import a .py file once per absolute path (as `<prefix>_<stem>_<hash>`); its exceptions propagate."""
    resolved = path.resolve()
    name = f"{prefix}_{path.stem}_{sha256(str(resolved).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    return exec_module_file(name, resolved)


def exec_module_file(name: str, path: Path | str) -> ModuleType:
    """Execute the .py file at `path` as module `name` (in sys.modules while it runs, as an import is, and
    taken out again when it raises)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{str(path)!r} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
