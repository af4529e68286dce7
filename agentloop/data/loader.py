"""Read verl-format rows from JSONL or Parquet and turn them into `Sample`s.

Map:
    to_plain          numpy arrays/scalars, pyarrow scalars, tuples -> plain Python (recursive)
    parse_row         one row (a dict) -> Sample, or DataError naming where the row came from
    rows_to_samples   many rows (from any source, e.g. a pandas DataFrame) -> list[Sample]
    read_jsonl_rows / read_parquet_rows   (location, row) pairs from a file, lazily
    load_file         a file -> list[Sample]
    load_samples      DataConfig -> list[Sample] (a file, or a built-in set from data.builtin)
    load_train_data   DataConfig -> TrainData: training rows and validation rows (a file, a built-in set,
                      or a slice held out of the training rows), the data section resolved
    sample_to_row / write_jsonl   the reverse: Samples or rows -> a verl JSONL file

A verl row is

    {"data_source": str,
     "prompt": [{"role": ..., "content": ...}, ...],
     "ability": str,                                 (optional)
     "reward_model": {"style": "rule", "ground_truth": ...},   (optional: ground truth None)
     "extra_info": {..., "tools_kwargs": {...}, "index": ...},  (optional)
     "tools_kwargs": {...}}                          (optional; wins over extra_info's)

Other top-level columns are ignored. `Sample.index` is the row's position in the file
(0-based, blank JSONL lines not counted), not `extra_info["index"]`, which is kept as is.

Simplifications, on purpose:
  * Parquet struct columns share one schema across rows, so a key missing from one row
    comes back as None. Hence None-valued keys of a message other than role/content are
    dropped (a chat template must not see `tool_calls: None`), and None-valued entries of
    `tools_kwargs` (a tool this row does not configure) are dropped too.
  * Parquet map columns come back as lists of (key, value) pairs; they are not turned into
    dicts (verl data sets use structs).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentloop.config import DataConfig
from agentloop.errors import DataError
from agentloop.records import Sample

ROLES = frozenset({"system", "user", "assistant", "tool"})
"""Roles a prompt message may have."""

JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet", ".pq")

_PARQUET_BATCH_ROWS = 1024


def to_plain(value: Any) -> Any:
    """`value` with numpy arrays/scalars, pyarrow scalars and tuples turned into plain Python."""
    if value is None or type(value) in (str, bool, int, float):
        return value
    if isinstance(value, str):  # numpy.str_
        return str(value)
    if isinstance(value, Mapping):
        return {to_plain(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    as_py = getattr(value, "as_py", None)  # pyarrow scalars, struct scalars, list scalars
    if callable(as_py):
        return to_plain(as_py())
    tolist = getattr(value, "tolist", None)  # numpy arrays and numpy scalars
    if callable(tolist):
        return to_plain(tolist())
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value


def _check_messages(prompt: Any, key: str) -> list[dict[str, Any]]:
    """The prompt as a list of clean message dicts, or ValueError saying what is wrong."""
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{key!r} must be a non-empty list of {{role, content}} dicts, got {_short(prompt)}")
    messages = []
    for i, msg in enumerate(prompt):
        if not isinstance(msg, dict):
            raise ValueError(f"{key}[{i}] must be a {{role, content}} dict, got {_short(msg)}")
        if "role" not in msg or "content" not in msg:
            missing = [k for k in ("role", "content") if k not in msg]
            raise ValueError(f"{key}[{i}] lacks {' and '.join(missing)} (keys: {sorted(map(str, msg))})")
        role = msg["role"]
        if role not in ROLES:
            raise ValueError(f"{key}[{i}] has bad role {role!r}; expected one of {sorted(ROLES)}")
        content = msg["content"]
        if not isinstance(content, (str, list)):
            raise ValueError(f"{key}[{i}] content must be a string (or a list of parts), got {_short(content)}")
        clean = {k: v for k, v in msg.items() if v is not None or k in ("role", "content")}
        messages.append(clean)
    return messages


def _check_tools_kwargs(value: Any, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{key!r} must be a dict keyed by tool name, got {_short(value)}")
    out = {}
    for name, kwargs in value.items():
        if kwargs is None:
            continue
        if not isinstance(name, str) or not isinstance(kwargs, dict):
            raise ValueError(f"{key}[{name!r}] must be a dict of kwargs for tool {name!r}, got {_short(kwargs)}")
        out[name] = kwargs
    return out


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(value).__name__} {text}"


def parse_row(row: Any, index: int, *, where: str, prompt_key: str = "prompt") -> Sample:
    """One verl row -> Sample with `index`; DataError starting with `where` if it is malformed."""
    try:
        return _parse_row(to_plain(row), index, prompt_key)
    except ValueError as e:
        raise DataError(f"{where}: {e}") from None


def _parse_row(row: Any, index: int, prompt_key: str) -> Sample:
    if not isinstance(row, dict):
        raise ValueError(f"row must be a JSON object, got {_short(row)}")
    data_source = row.get("data_source")
    if "data_source" not in row:
        raise ValueError("missing 'data_source'")
    if not isinstance(data_source, str) or not data_source:
        raise ValueError(f"'data_source' must be a non-empty string, got {_short(data_source)}")
    if prompt_key not in row:
        raise ValueError(f"missing {prompt_key!r} (the chat messages)")
    messages = _check_messages(row[prompt_key], prompt_key)

    ground_truth = None
    reward_model = row.get("reward_model")
    if reward_model is not None:
        if not isinstance(reward_model, dict):
            raise ValueError(f"'reward_model' must be a dict with 'ground_truth', got {_short(reward_model)}")
        ground_truth = reward_model.get("ground_truth")
    if isinstance(ground_truth, float) and not math.isfinite(ground_truth):
        raise ValueError(f"'reward_model.ground_truth' is {ground_truth!r}")

    extra_info = row.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, dict):
        raise ValueError(f"'extra_info' must be a dict, got {_short(extra_info)}")

    if row.get("tools_kwargs") is not None:
        tools_kwargs = _check_tools_kwargs(row["tools_kwargs"], "tools_kwargs")
    else:
        tools_kwargs = _check_tools_kwargs(extra_info.get("tools_kwargs"), "extra_info.tools_kwargs")

    ability = row.get("ability")
    if ability is not None and not isinstance(ability, str):
        raise ValueError(f"'ability' must be a string, got {_short(ability)}")

    return Sample(
        index=index,
        data_source=data_source,
        messages=messages,
        ground_truth=ground_truth,
        extra_info=extra_info,
        tools_kwargs=tools_kwargs,
        ability=ability,
    )


def rows_to_samples(
    rows: Iterable[Any], *, source: str = "<rows>", prompt_key: str = "prompt", max_samples: int | None = None
) -> list[Sample]:
    """Rows already in memory -> Samples; errors read `<source> row <i>` (0-based)."""
    samples: list[Sample] = []
    for i, row in enumerate(rows):
        if max_samples is not None and i >= max_samples:
            break
        samples.append(parse_row(row, i, where=f"{source} row {i}", prompt_key=prompt_key))
    if not samples:
        raise DataError(f"{source}: no rows")
    return samples


# ---------------------------------------------------------------- files


def read_jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(`file:line`, row) for each non-blank line; bad UTF-8 or JSON raises DataError at its line."""
    try:
        fh = path.open("rb")
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e.strerror})") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # tolerate a BOM
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            yield f"{path}:{lineno}", row


