"""Spend budgets per tenant, the arithmetic: which calendar month a moment falls in, how much of
a budget is spent, when the warning is due, whether a new batch is refused, and whether a dry
run's price fits what is left.

A budget is money per calendar month (UTC), in integer micro-dollars as ``scheduler.cost``
meters it; spend is what the tenant's batches created in the month were charged
(``charged_micros``: engine cost x the tier's multiplier), running ones included as their units
finish. Pure functions; ``storage/budgets.py`` reads and records them.
"""

from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from datetime import UTC, datetime

from scheduler.cost import MICROS_PER_DOLLAR

# the share of a budget whose spending sends the warning (FREIGHT_BUDGET_WARNING_RATIO's default)
WARNING_RATIO = 0.8
_MONTH = re.compile(r"^(\d{4})-(0[1-9]|1[0-2])$")


@dataclass(frozen=True)
class Period:
    key: str  # "YYYY-MM"
    start: int  # epoch seconds, inclusive
    end: int  # epoch seconds, exclusive


def month_of(now: float) -> Period:
    """The UTC calendar month holding ``now``."""
    at = datetime.fromtimestamp(now, UTC)
    return month_named(f"{at.year:04d}-{at.month:02d}")


def month_named(key: str) -> Period:
    """The month ``YYYY-MM``; a ``ValueError`` naming the form for anything else."""
    match = _MONTH.match(key) if isinstance(key, str) else None
    if match is None:
        raise ValueError(f"a month is written YYYY-MM (e.g. 2026-11), not {str(key)[:40]!r}")
    year, month = int(match[1]), int(match[2])
    start = calendar.timegm((year, month, 1, 0, 0, 0))
    days = calendar.monthrange(year, month)[1]
    return Period(key, start, start + days * 86400)


def dollars_to_micros(text: str) -> int:
    """A budget typed in dollars ("500", "12.50") as micro-dollars; positive, at most a trillion."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"a budget is a number of dollars, not {str(text)[:40]!r}") from None
    if not value > 0 or value > 1e12:
        raise ValueError("a budget must be more than 0 and at most 1,000,000,000,000 dollars")
    return round(value * MICROS_PER_DOLLAR)


@dataclass(frozen=True)
class BudgetState:
    """A tenant's budget of one month and what is spent of it (micro-dollars)."""

    budget_micros: int
    spent_micros: int
    soft: bool
    period: Period

    @property
    def ratio(self) -> float:
        return self.spent_micros / self.budget_micros

    @property
    def remaining_micros(self) -> int:
        return max(self.budget_micros - self.spent_micros, 0)

    @property
    def exhausted(self) -> bool:
        return self.spent_micros >= self.budget_micros

    def warning_due(self, ratio: float, warned_period: str | None) -> bool:
        """The warning is sent once a month, the first time spend reaches ``ratio`` of the budget."""
        return warned_period != self.period.key and self.spent_micros >= ratio * self.budget_micros

    def refuses_new_batches(self) -> bool:
        """A hard budget spent in full refuses new batches; a soft one only warns."""
        return self.exhausted and not self.soft


def fit(state: BudgetState, cost_low: float | None, cost_high: float | None) -> dict[str, object]:
    """The dry run's budget block: what is left this month and whether the batch's priced range
    (dollars; None when the model has no history to price it) fits: ``fits`` true when even the
    high end fits, false when even the low end does not, null when it depends on the output (or
    the price is unknown)."""
    remaining = state.remaining_micros / MICROS_PER_DOLLAR
    fits: bool | None = None
    if cost_high is not None and cost_high <= remaining:
        fits = True
    elif cost_low is not None and cost_low > remaining:
        fits = False
    return {
        "period": state.period.key,
        "monthly_usd": state.budget_micros / MICROS_PER_DOLLAR,
        "spent_usd": state.spent_micros / MICROS_PER_DOLLAR,
        "remaining_usd": remaining,
        "soft": state.soft,
        "fits": fits,
    }
