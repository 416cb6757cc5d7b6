"""Metering on the engine worker: which units get the engine's busy time and its cost.

The engine runs the requests of many units (of many batches) in one running batch, so no unit
can be timed on its own. The engine loop sums its busy time into periods instead. A period closes
after a step whose results finished a unit (so its share is known before it is recorded) or after
``period_seconds``, always after the step's results are all counted.
Its time and cost go to the units whose requests finished in it, in proportion to their weighted
tokens (``scheduler.cost.work_weight``, with token costs fitted on this worker's recent
periods), by largest remainder in integer microseconds and micro-dollars: the shares sum exactly
to the period. A period in which nothing finished carries over to the next.

Cost is cumulative: the cost of the busy time so far, rounded once, less what earlier periods
got, so rounding never drifts from busy seconds x price. All of it runs on the engine-loop thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.cost import (
    DEFAULT_TOKEN_COSTS,
    PeriodWork,
    TokenCosts,
    TokenWork,
    apportion,
    cost_breakdown,
    engine_cost_micros,
    fit_token_costs,
    work_weight,
)

FIT_HISTORY = 256  # closed periods the token-cost fit looks back over
FIT_EVERY = 16  # refit after this many closed periods


@dataclass(eq=False)
class UnitMeter:
    """What one unit has been given so far."""

    work: TokenWork = field(default_factory=TokenWork)
    engine_us: int = 0  # microseconds of engine busy time
    cost_micros: int = 0
    parts: dict[str, int] = field(default_factory=lambda: {"input": 0, "cached_input": 0, "output": 0})
    steps: float = 0.0  # its share of engine steps (each step reads every weight once: MBU)

    @property
    def engine_seconds(self) -> float:
        return self.engine_us / 1e6


class CostMeter:
    def __init__(
        self,
        price_per_hour: float,
        period_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.price_per_hour = price_per_hour
        self.period_seconds = period_seconds
        self.clock = clock
        self.costs: TokenCosts = DEFAULT_TOKEN_COSTS
        self._busy_us = 0  # busy time of the open period (carried while nothing finished)
        self._steps = 0
        self._total_us = 0  # busy time of every closed period
        self._total_cost = 0  # micro-dollars given out so far
        self._period: dict[int, tuple[UnitMeter, TokenWork]] = {}  # unit id -> its work this period
        self._opened = clock()
        self._history: deque[PeriodWork] = deque(maxlen=FIT_HISTORY)
        self._closed = 0

    def busy(self, seconds: float, steps: int = 1) -> None:
        """The engine was busy this long (one loop pass: top-up and step)."""
        self._busy_us += max(0, round(seconds * 1e6))
        self._steps += steps

    @property
    def due(self) -> bool:
        """The open period has run its length."""
        return self.clock() - self._opened >= self.period_seconds

    def finished(self, unit_id: int, meter: UnitMeter, work: TokenWork) -> None:
        """A request of this unit finished (or failed) after doing ``work`` in the engine."""
        _, sofar = self._period.get(unit_id, (meter, TokenWork()))
        self._period[unit_id] = (meter, sofar + work)

    def close(self) -> None:
        """Give the open period's busy time and cost to the units that finished work in it (every
        unit's work is settled, even with no time to give)."""
        self._opened = self.clock()
        if not self._period:
            return  # nothing finished: the time carries over
        busy_us, steps, period = self._busy_us, self._steps, self._period
        self._busy_us, self._steps, self._period = 0, 0, {}
        self._total_us += busy_us
        cost_total = engine_cost_micros(self._total_us / 1e6, self.price_per_hour)
        cost, self._total_cost = cost_total - self._total_cost, cost_total
        weights = {uid: work_weight(work, self.costs) for uid, (_, work) in period.items()}
        times = apportion(busy_us, weights)
        costs = apportion(cost, weights)
        total_weight = sum(weights.values())
        for uid, (meter, work) in period.items():
            meter.work = meter.work + work
            meter.engine_us += times[uid]
            meter.cost_micros += costs[uid]
            for part, micros in cost_breakdown(costs[uid], work, self.costs).items():
                meter.parts[part] += micros
            share = weights[uid] / total_weight if total_weight > 0 else 1 / len(period)
            meter.steps += steps * share
        all_work = TokenWork()
        for _, work in period.values():
            all_work = all_work + work
        self._history.append(PeriodWork(seconds=busy_us / 1e6, work=all_work))
        self._closed += 1
        if self._closed % FIT_EVERY == 0:
            self.costs = fit_token_costs(self._history, fallback=DEFAULT_TOKEN_COSTS)
