"""Cost: what engine time cost and whose tokens it went to, as pure functions over frozen snapshots.

How busy the hardware was lives in ``scheduler.utilization``; whether batches met their completion
windows in ``scheduler.sla``.

Units: time in seconds; money in integer micro-dollars, so shares add up exactly; list prices in
dollars per 1M tokens. Token costs are
*relative* engine seconds per token fitted from measured periods: they split a measured cost, never
predict one, so only their ratios matter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from fractions import Fraction
from itertools import combinations
from typing import Any, Protocol, TypeVar

K = TypeVar("K", str, int)

MICROS_PER_DOLLAR = 1_000_000


@dataclass(frozen=True)
class TokenWork:
    """Tokens of some requests; adds field by field, so per-request work sums to per-period work."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # the part of prompt_tokens served from the prefix cache
    output_tokens: int = 0
    requests: int = 0
    kv_tokens_read: int = 0  # KV entries read by decode steps: kv_reads() summed over requests

    def __add__(self, other: TokenWork) -> TokenWork:
        if not isinstance(other, TokenWork):
            return NotImplemented
        return TokenWork(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def uncached_tokens(self) -> int:
        """Prompt tokens the engine had to compute (never below 0, even on inconsistent counts)."""
        return max(self.prompt_tokens - self.cached_tokens, 0)


def kv_reads(prompt_tokens: int, output_tokens: int) -> int:
    """KV entries one request reads over its decode steps: step i (0-based, i < output) attends to
    prompt + i tokens, so the sum is output*prompt + output*(output-1)//2; 0 if output <= 0."""
    if output_tokens <= 0:
        return 0
    return output_tokens * prompt_tokens + output_tokens * (output_tokens - 1) // 2


@dataclass(frozen=True)
class TokenCosts:  # relative engine seconds per token, on any common scale: only ratios are used
    prefill: float  # an uncached prompt token
    cached: float  # a prompt token served from the prefix cache
    decode: float  # an output token


DEFAULT_TOKEN_COSTS = TokenCosts(prefill=1.0, cached=0.05, decode=1.0)


def work_weight(work: TokenWork, costs: TokenCosts) -> float:
    """The engine time ``work`` is worth at ``costs``: what a shared period's cost is split by."""
    return (
        work.uncached_tokens * costs.prefill
        + work.cached_tokens * costs.cached
        + work.output_tokens * costs.decode
    )


@dataclass(frozen=True)
class PeriodWork:  # one measured engine period: busy seconds and the work finished in it
    seconds: float
    work: TokenWork


_SINGULAR = 1e-10  # determinant of the column-normalised Gram matrix (1 = orthogonal, 0 = collinear)


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; the caller ensures the matrix is non-singular."""
    n = len(rhs)
    a = [[*matrix[i], rhs[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for c in range(col, n + 1):
                a[r][c] -= f * a[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (a[r][n] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return x


def fit_token_costs(periods: Iterable[PeriodWork], fallback: TokenCosts, min_periods: int = 8) -> TokenCosts:
    """Non-negative least squares of seconds ~ prefill*uncached + cached*cached + decode*output, no
    intercept, over the periods with seconds > 0.

    The NNLS optimum is the unconstrained fit on its own support, so trying every non-empty subset of
    the three variables and keeping the feasible one with the least residual finds it exactly. Returns
    ``fallback`` with fewer than ``min_periods`` usable periods, when the data cannot tell the three
    kinds of token apart (a singular system, e.g. no cached tokens ever seen), or when the fit puts
    both prefill and decode at 0. A fitted cached == 0 is kept.
    """
    busy = [p for p in periods if p.seconds > 0 and math.isfinite(p.seconds)]
    if len(busy) < min_periods:
        return fallback
    data = [((p.work.uncached_tokens, p.work.cached_tokens, p.work.output_tokens), p.seconds) for p in busy]
    gram = [[float(sum(r[i] * r[j] for r, _ in data)) for j in range(3)] for i in range(3)]
    aty = [sum(r[i] * y for r, y in data) for i in range(3)]
    if min(gram[i][i] for i in range(3)) <= 0:
        return fallback
    # Solve in z_j = x_j * norm_j, so the matrix is a correlation matrix and its determinant a
    # scale-free singularity test; sub-matrices of a positive-definite matrix are non-singular too.
    norm = [math.sqrt(gram[i][i]) for i in range(3)]
    corr = [[gram[i][j] / (norm[i] * norm[j]) for j in range(3)] for i in range(3)]
    rhs = [aty[i] / norm[i] for i in range(3)]
    a, b, c = corr[0][1], corr[0][2], corr[1][2]
    if 1 + 2 * a * b * c - a * a - b * b - c * c < _SINGULAR:
        return fallback
    best: list[float] | None = None
    best_residual = math.inf
    for size in (1, 2, 3):
        for subset in combinations(range(3), size):
            z = _solve([[corr[i][j] for j in subset] for i in subset], [rhs[i] for i in subset])
            if any(v < 0 for v in z):
                continue
            x = [0.0, 0.0, 0.0]
            for j, v in zip(subset, z, strict=True):
                x[j] = v / norm[j]
            residual = sum((y - x[0] * r[0] - x[1] * r[1] - x[2] * r[2]) ** 2 for r, y in data)
            if residual < best_residual:
                best, best_residual = x, residual
    if best is None or (best[0] == 0 and best[2] == 0):
        return fallback
    return TokenCosts(prefill=best[0], cached=best[1], decode=best[2])


def apportion(total: int, weights: Mapping[K, float]) -> dict[K, int]:
    """Split a non-negative integer ``total`` over the keys in proportion to ``weights``, by the
    largest-remainder method in exact arithmetic: every share is within 1 of its exact quota, the
    shares sum exactly to ``total``, and equal remainders go to keys in sorted order.

    Negative weights count as 0; if every weight is 0 the split is equal. Keys keep the mapping's
    order. Raises ValueError for total < 0, a non-finite weight, or total > 0 with no keys.
    """
    if total < 0:
        raise ValueError(f"cannot apportion a negative total: {total}")
    if not weights:
        if total > 0:
            raise ValueError(f"cannot apportion {total} over no keys")
        return {}
    if not all(math.isfinite(w) for w in weights.values()):
        raise ValueError(f"weights must be finite numbers, got {dict(weights)!r}")
    exact = {k: Fraction(w) if w > 0 else Fraction(0) for k, w in weights.items()}
    whole = sum(exact.values(), Fraction(0))
    if whole == 0:
        exact, whole = dict.fromkeys(weights, Fraction(1)), Fraction(len(weights))
    quotas = {k: total * w / whole for k, w in exact.items()}
    shares = {k: math.floor(q) for k, q in quotas.items()}
    left = total - sum(shares.values())  # 0 <= left < len(weights)
    # Stable sort: reverse=True keeps sorted-key order among equal remainders.
    for k in sorted(sorted(weights), key=lambda k: quotas[k] - shares[k], reverse=True)[:left]:
        shares[k] += 1
    return shares


def _round_half_up(x: Fraction) -> int:
    return math.floor(x + Fraction(1, 2))


def engine_cost_micros(seconds: float, price_per_hour: float) -> int:
    """Integer micro-dollars for ``seconds`` of an instance at ``price_per_hour`` dollars, rounded
    half up (computed exactly, so 3600 s at $2/h is 2_000_000). Negative or non-finite: ValueError."""
    for name, value in (("seconds", seconds), ("price_per_hour", price_per_hour)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return _round_half_up(Fraction(seconds) * Fraction(price_per_hour) * MICROS_PER_DOLLAR / 3600)


def cost_breakdown(cost_micros: int, work: TokenWork, costs: TokenCosts) -> dict[str, int]:
    """Split a cost into input / cached_input / output micro-dollars by the engine time each kind of
    token took (uncached*prefill, cached*cached, output*decode); the parts sum exactly to the cost."""
    return apportion(
        cost_micros,
        {
            "input": work.uncached_tokens * costs.prefill,
            "cached_input": work.cached_tokens * costs.cached,
            "output": work.output_tokens * costs.decode,
        },
    )


def charged_micros(cost_micros: int, multiplier: float) -> int:
    """What a tier charges for an engine cost: cost x its price multiplier, rounded half up."""
    return int(Fraction(cost_micros) * Fraction(multiplier) + Fraction(1, 2))


def per_million(micros: int, tokens: int) -> float | None:
    """Dollars per 1M tokens: micros / 1e6 / tokens * 1e6 = micros / tokens; None without tokens."""
    return micros / tokens if tokens > 0 else None


@dataclass(frozen=True)
class ListPrice:  # dollars per 1M tokens, e.g. the provider's online price for a comparable model
    input: float
    cached_input: float
    output: float


def list_price_micros(work: TokenWork, price: ListPrice) -> int:
    """What the same tokens cost at list price, in integer micro-dollars rounded half up (one token at
    $P per 1M tokens is exactly P micro-dollars)."""
    return _round_half_up(
        work.uncached_tokens * Fraction(price.input)
        + work.cached_tokens * Fraction(price.cached_input)
        + work.output_tokens * Fraction(price.output)
    )


class CostedBatch(Protocol):
    """What ``cost_summary`` reads of a batch (a ``storage.models.Batch`` row has all of it)."""

    price_multiplier: float
    cost_micros: int
    cost_input_micros: int
    cost_cached_micros: int
    cost_output_micros: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    engine_seconds: float
    list_price_micros: int | None


def cost_summary(b: CostedBatch) -> dict[str, Any]:
    """A batch's cost in dollars, as the API and the drop-folder manifests show it: the engine time's
    cost, times the SLA tier's multiplier, per 1M tokens of each kind, and the same tokens at the
    model's list price (None where none is configured)."""
    m = b.price_multiplier
    total = charged_micros(b.cost_micros, m)
    uncached = max(0, b.prompt_tokens - b.cached_tokens)
    list_price = b.list_price_micros

    def rate(micros: int, tokens: int) -> float | None:
        value = per_million(charged_micros(micros, m), tokens)
        return None if value is None else round(value, 6)

    return {
        "currency": "usd",
        "engine_seconds": round(b.engine_seconds, 3),
        "engine_cost": b.cost_micros / MICROS_PER_DOLLAR,
        "price_multiplier": m,
        "total": total / MICROS_PER_DOLLAR,
        "per_1m_tokens": {
            "input": rate(b.cost_input_micros, uncached),
            "cached_input": rate(b.cost_cached_micros, b.cached_tokens),
            "output": rate(b.cost_output_micros, b.completion_tokens),
            "all": rate(b.cost_micros, b.prompt_tokens + b.completion_tokens),
        },
        "list_price": None if list_price is None else list_price / MICROS_PER_DOLLAR,
        "saving": round(1 - total / list_price, 4) if list_price else None,
    }
