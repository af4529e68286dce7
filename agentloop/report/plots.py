"""Self-contained HTML line charts (inline SVG, no plotting library), for reward curves."""

from __future__ import annotations

import html
import math
from pathlib import Path

_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]


def svg_chart(title: str, series: dict[str, list[tuple[float, float]]], *, width: int = 640, height: int = 300,
              xlabel: str = "step") -> str:
    """One SVG chart of several (x, y) series; non-finite points are skipped."""
    pts = [(x, y) for s in series.values() for x, y in s if math.isfinite(x) and math.isfinite(y)]
    left, right, top, bottom = 56, 16, 28, 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="13">{html.escape(title)}</text>']
    if not pts:
        out.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">no data</text></svg>')
        return "".join(out)
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    pad = 0.05 * (y1 - y0)
    y0, y1 = y0 - pad, y1 + pad

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def sy(y: float) -> float:
        return height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom)

    out.append(f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" '
               'fill="none" stroke="#999"/>')
    for k in range(5):
        yv = y0 + k * (y1 - y0) / 4
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{sy(yv):.1f}" y2="{sy(yv):.1f}" stroke="#eee"/>'
                   f'<text x="{left - 4}" y="{sy(yv) + 4:.1f}" text-anchor="end">{yv:.3g}</text>')
        xv = x0 + k * (x1 - x0) / 4
        out.append(f'<text x="{sx(xv):.1f}" y="{height - bottom + 14}" text-anchor="middle">{xv:.3g}</text>')
    out.append(f'<text x="{width / 2}" y="{height - 6}" text-anchor="middle">{html.escape(xlabel)}</text>')
    for i, (name, s) in enumerate(series.items()):
        color = _COLORS[i % len(_COLORS)]
        good = [(x, y) for x, y in s if math.isfinite(x) and math.isfinite(y)]
        if good:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in good)
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{path}"/>')
            out.extend(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}"/>' for x, y in good)
        out.append(f'<text x="{left + 8 + 150 * i}" y="{top + 14}" fill="{color}">{html.escape(name)}</text>')
    out.append("</svg>")
    return "".join(out)


def write_curves_html(path: Path, title: str, charts: list[tuple[str, dict[str, list[tuple[float, float]]]]],
                      note: str = "") -> Path:
    """An HTML page of several charts."""
    body = "".join(f"<div>{svg_chart(t, s)}</div>" for t, s in charts)
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
                    f"<body style='font-family:sans-serif'><h2>{html.escape(title)}</h2>"
                    f"<p>{html.escape(note)}</p>{body}</body></html>")
    return path
