"""The one progress line: `[#####...........] 12/64 episodes | field | field | 37s`.

Used by `agentloop rollout` (the engine's periodic line), `agentloop train` (one line per step) and
`agentloop bench` (one line per measured item), so every long command reports alike.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TextIO

BAR_WIDTH = 24


def bar(done: float, total: float, width: int = BAR_WIDTH) -> str:
    """`[####....]`: the share done, `width` cells; a zero total counts as done."""
    filled = width if total <= 0 else max(0, min(width, int(width * done / total)))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def progress_line(done: int, total: int, unit: str, fields: Iterable[str] = (), *,
                  elapsed_s: float | None = None) -> str:
    """The bar, `done/total unit`, then each non-empty field, then the elapsed time, joined by ` | `."""
    parts = [f"{bar(done, total)} {done}/{total} {unit}".rstrip()]
    parts += [f for f in fields if f]
    if elapsed_s is not None:
        parts.append(f"{elapsed_s:.0f}s")
    return " | ".join(parts)


def fmt_fields(row: dict[str, Any], labels: dict[str, str], keys: Iterable[str]) -> list[str]:
    """`label value` (3 significant digits) for each key present in `row`."""
    return [f"{labels.get(k, k)} {row[k]:.3g}" for k in keys if isinstance(row.get(k), (int, float))]


def emit(line: str, stream: TextIO | None = None) -> None:
    """Print one progress line, flushed (stderr by default, so stdout stays for results)."""
    print(line, file=stream or sys.stderr, flush=True)
