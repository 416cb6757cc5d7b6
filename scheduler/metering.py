"""Metering: what engine time cost, whose tokens it went to, how busy the hardware was, and whether
batches met their completion windows, as pure functions over frozen snapshots.

Units: time in epoch seconds (durations in seconds); money in integer micro-dollars, so shares add up
exactly; list prices in dollars per 1M tokens; hardware in FLOP/s, bytes/s and bytes. Token costs are
*relative* engine seconds per token fitted from measured periods: they split a measured cost, never
predict one, so only their ratios matter.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from fractions import Fraction
from itertools import combinations
from typing import TypeVar

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


@dataclass(frozen=True)
class Accelerator:
    peak_flops: float  # FLOP/s of the whole worker's accelerator(s), dense, at the serving dtype
    memory_bandwidth: float  # bytes/s
    memory_bytes: int


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    bytes_per_parameter: float
    kv_bytes_per_token: int  # all layers, K and V


def model_flops(work: TokenWork, model: ModelShape) -> float:
    """2 * parameters FLOPs per token computed (uncached prompt tokens and output tokens).

    Attention FLOPs are left out: at these context lengths they are small next to the weight matmuls,
    so this slightly understates the work and MFU is a lower bound.
    """
    return 2.0 * model.parameters * (work.uncached_tokens + work.output_tokens)


def mfu(work: TokenWork, seconds: float, model: ModelShape, acc: Accelerator) -> float | None:
    """Model FLOPs utilisation: model_flops / (seconds * peak_flops); None without time or a peak."""
    if seconds <= 0 or acc.peak_flops <= 0:
        return None
    return model_flops(work, model) / (seconds * acc.peak_flops)


def mbu(steps: int, work: TokenWork, seconds: float, model: ModelShape, acc: Accelerator) -> float | None:
    """Memory bandwidth utilisation: each engine step reads every weight once, and decode reads
    ``work.kv_tokens_read`` KV entries; bytes over (seconds * memory_bandwidth). None without time
    or a bandwidth."""
    if seconds <= 0 or acc.memory_bandwidth <= 0:
        return None
    weights = steps * model.parameters * model.bytes_per_parameter
    return (weights + work.kv_tokens_read * model.kv_bytes_per_token) / (seconds * acc.memory_bandwidth)


@dataclass(frozen=True)
class SlaTier:
    window: str  # as written, e.g. "24h"
    seconds: int
    price_multiplier: float


_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def parse_tiers(text: str) -> tuple[SlaTier, ...]:
    """Parse "1h:2,4h:1.5,24h:1,7d:0.75" (window:multiplier; no ':m' means 1.0) into tiers, in the
    given order. Durations are NUMBER + s|m|h|d and must come to at least one second; two windows of
    the same length (even "24h" and "1d") are duplicates. Raises ValueError naming the bad entry."""
    if not text.strip():
        raise ValueError("no SLA tiers given (expected e.g. '1h:2,24h:1')")
    tiers: list[SlaTier] = []
    seen: dict[int, str] = {}
    for raw in text.split(","):
        entry = raw.strip()
        window, sep, mult_text = (part.strip() for part in entry.partition(":"))
        match = _DURATION.fullmatch(window)
        seconds = round(float(match[1]) * _UNIT_SECONDS[match[2]]) if match else 0
        if seconds < 1:
            raise ValueError(f"SLA tier {entry!r}: bad duration {window!r} (expected NUMBER + s|m|h|d)")
        try:
            multiplier = float(mult_text) if sep else 1.0
        except ValueError:
            multiplier = math.nan
        if not (math.isfinite(multiplier) and multiplier > 0):
            raise ValueError(f"SLA tier {entry!r}: multiplier {mult_text!r} is not a positive number")
        if seconds in seen:
            raise ValueError(f"SLA tier {entry!r}: duplicate window (same as {seen[seconds]!r})")
        seen[seconds] = window
        tiers.append(SlaTier(window, seconds, multiplier))
    return tuple(tiers)


def eta(remaining_requests: int, ahead_requests: int, rate: float | None, now: float) -> float | None:
    """Epoch seconds when a batch should finish if the ``ahead`` requests (earlier deadlines) run
    first at the measured ``rate`` (requests/s): ``now`` when nothing remains, None with no rate."""
    if remaining_requests <= 0:
        return now
    if rate is None or rate <= 0:
        return None
    return now + (max(ahead_requests, 0) + remaining_requests) / rate


def sla_met(finished_at: float | None, deadline: float, status: str) -> bool | None:
    """True for a completion at or before the deadline; False for a late completion, an expiry or
    a failure while running; None while not final (``finished_at`` is None) and for a cancelled
    batch, which its owner stopped (a file that fails validation never gets a verdict either:
    see ``storage.status.transition``)."""
    if finished_at is None or status == "cancelled":
        return None
    return status == "completed" and finished_at <= deadline


@dataclass(frozen=True)
class AdmissionDecision:
    accept: bool
    warning: str | None  # human-readable, names the ETA and the deadline in ISO-8601 UTC


ADMISSION_POLICIES = ("off", "warn", "refuse")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def admit(eta_at: float | None, deadline: float, policy: str, window: str) -> AdmissionDecision:
    """Whether to take a batch whose estimated finish ``eta_at`` may be after its ``deadline``.

    An unknown ETA is never held against a batch. Past the deadline, "off" accepts silently, "warn"
    accepts with a warning, "refuse" rejects with the reason and a suggested longer window.
    """
    if policy not in ADMISSION_POLICIES:
        raise ValueError(f"unknown admission policy {policy!r} (expected off, warn or refuse)")
    if eta_at is None or eta_at <= deadline or policy == "off":
        return AdmissionDecision(accept=True, warning=None)
    when = f"at {_iso(eta_at)}, after its {window} deadline {_iso(deadline)}"
    if policy == "warn":
        return AdmissionDecision(True, f"batch is expected to finish {when}; a longer completion_window fits")
    return AdmissionDecision(False, f"batch would finish {when}; retry with a longer completion_window")


@dataclass(frozen=True)
class BatchOutcome:
    tenant: str
    model: str
    finished_at: float | None  # when it reached a final status; None while not final
    sla_met: bool | None  # the verdict recorded then; None: no verdict (cancelled, invalid file)
    requests_completed: int


@dataclass(frozen=True)
class SlaSummary:
    tenant: str
    model: str
    batches: int  # batches that ended (final) in the window
    met: int  # of those, sla_met True
    attainment: float | None  # met / batches, None if batches == 0
    goodput_batches_per_hour: float  # met batches / window hours
    goodput_requests_per_hour: float  # completed requests of met batches / window hours


def sla_summary(outcomes: Iterable[BatchOutcome], since: float, until: float) -> list[SlaSummary]:
    """Per (tenant, model), over batches with an SLA verdict whose ``finished_at`` is in
    [since, until), sorted by (tenant, model), then one row for everything with tenant and model
    "*" (always present).

    Goodput counts only batches that met their deadline, so late work adds nothing to it.
    """
    if until <= since:
        raise ValueError(f"empty window: until ({until}) <= since ({since})")
    hours = (until - since) / 3600
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])  # batches, met, requests
    everything = [0, 0, 0]
    for o in outcomes:
        if o.finished_at is None or o.sla_met is None or not since <= o.finished_at < until:
            continue
        met = o.sla_met
        for acc in (counts[(o.tenant, o.model)], everything):
            acc[0] += 1
            acc[1] += met
            acc[2] += o.requests_completed if met else 0
    keyed = [(key, counts[key]) for key in sorted(counts)] + [(("*", "*"), everything)]
    return [
        SlaSummary(
            tenant, model, batches, met, met / batches if batches else None, met / hours, requests / hours
        )
        for (tenant, model), (batches, met, requests) in keyed
    ]
