"""Parsing answer strings as exact numbers (Fraction), shared by the built-in rewards."""

from __future__ import annotations

import re
from fractions import Fraction

# A decimal with optional thousands separators and a short exponent, or an integer ratio.
_DECIMAL = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d*)?(?:[eE][+-]?\d{1,3})?")
_RATIO = re.compile(r"([+-]?\d+)/(\d+)")
_MAX_CHARS = 200


def parse_number(text: str) -> Fraction | None:
    """`text` as an exact number ("1,234.50", "-.5", "3/4", "2e3", "$5"), or None if it is not one."""
    s = text.strip().lstrip("$").strip()
    if not s or len(s) > _MAX_CHARS:
        return None
    m = _RATIO.fullmatch(s)
    if m:
        den = int(m.group(2))
        return Fraction(int(m.group(1)), den) if den else None
    if not _DECIMAL.fullmatch(s) or not any(c.isdigit() for c in s) or s[-1] in "eE":
        return None
    try:
        return Fraction(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None
