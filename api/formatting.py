"""How Freight writes numbers and times for people: the console's pages, the ``freight`` commands
and the usage report all format through these, so a figure reads the same wherever it is shown.

One output per kind, chosen once:
- nothing known is ``-`` (MISSING): plain ASCII, which every terminal, pipe and CSV reader shows
  as it is; the console's pages use the same mark.
- a time is ``2026-11-28 14:05:00 UTC``: always UTC, always named, so two machines agree.
- a duration is two units at most, the second zero-padded (``42s``, ``3m 07s``, ``1h 05m``,
  ``2d 03h``): as short as a progress line needs, and columns of them line up.
- money is dollars with cents (``$12.50``, ``$1,234.57``, ``$0.00``), and four significant digits
  below a dollar (``$0.042``, ``$0.01226``, ``$0.006007``): a token price or a small batch's cost
  is a fraction of a cent, which cents alone would show as $0.00.
- a fraction is a percent with one decimal (``12.3%``); a count has thousands separators.
Pure functions of their arguments: no clock, no locale.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime

MISSING = "-"


def when(ts: float | None) -> str:
    return MISSING if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(seconds: float) -> str:
    """Whole seconds in at most two units; a negative span is 0s (an ETA already passed)."""
    s = int(max(0.0, seconds))
    if s >= 86400:
        return f"{s // 86400}d {s % 86400 // 3600:02d}h"
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s}s"


def relative(ts: float | None, now: float) -> str:
    if ts is None:
        return MISSING
    return f"in {duration(ts - now)}" if ts >= now else f"{duration(now - ts)} ago"


def money(value: float | None) -> str:
    if value is None:
        return MISSING
    size = abs(value)
    decimals = 2
    if 0 < size < 1:  # four significant digits, and never fewer than the cents
        decimals = max(2, min(10, 3 - math.floor(math.log10(size))))
    text = f"{size:,.{decimals}f}"
    if decimals > 2:
        text = text.rstrip("0")
        text += "0" * (2 - len(text.partition(".")[2]))
    return ("-$" if value < 0 else "$") + text


def percent(value: float | None) -> str:
    return MISSING if value is None else f"{value * 100:.1f}%"


def count(value: float | None) -> str:
    return MISSING if value is None else f"{value:,.0f}"


def number(value: float | None, decimals: int = 1) -> str:
    return MISSING if value is None else f"{value:,.{decimals}f}"
