"""Durations as people type them: a number and a unit, "30s", "90m", "24h", "7d", "1.5h".

One grammar for every place Freight reads one: the completion windows of FREIGHT_COMPLETION_WINDOWS
(``scheduler.sla.parse_tiers``) and the "time ago" of ``freight report --since`` and the console's
usage page (``api.services.reports.parse_since``). Pure: no I/O.
"""

from __future__ import annotations

import re

UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def parse_duration(text: str) -> float:
    """Seconds in ``text``: NUMBER (digits, with a decimal part or not) and one of s, m, h or d,
    surrounding white space ignored ("24h" -> 86400.0, "1.5h" -> 5400.0). Raises ValueError
    naming the text otherwise (no sign, no exponent, no other unit, no space inside)."""
    match = _DURATION.fullmatch(text.strip())
    if not match:
        raise ValueError(f"not a duration: {text!r} (expected NUMBER + s|m|h|d, like 30s, 90m, 24h or 7d)")
    return float(match[1]) * UNIT_SECONDS[match[2]]
