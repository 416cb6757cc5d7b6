"""scheduler/budgets.py: calendar months in UTC, dollars typed by an operator, when the warning is
due, when a hard budget refuses, and the dry run's verdict on a priced range."""

from __future__ import annotations

import calendar

import pytest

from scheduler.budgets import BudgetState, dollars_to_micros, fit, month_named, month_of


def test_months_are_utc_calendar_months():
    feb = month_named("2028-02")  # a leap year
    assert feb.start == calendar.timegm((2028, 2, 1, 0, 0, 0)) and feb.end - feb.start == 29 * 86400
    assert month_of(feb.start).key == "2028-02" and month_of(feb.end - 1).key == "2028-02"
    assert month_of(feb.end).key == "2028-03"
    assert month_named("2026-12").end == calendar.timegm((2027, 1, 1, 0, 0, 0))
    for bad in ("2026-13", "2026-1", "26-01", "2026-00", "", "2026-01-01"):
        with pytest.raises(ValueError, match="YYYY-MM"):
            month_named(bad)


def test_dollars_typed_become_micro_dollars():
    assert dollars_to_micros("500") == 500_000_000 and dollars_to_micros("12.345678") == 12_345_678
    for bad in ("0", "-1", "nan", "inf", "abc", "1e13"):
        with pytest.raises(ValueError, match="budget"):
            dollars_to_micros(bad)


def state(spent: int, soft: bool = False) -> BudgetState:
    return BudgetState(100_000_000, spent, soft, month_named("2026-11"))


def test_warning_refusal_and_soft():
    assert not state(79_999_999).warning_due(0.8, None)
    assert state(80_000_000).warning_due(0.8, None) and state(80_000_000).warning_due(0.8, "2026-10")
    assert not state(95_000_000).warning_due(0.8, "2026-11")  # once a month
    assert not state(99_999_999).refuses_new_batches() and state(100_000_000).refuses_new_batches()
    assert not state(150_000_000, soft=True).refuses_new_batches()
    assert state(150_000_000).remaining_micros == 0 and state(150_000_000).ratio == 1.5


def test_the_dry_runs_verdict():
    assert fit(state(90_000_000), 1.0, 9.0)["fits"] is True  # $10 left
    assert fit(state(90_000_000), 10.5, 20.0)["fits"] is False
    assert fit(state(90_000_000), 5.0, 20.0)["fits"] is None  # depends on the output written
    assert fit(state(90_000_000), None, None)["fits"] is None  # no history to price it
    assert fit(state(90_000_000), 1.0, 2.0)["remaining_usd"] == 10.0