def read_parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(`file row i`, row) for each Parquet row (i 0-based), read in batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    i = 0
    with pf:
        try:
            for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
                for row in batch.to_pylist():
                    yield f"{path} row {i}", row
                    i += 1
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"{path} row {i}: Parquet read failed ({e})") from None


def load_file(path: str | Path, *, prompt_key: str = "prompt", max_samples: int | None = None) -> list[Sample]:
    """All rows (or the first `max_samples`) of a .jsonl or .parquet file as Samples."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        reader = read_jsonl_rows
    elif suffix in PARQUET_SUFFIXES:
        reader = read_parquet_rows
    else:
        raise DataError(
            f"{p}: unknown data file extension {p.suffix!r}; expected one of {list(JSONL_SUFFIXES + PARQUET_SUFFIXES)}"
        )
    if not p.is_file():
        raise DataError(f"{p}: data file does not exist")
    samples: list[Sample] = []
    for where, row in reader(p):
        if max_samples is not None and len(samples) >= max_samples:
            break
        samples.append(parse_row(row, len(samples), where=where, prompt_key=prompt_key))
    if not samples:
        raise DataError(f"{p}: empty data file (no rows)")
    return samples


def load_samples(cfg: DataConfig) -> list[Sample]:
    """The run's Samples: `cfg.path` if set, else the built-in set `cfg.builtin`; first `max_samples`.

    `prompt_key` applies to files only; built-in sets always use "prompt".
    """
    if cfg.path is not None:
        return load_file(cfg.path, prompt_key=cfg.prompt_key, max_samples=cfg.max_samples)
    from agentloop.data.builtin import builtin_rows

    return rows_to_samples(builtin_rows(cfg.builtin), source=f"builtin:{cfg.builtin}", max_samples=cfg.max_samples)


AUTO_HOLDOUT_MAX = 32
"""`data.val_holdout` None holds out min(AUTO_HOLDOUT_MAX, rows // 10) training rows for validation."""


@dataclass(frozen=True)
class TrainData:
    """What `agentloop train` trains and validates on (`load_train_data`)."""

    train: list[Sample]
    """The training rows (held-out rows removed)."""
    val: list[Sample]
    """The validation rows (empty: no validation)."""
    config: DataConfig
    """The data section as resolved: `val_holdout` the number held out, `val_builtin` None unless used."""
    train_source: str
    """Where the training rows come from (a file, or `built-in set NAME`)."""
    val_source: str
    """What validation runs on, in words (for the progress output)."""


def holdout_indices(n_rows: int, n_holdout: int) -> list[int]:
    """The positions held out of `n_rows` rows: `n_holdout` of them spread evenly, floor(i * n_rows / n_holdout)."""
    return [i * n_rows // n_holdout for i in range(n_holdout)]


def load_train_data(cfg: DataConfig, *, validate: bool = True) -> TrainData:
    """The training and validation rows of `agentloop train` from the data section.

    Training: `path` (else the built-in set `builtin`), its first `max_samples` rows, read with `prompt_key`.
    Validation (when `validate`, i.e. train.val_every > 0): `val_path` (first `val_max_samples` rows); else,
    for a built-in training set only, the built-in set `val_builtin`; else `val_holdout` training rows held
    out (None: min(32, rows // 10)) and not trained on; 0 held out: no validation. A data file is never
    validated on a built-in set. Without validation nothing is held out unless `val_holdout` says a number
    (a resumed run's resolved one: its training rows stay the same)."""
    rows = load_samples(cfg)
    train_source = cfg.path if cfg.path is not None else f"built-in set {cfg.builtin}"
    val_builtin = cfg.val_builtin if cfg.path is None and cfg.val_path is None else None
    holdout, val, held = 0, [], []
    if cfg.val_path is None and val_builtin is None:
        auto = min(AUTO_HOLDOUT_MAX, len(rows) // 10) if validate else 0
        holdout = cfg.val_holdout if cfg.val_holdout is not None else auto
        if holdout >= len(rows):
            raise DataError(f"data.val_holdout={holdout} holds out every one of the {len(rows)} training rows of "
                            f"{train_source}; hold out fewer, or give a validation file (--val-data)")
        out = set(holdout_indices(len(rows), holdout)) if holdout else set()
        held = [s for i, s in enumerate(rows) if i in out]
        rows = [s for i, s in enumerate(rows) if i not in out]
    if not validate:
        val_source = "none (train.val_every=0)" + (
            f"; {holdout} rows held out of {train_source} (data.val_holdout={holdout}) are not trained on"
            if holdout else "")
    elif cfg.val_path is not None:
        val = load_file(cfg.val_path, prompt_key=cfg.prompt_key, max_samples=cfg.val_max_samples)
        val_source = f"{len(val)} rows of {cfg.val_path}"
    elif val_builtin is not None:
        from agentloop.data.builtin import builtin_rows

        val = rows_to_samples(builtin_rows(val_builtin), source=f"builtin:{val_builtin}",
                              max_samples=cfg.val_max_samples)
        val_source = f"{len(val)} rows of the built-in set {val_builtin}"
    elif holdout:
        val = held
        val_source = f"{holdout} rows held out of {train_source} (data.val_holdout={holdout}), not trained on"
    else:
        val_source = ("none (data.val_holdout=0 and no validation file)" if cfg.val_holdout is not None else
                      f"none (no validation file, and {len(rows)} rows are too few for the automatic held-out "
                      "slice: data.val_holdout=0)")
    resolved = cfg.model_copy(update={"val_holdout": holdout, "val_builtin": val_builtin})
    return TrainData(train=rows, val=val, config=resolved, train_source=train_source, val_source=val_source)


# ---------------------------------------------------------------- writing


def sample_to_row(sample: Sample) -> dict[str, Any]:
    """A Sample as a verl row (tools_kwargs written top-level when non-empty)."""
    row: dict[str, Any] = {
        "data_source": sample.data_source,
        "prompt": sample.messages,
        "ability": sample.ability,
        "reward_model": {"style": "rule", "ground_truth": sample.ground_truth},
        "extra_info": sample.extra_info,
    }
    if sample.tools_kwargs:
        row["tools_kwargs"] = sample.tools_kwargs
    return row


def write_jsonl(samples_or_rows: Iterable[Sample | Mapping[str, Any]], path: str | Path) -> Path:
    """Write Samples or verl rows as verl JSONL (rows are validated first); returns the path."""
    p = Path(path)
    lines = []
    for i, item in enumerate(samples_or_rows):
        if isinstance(item, Sample):
            row = sample_to_row(item)
        else:
            row = to_plain(item)
            parse_row(row, i, where=f"write_jsonl({str(p)!r}) row {i}")
        lines.append(json.dumps(row, ensure_ascii=False) + "\n")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(lines), encoding="utf-8")
    return p
