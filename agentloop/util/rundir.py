"""Run directories: where a run's config, versions, records, summary and server logs live."""

from __future__ import annotations

import json
import platform
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, TextIO

from agentloop.config import Config, dump_config
from agentloop.records import EpisodeRecord


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("agentloop", "sglang", "torch", "transformers", "aiohttp", "pydantic", "uvloop"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def make_run_dir(cfg: Config) -> Path:
    """Create the run directory and save the resolved config and package versions in it. In an existing
    run dir whose config.yaml says something else (a resumed run given overrides), the old one is kept as
    config.prev.yaml."""
    if cfg.run_dir:
        path = Path(cfg.run_dir)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(cfg.runs_dir) / f"{cfg.name}-{stamp}"
        k = 1
        while path.exists():
            k += 1
            path = Path(cfg.runs_dir) / f"{cfg.name}-{stamp}-{k}"
    path.mkdir(parents=True, exist_ok=True)
    text, saved = dump_config(cfg), path / "config.yaml"
    if saved.is_file() and saved.read_text() != text:
        saved.replace(path / "config.prev.yaml")
    saved.write_text(text)
    (path / "versions.json").write_text(json.dumps(package_versions(), indent=2) + "\n")
    return path


class RecordWriter:
    """Appends one JSON line per record and flushes it, so a crash keeps every record made."""

    def __init__(self, path: Path):
        self.path = path
        self._fh: TextIO = path.open("a")
        self.count = 0
        self.failed = False
        """A write failed (and was raised): closing does not raise it again."""

    def __call__(self, rec: EpisodeRecord) -> None:
        line = rec.model_dump_json() + "\n"
        try:
            self._fh.write(line)
            self._fh.flush()
        except OSError as e:  # a full disk, a lost mount: the message must say which file
            self.failed = True
            raise OSError(e.errno, f"cannot write records to {self.path}: {e.strerror or e}") from e
        self.count += 1

    def close(self) -> None:
        try:
            self._fh.close()
        except OSError as e:
            if self.failed:  # the failed write's tail: that failure was raised already
                return
            raise OSError(e.errno, f"cannot write records to {self.path}: {e.strerror or e}") from e

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
