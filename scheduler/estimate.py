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

from dataclasses import dataclass, field
from typing import Any

from scheduler.cost import (
    MICROS_PER_DOLLAR,
    ListPrice,
    TokenWork,
    charged_micros,
    engine_cost_micros,
    kv_reads,
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
    kv_reads_max: int = 0  # KV entries its decode steps read (scheduler.cost.kv_reads), whole budgets
    kv_reads_typical: int = 0  # the same at the typical output
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
        self.kv_reads_max += kv_reads(prompt_len, budget)
        if self.typical_output is not None:
            typical = min(budget, round(self.typical_output))
            self.output_typical += typical
            self.kv_reads_typical += kv_reads(prompt_len, typical)
        if not exact:
            self.lower_bound_requests += 1


@dataclass(frozen=True)
class EngineModel:
    """Busy engine seconds as a linear function of the work done in them: seconds per uncached
    prompt token, per output token and per KV entry a decode step reads. One rate per computed
    token cannot price a file whose mix differs from the model's recent work: 64 output tokens
    over a 440-token cached context ran at 2,900 computed tokens/s where long prefills ran at
    4,800/s (bench/README.md, "Estimates against their runs"); the KV term is that difference."""

    prefill: float  # seconds per uncached prompt token
    decode: float  # seconds per output token
    kv_read: float  # seconds per KV entry read by decode steps (0 in the two-term fit)

    def seconds(self, uncached: float, output: float, kv_read: float) -> float:
        return self.prefill * uncached + self.decode * output + self.kv_read * kv_read


@dataclass(frozen=True)
class SampleMoments:
    """Sums over engine samples of x_i * x_j and x_i * y, for x = (uncached prompt tokens, output
    tokens, KV entries read) and y = busy seconds: all a least-squares fit needs, so the database
    sums them (in floating point: the products overflow 64-bit integers) and no row is fetched."""

    samples: int
    xx: tuple[tuple[float, float, float], tuple[float, float, float], tuple[float, float, float]]
    xy: tuple[float, float, float]


MIN_FIT_SAMPLES = 12  # engine samples (5 s each by default) before a fitted model is trusted
_CONDITION_FLOOR = 1e-6  # the terms' correlation determinant below which they cannot be told apart


def fit_engine_model(m: SampleMoments) -> EngineModel | None:
    """The least-squares EngineModel of the samples: all three terms, else prefill and decode
    alone, whichever first has every coefficient positive and terms the samples tell apart; None
    with too few samples or neither fit (the estimate falls back to one rate)."""
    if m.samples < MIN_FIT_SAMPLES:
        return None
    for terms in ((0, 1, 2), (0, 1)):
        coefficients = _least_squares(m, terms)
        if coefficients is not None and all(c > 0 for c in coefficients):
            full = dict(zip(terms, coefficients, strict=True))
            return EngineModel(prefill=full[0], decode=full[1], kv_read=full.get(2, 0.0))
    return None


def _least_squares(m: SampleMoments, terms: tuple[int, ...]) -> list[float] | None:
    """Solve the normal equations on ``terms``, scaled to unit diagonal so tokens and KV entries
    (orders of magnitude apart) condition alike; None when a term never varies or the terms are
    (nearly) collinear."""
    scale = [m.xx[i][i] ** 0.5 for i in terms]
    if any(v <= 0 for v in scale):
        return None
    a = [[m.xx[i][j] / (scale[r] * scale[c]) for c, j in enumerate(terms)] for r, i in enumerate(terms)]
    b = [m.xy[i] / scale[r] for r, i in enumerate(terms)]
    determinant = _determinant(a)
    if abs(determinant) < _CONDITION_FLOOR:
        return None
    solved = _solve(a, b, determinant)
    return [v / scale[r] for r, v in enumerate(solved)]


def _determinant(a: list[list[float]]) -> float:
    if len(a) == 2:
        return a[0][0] * a[1][1] - a[0][1] * a[1][0]
    return (
        a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
        - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
        + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0])
    )


def _solve(a: list[list[float]], b: list[float], d: float) -> list[float]:
    """Cramer's rule (2 or 3 unknowns; ``d``: the matrix's non-zero determinant)."""
    out = []
    for k in range(len(a)):
        replaced = [[b[r] if c == k else a[r][c] for c in range(len(a))] for r in range(len(a))]
        out.append(_determinant(replaced) / d)
    return out


@dataclass(frozen=True)
class History:
    """What the database says of the model's recent work."""

    window_seconds: float  # how far back it looks
    typical_output: float | None  # output tokens per completed request (the tenant's); None: none
    tokens_per_second: float | None  # computed tokens (uncached prompt + output) per busy engine second
    engines: int  # engines that ran the model in the window (>= 1 when the rate is known)
    model: EngineModel | None = None  # fitted from the engine samples; None: the one rate above


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

    Engine seconds: the model's fitted EngineModel applied to the file's uncached prompt tokens,
    output tokens and KV reads, where history allows a fit; else computed tokens (prompt not
    served by the cache, plus output) / the model's per-engine rate. The ETA spreads them over the
    model's engines (and counts no work queued ahead); cost = engine seconds x the instance price
    x the tier's multiplier, as ``scheduler.cost`` charges a run (``engine_cost_micros``,
    ``charged_micros``)."""
    uncached = max(totals.prompt_tokens - totals.cached_tokens, 0)
    output_low = totals.output_typical if history.typical_output is not None else totals.output_max
    output_high = totals.output_max
    kv_low = totals.kv_reads_typical if history.typical_output is not None else totals.kv_reads_max
    rate, model = history.tokens_per_second, history.model
    if rate is None:
        eta: Any = UNKNOWN
        cost: Any = UNKNOWN
        engine_seconds: Any = UNKNOWN
    else:
        if model is not None:
            seconds_low = model.seconds(uncached, output_low, kv_low)
            seconds_high = model.seconds(uncached, output_high, totals.kv_reads_max)
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
            # the fitted model's seconds per million of each (null: priced at the one rate)
            "seconds_per_million": None
            if model is None or rate is None
            else {
                "uncached_input_tokens": round(model.prefill * 1e6, 3),
                "output_tokens": round(model.decode * 1e6, 3),
                "kv_entries_read": round(model.kv_read * 1e6, 6),
            },
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
