"""The console's Jinja filters (``api.formatting``'s formatters, as the CLI and the report use
them) and the geometry of its throughput chart: numbers that the template draws as inline SVG
(nothing is fetched from anywhere, so the console works offline).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from flask import Flask

from api.formatting import count, duration, money, percent, relative, when
from api.services.console import Throughput

# the Jinja filter names the templates use -> the shared formatters
FILTERS: dict[str, Callable[..., str]] = {
    "when": when,
    "relative": relative,
    "money": money,
    "pct": percent,
    "count": count,
}


def register_filters(app: Flask) -> None:
    for name, fn in FILTERS.items():
        app.add_template_filter(fn, name)


def _ceiling(value: float) -> float:
    """A round axis top at or above ``value``: 1, 2 or 5 times a power of ten."""
    if value <= 0:
        return 1.0
    scale = 10.0 ** math.floor(math.log10(value))
    return next(m * scale for m in (1, 2, 5, 10) if m * scale >= value * (1 - 1e-12))


def chart(t: Throughput, width: int = 720, height: int = 220) -> dict[str, Any] | None:
    """Geometry of the throughput chart: tokens/s (output; input for embeddings) as bars (left axis), requests finished
    so far as a line (right axis). Numbers only; the template draws it as inline SVG."""
    if not t.buckets:
        return None
    left, right, top, bottom = 64, 64, 12, 30
    w, h = width - left - right, height - top - bottom
    rates = [b.tokens_per_second for b in t.buckets]
    rate_top = _ceiling(max(rates))
    cumulative, total = [], 0.0
    for b in t.buckets:
        total += b.requests
        cumulative.append(total)
    req_top = _ceiling(total)
    step = w / len(t.buckets)
    bars = []
    for i, (b, rate) in enumerate(zip(t.buckets, rates, strict=True)):
        bar_h = h * rate / rate_top
        bars.append(
            {
                "x": round(left + i * step + step * 0.1, 2),
                "y": round(top + h - bar_h, 2),
                "w": round(step * 0.8, 2),
                "h": round(bar_h, 2),
                "title": f"+{duration(b.start - t.start)}: {rate:,.1f} tok/s, {b.requests:,.1f} requests",
            }
        )
    line = " ".join(
        f"{left + (i + 1) * step:.2f},{top + h - h * c / req_top:.2f}" for i, c in enumerate(cumulative)
    )
    ticks = [
        {"y": round(top + h - h * f, 2), "rate": f"{rate_top * f:,.4g}", "requests": f"{req_top * f:,.4g}"}
        for f in (0, 0.5, 1)
    ]
    return {
        "width": width,
        "height": height,
        "left": left,
        "right": left + w,
        "top": top,
        "bottom": top + h,
        "bars": bars,
        "line": line,
        "ticks": ticks,
        "span": duration(t.end - t.start),
        "tokens": t.tokens,  # "output", or "input" for embeddings
        "peak": max(rates),
        "mean": sum(b.output_tokens for b in t.buckets) / max(t.end - t.start, 1e-9),
    }
