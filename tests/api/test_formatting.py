"""``api.formatting``: the one way the console, the CLI and the report write figures for people."""

from __future__ import annotations

import pytest

from api.formatting import MISSING, count, duration, money, number, percent, relative, when


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (12.5, "$12.50"),  # cents from a dollar up
        (1234.56789, "$1,234.57"),
        (1.0, "$1.00"),
        (0.99999, "$1.00"),  # rounds up to a dollar with cents, not "$1.0000"
        (0.5, "$0.50"),  # never fewer decimals than the cents
        (0.042, "$0.042"),  # four significant digits below a dollar, trailing zeros dropped
        (0.012257, "$0.01226"),
        (0.006007, "$0.006007"),
        (0.0025, "$0.0025"),
        (0.000123, "$0.000123"),
        (0.0, "$0.00"),
        (-0.5, "-$0.50"),
        (None, MISSING),
    ],
)
def test_money(value: float | None, text: str) -> None:
    assert money(value) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (42.9, "42s"),
        (187, "3m 07s"),
        (3900, "1h 05m"),
        (2 * 86400 + 3 * 3600 + 59, "2d 03h"),
        (-5, "0s"),
    ],
)
def test_duration_is_two_units_at_most(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_times_and_the_rest() -> None:
    assert MISSING == "-"
    assert when(0) == "1970-01-01 00:00:00 UTC" and when(None) == MISSING
    assert relative(1000 + 187, 1000) == "in 3m 07s" and relative(1000 - 42, 1000) == "42s ago"
    assert relative(None, 1000) == MISSING
    assert percent(0.1234) == "12.3%" and percent(None) == MISSING
    assert count(1234567) == "1,234,567" and count(None) == MISSING
    assert number(1234.56) == "1,234.6" and number(2.5, 2) == "2.50" and number(None) == MISSING
