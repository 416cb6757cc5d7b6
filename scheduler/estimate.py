"""A batch's price before it runs: the arithmetic of an estimate, as pure functions.

What is known exactly once a file is validated: how many requests, their prompt tokens (as
validation counts them), and the output budget of each (``max_tokens``, or the default). What the
sorted plan predicts: the prompt tokens vLLM's prefix cache serves, the same prediction the
batch's units carry (``scheduler.unit_plan.predicted_cached_tokens`` over the prefix-sorted rows).
What only history can say: how many output tokens a request typically takes (below its budget),
how fast the model's engines compute tokens and so how long and how much. Without history the
estimate says "unknown" rather than guess a rate.

Units: tokens; seconds; money in integer micro-dollars (``scheduler.cost``), shown in dollars.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from scheduler.cost import (
    MICROS_PER_DOLLAR,
    ListPrice,
    TokenWork,
    charged_micros,
    engine_cost_micros,
    list_price_micros,
)
from scheduler.ordering import common_prefix_tokens
from scheduler.unit_plan import predicted_cached_tokens

UNKNOWN = "unknown"


@dataclass
class PlanTotals:
    """A file's requests summed over the prefix-sorted plan (``add`` in sorted order)."""

    block_size: int
    typical_output: float | None = None  # tokens per request in recent history; None: none known
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # predicted prefix-cache hits of the sorted order
    output_max: int = 0  # every request writes its whole budget
    output_typical: int = 0  # every request writes the typical figure, capped by its budget
    lower_bound_requests: int = 0  # whose prompt length is only its key's (a lower bound)
    _previous: bytes | None = field(default=None, repr=False)

    def add(self, key: bytes, prompt_len: int, budget: int, exact: bool = True) -> None:
        """One request, in sorted order: its prompt key, prompt length, output budget (tokens)."""
        shared = 0 if self._previous is None else common_prefix_tokens(self._previous, key)
        self._previous = key
        self.requests += 1
        self.prompt_tokens += prompt_len
        self.cached_tokens += predicted_cached_tokens(shared, prompt_len, self.block_size)
        self.output_max += budget
        if self.typical_output is not None:
            self.output_typical += min(budget, round(self.typical_output))
        if not exact:
            self.lower_bound_requests += 1


def plan_totals(
    rows: Iterable[tuple[bytes, int, int]], block_size: int, typical_output: float | None = None
) -> PlanTotals:
    """``(key, prompt_len, budget)`` rows in prefix-sorted order, summed."""
    totals = PlanTotals(block_size, typical_output)
    for key, prompt_len, budget in rows:
        totals.add(key, prompt_len, budget)
    return totals


@dataclass(frozen=True)
class History:
    """What the database says of the model's recent work."""

    window_seconds: float  # how far back it looks
    typical_output: float | None  # output tokens per completed request (the tenant's); None: none
    tokens_per_second: float | None  # computed tokens (uncached prompt + output) per busy engine second
    engines: int  # engines that ran the model in the window (>= 1 when the rate is known)


def typical_output(completion_tokens: int, completed_requests: int) -> float | None:
    """Output tokens per completed request, None without any."""
    return completion_tokens / completed_requests if completed_requests > 0 else None


def engine_rate(computed_tokens: int, busy_seconds: float) -> float | None:
    """Computed tokens per busy second of one engine; None without busy time or tokens."""
    if busy_seconds <= 0 or computed_tokens <= 0:
        return None
    return computed_tokens / busy_seconds


def _range(low: float, high: float, digits: int) -> dict[str, float]:
    return {"low": round(low, digits), "high": round(high, digits)}


def summary(
    totals: PlanTotals,
    history: History,
    price_multiplier: float,
    price_per_hour: float,
    list_price: ListPrice | None,
) -> dict[str, Any]:
    """The estimate block: tokens, the predicted cache hit rate, output bounds, the ETA and the
    cost ranges. The range's low end is the typical output (or, with no history, none below the
    budget is claimed: low = high); its high end every request writing its whole budget.

    Engine seconds = computed tokens (prompt not served by the cache, plus output) / the model's
    per-engine rate; the ETA spreads them over the model's engines (and counts no work queued
    ahead); cost = engine seconds x the instance price x the tier's multiplier, as
    ``scheduler.cost`` charges a run (``engine_cost_micros``, ``charged_micros``)."""
    uncached = max(totals.prompt_tokens - totals.cached_tokens, 0)
    output_low = totals.output_typical if history.typical_output is not None else totals.output_max
    output_high = totals.output_max
    rate = history.tokens_per_second
    if rate is None:
        eta: Any = UNKNOWN
        cost: Any = UNKNOWN
        engine_seconds: Any = UNKNOWN
    else:
        seconds_low, seconds_high = (uncached + output_low) / rate, (uncached + output_high) / rate
        engines = max(history.engines, 1)
        engine_seconds = _range(seconds_low, seconds_high, 3)
        eta = {**_range(seconds_low / engines, seconds_high / engines, 1), "engines": engines}

        def charged(seconds: float) -> int:
            return charged_micros(engine_cost_micros(seconds, price_per_hour), price_multiplier)

        cost = _range(charged(seconds_low) / MICROS_PER_DOLLAR, charged(seconds_high) / MICROS_PER_DOLLAR, 6)
    listed: Any = None
    if list_price is not None:

        def at_list(output: int) -> float:
            work = TokenWork(prompt_tokens=totals.prompt_tokens, cached_tokens=totals.cached_tokens,
                             output_tokens=output)  # fmt: skip
            return list_price_micros(work, list_price) / MICROS_PER_DOLLAR

        listed = _range(at_list(output_low), at_list(output_high), 6)
    hit_rate = round(totals.cached_tokens / totals.prompt_tokens, 4) if totals.prompt_tokens else None
    per_request = None if history.typical_output is None else round(history.typical_output, 2)
    return {
        "requests": totals.requests,
        "input_tokens": totals.prompt_tokens,
        "input_tokens_lower_bound_requests": totals.lower_bound_requests,
        "cached_input_tokens": totals.cached_tokens,
        "cache_hit_rate": hit_rate,
        "kv_block_size": totals.block_size,
        "output_tokens": {
            "max": output_high,
            "typical": totals.output_typical if history.typical_output is not None else None,
            "typical_per_request": per_request,
        },
        "history": {
            "window_seconds": history.window_seconds,
            "tokens_per_second": None if rate is None else round(rate, 2),
            "engines": history.engines,
        },
        "engine_seconds": engine_seconds,
        "eta_seconds": eta,
        "cost": {
            "currency": "usd",
            "price_multiplier": price_multiplier,
            "instance_price_per_hour": price_per_hour,
            "total": cost,
            "list_price": listed,
        },
    }
