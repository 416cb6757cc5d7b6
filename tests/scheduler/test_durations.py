"""The one duration grammar (``scheduler.durations.parse_duration``): what it reads and what it refuses."""

from __future__ import annotations

import pytest

from scheduler.durations import parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("90m", 5400.0),
        ("24h", 86400.0),
        ("7d", 7 * 86400.0),
        ("1.5h", 5400.0),
        ("0.5d", 43200.0),
        (" 24h ", 86400.0),  # white space around is ignored
        ("0s", 0.0),  # a zero is a duration; callers that need more say so (parse_tiers)
    ],
)
def test_reads_a_number_and_a_unit(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text",
    ["", "24", "h", "1w", "24H", "-1h", "+1h", "1e3s", "1 h", "1h30m", ".5h", "5.h", "2026-11-01", "24h;"],
)
def test_refuses_anything_else_naming_the_text(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration") as caught:
        parse_duration(text)
    assert repr(text) in str(caught.value)
