"""Usage reports: read-only queries over batches, work units and engine samples, summed per
tenant and model (the /metrics snapshot in ``api/services/monitoring.py`` shares the helpers).

Counts, tokens and engine time are summed by the database (GROUP BY, the same SQL on SQLite and
PostgreSQL). Money stays in integer micro-dollars until the final division: the charge of a batch
is its engine cost times its tier's multiplier rounded half up (``charged_micros``, exact), so it is
computed per batch, as the batch's own cost object shows it, and then summed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import case, func, select, text
from sqlalchemy.orm import Session

from scheduler.cost import MICROS_PER_DOLLAR, charged_micros, per_million
from scheduler.durations import parse_duration
from scheduler.sla import BatchOutcome, SlaSummary, sla_summary
from storage.models import Batch, Tenant, UnitStatus, WorkUnit
from storage.runtime import Runtime
from storage.status import BatchStatus

ALL = "*"  # tenant and model of the total row
NO_MODEL = "-"  # model of a batch whose file failed validation before its model was known
WORKER_STALE_SECONDS = 300.0  # a worker whose latest sample ended longer ago than this is not shown
SLA_WINDOW_SECONDS = 86400  # freight_sla_attainment_ratio looks back this far
UNIT_STATUSES = {UnitStatus.PENDING, UnitStatus.QUEUED, UnitStatus.RUNNING, *UnitStatus.FINISHED}


def consistent_snapshot(s: Session, is_sqlite: bool) -> None:
    """Make the queries of one read transaction see one snapshot. A SQLite read transaction does
    already; PostgreSQL's default (read committed) takes a new snapshot per statement."""
    if not is_sqlite:
        s.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY"))


# --- usage report -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ReportRow:
    """Finished batches of one tenant and model (or of everything: tenant and model "*").

    Money in dollars: ``cost`` is what the tiers charge (engine cost x multiplier); the per-1M rates
    divide the charged parts by uncached prompt, cached prompt and output tokens. ``saving`` compares
    the charge of the batches that have a list price with that list price. Means of fill, MFU and
    MBU are weighted by the engine seconds of the work units that have them. ``cache_hit_rate`` is
    what vLLM reported (cached / prompt tokens); ``planned_cache_hit_rate`` what the batches'
    prefix-sorted plans predicted (planned cached / planned prompt tokens, of every request).
    """

    tenant: str
    model: str
    batches: int
    requests_completed: int
    requests_failed: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    engine_seconds: float
    cost: float
    cost_per_1m_tokens: float | None
    cost_per_1m_input: float | None
    cost_per_1m_cached_input: float | None
    cost_per_1m_output: float | None
    list_price: float | None
    saving: float | None
    cache_hit_rate: float | None
    planned_cache_hit_rate: float | None
    mean_fill: float | None
    mfu: float | None
    mbu: float | None
    output_tok_s: float | None
    sla_batches: int
    sla_met: int
    sla_attainment: float | None
    goodput_batches_per_hour: float
    goodput_requests_per_hour: float


_UNIT_METRICS = ("mean_fill", "mfu", "mbu")  # weighted by engine seconds over work units


@dataclass
class _Sums:
    """Exact sums of one group; added group by group into the total."""

    batches: int = 0
    requests_completed: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    uncached_tokens: int = 0
    output_tokens: int = 0
    planned_prompt_tokens: int = 0
    planned_cached_tokens: int = 0
    engine_seconds: float = 0.0
    list_micros: int | None = None
    charged: int = 0  # micro-dollars, each batch's charge rounded on its own
    charged_input: int = 0
    charged_cached: int = 0
    charged_output: int = 0
    charged_listed: int = 0  # the charge of the batches that have a list price
    # weighted means over work units: value * engine_seconds and engine_seconds, per metric
    weighted: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_UNIT_METRICS, 0.0))
    weights: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_UNIT_METRICS, 0.0))

    def add(self, other: _Sums) -> None:
        for name in (
            "batches", "requests_completed", "requests_failed", "prompt_tokens", "cached_tokens",
            "uncached_tokens", "output_tokens", "planned_prompt_tokens", "planned_cached_tokens",
            "engine_seconds", "charged", "charged_input",
            "charged_cached", "charged_output", "charged_listed",
        ):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if other.list_micros is not None:
            self.list_micros = (self.list_micros or 0) + other.list_micros
        for m in _UNIT_METRICS:
            self.weighted[m] += other.weighted[m]
            self.weights[m] += other.weights[m]


def in_window(since: float, until: float):
    """Final batches whose final stamp (integer epoch seconds) is in [since, until)."""
    return (
        Batch.status.in_(BatchStatus.FINAL),
        math.ceil(since) <= Batch.finished_at,
        math.ceil(until) > Batch.finished_at,
    )


def _filters(tenant: str | None, model: str | None) -> list:
    where = []
    if tenant is not None:
        where.append(Tenant.name == tenant)
    if model is not None:
        where.append(Batch.model == model)
    return where


def as_int(value: object) -> int:
    return int(value or 0)  # type: ignore[call-overload]  # PostgreSQL sums BIGINT as NUMERIC


def usage_report(
    rt: Runtime, since: float, until: float, tenant: str | None = None, model: str | None = None
) -> list[ReportRow]:
    """Batches that reached a final status in [since, until) (running ones are left out), one row
    per (tenant name, model) sorted, then the total row ("*", "*"), which is always there.
    ``tenant`` and ``model`` keep only that tenant's (by name) or model's batches. Raises
    ValueError for an empty window."""
    if until <= since:
        raise ValueError(f"empty window: until ({until}) <= since ({since})")
    where = [*in_window(since, until), *_filters(tenant, model)]
    uncached = case(
        (Batch.prompt_tokens > Batch.cached_tokens, Batch.prompt_tokens - Batch.cached_tokens), else_=0
    )
    totals = select(
        Tenant.name,
        Batch.model,
        func.count(),
        func.sum(Batch.request_completed),
        func.sum(Batch.request_failed),
        func.sum(Batch.prompt_tokens),
        func.sum(Batch.cached_tokens),
        func.sum(uncached),
        func.sum(Batch.completion_tokens),
        func.sum(Batch.engine_seconds),
        func.sum(Batch.list_price_micros),  # NULL when no batch of the group has one
        func.sum(Batch.planned_prompt_tokens),
        func.sum(Batch.planned_cached_tokens),
    )
    weighted = []
    for name in _UNIT_METRICS:
        column = getattr(WorkUnit, name)
        has = column.is_not(None)
        weighted += [
            func.sum(case((has, column * WorkUnit.engine_seconds), else_=0.0)),
            func.sum(case((has, WorkUnit.engine_seconds), else_=0.0)),
        ]
    units = (
        select(Tenant.name, Batch.model, *weighted)
        .select_from(WorkUnit)
        .join(Batch, Batch.id == WorkUnit.batch_id)
    )
    # the charge is rounded per batch, so these come one row a batch (narrow: numbers only)
    money = select(
        Tenant.name,
        Batch.model,
        Batch.finished_at,
        Batch.sla_met,
        Batch.request_completed,
        Batch.price_multiplier,
        Batch.cost_micros,
        Batch.cost_input_micros,
        Batch.cost_cached_micros,
        Batch.cost_output_micros,
        Batch.list_price_micros.is_not(None),
    )
    groups: dict[tuple[str, str], _Sums] = defaultdict(_Sums)
    outcomes: list[BatchOutcome] = []
    with rt.db.read() as s:
        consistent_snapshot(s, rt.db.is_sqlite)
        for name, mdl, n, done, failed, prompt, cached, unc, output, secs, listed, *plan in s.execute(
            totals.join(Tenant, Tenant.id == Batch.tenant_id).where(*where).group_by(Tenant.name, Batch.model)
        ):
            g = groups[(name, mdl or NO_MODEL)]
            g.batches, g.requests_completed, g.requests_failed = as_int(n), as_int(done), as_int(failed)
            g.prompt_tokens, g.cached_tokens, g.uncached_tokens = as_int(prompt), as_int(cached), as_int(unc)
            g.output_tokens, g.engine_seconds = as_int(output), float(secs or 0.0)
            g.list_micros = None if listed is None else int(listed)
            g.planned_prompt_tokens, g.planned_cached_tokens = as_int(plan[0]), as_int(plan[1])
        for name, mdl, *sums in s.execute(
            units.join(Tenant, Tenant.id == Batch.tenant_id).where(*where).group_by(Tenant.name, Batch.model)
        ):
            g = groups[(name, mdl or NO_MODEL)]
            for i, metric in enumerate(_UNIT_METRICS):
                g.weighted[metric], g.weights[metric] = float(sums[2 * i] or 0), float(sums[2 * i + 1] or 0)
        for name, mdl, final_at, met, done, mult, cost, c_in, c_cached, c_out, has_list in s.execute(
            money.join(Tenant, Tenant.id == Batch.tenant_id).where(*where)
        ):
            g = groups[(name, mdl or NO_MODEL)]
            charged = charged_micros(cost, mult)
            g.charged += charged
            g.charged_input += charged_micros(c_in, mult)
            g.charged_cached += charged_micros(c_cached, mult)
            g.charged_output += charged_micros(c_out, mult)
            g.charged_listed += charged if has_list else 0
            outcomes.append(BatchOutcome(name, mdl or NO_MODEL, final_at, met, done))
    sla = {(r.tenant, r.model): r for r in sla_summary(outcomes, since, until)}
    total = _Sums()
    rows = []
    for key in sorted(groups):
        total.add(groups[key])
        rows.append(_row(*key, groups[key], sla.get(key)))
    rows.append(_row(ALL, ALL, total, sla[(ALL, ALL)]))
    return rows


def ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _row(tenant: str, model: str, g: _Sums, sla: SlaSummary | None) -> ReportRow:
    d = MICROS_PER_DOLLAR
    return ReportRow(
        tenant=tenant,
        model=model,
        batches=g.batches,
        requests_completed=g.requests_completed,
        requests_failed=g.requests_failed,
        prompt_tokens=g.prompt_tokens,
        cached_tokens=g.cached_tokens,
        output_tokens=g.output_tokens,
        engine_seconds=g.engine_seconds,
        cost=g.charged / d,
        cost_per_1m_tokens=per_million(g.charged, g.prompt_tokens + g.output_tokens),
        cost_per_1m_input=per_million(g.charged_input, g.uncached_tokens),
        cost_per_1m_cached_input=per_million(g.charged_cached, g.cached_tokens),
        cost_per_1m_output=per_million(g.charged_output, g.output_tokens),
        list_price=None if g.list_micros is None else g.list_micros / d,
        saving=1 - g.charged_listed / g.list_micros if g.list_micros else None,
        cache_hit_rate=ratio(g.cached_tokens, g.prompt_tokens),
        planned_cache_hit_rate=ratio(g.planned_cached_tokens, g.planned_prompt_tokens),
        mean_fill=ratio(g.weighted["mean_fill"], g.weights["mean_fill"]),
        mfu=ratio(g.weighted["mfu"], g.weights["mfu"]),
        mbu=ratio(g.weighted["mbu"], g.weights["mbu"]),
        output_tok_s=ratio(g.output_tokens, g.engine_seconds),
        sla_batches=sla.batches if sla else 0,
        sla_met=sla.met if sla else 0,
        sla_attainment=sla.attainment if sla else None,
        goodput_batches_per_hour=sla.goodput_batches_per_hour if sla else 0.0,
        goodput_requests_per_hour=sla.goodput_requests_per_hour if sla else 0.0,
    )


def parse_since(text: str, now: float) -> float:
    """Epoch seconds for ``text``: a time ago ("7d", "24h", "90m", "3600s": NUMBER + s|m|h|d before
    ``now``) or an ISO-8601 date or date-time ("2026-11-01", "2026-11-01T12:00:00Z", with an
    offset or without one, which means UTC). Raises ValueError naming the text otherwise."""
    raw = text.strip()
    try:
        return now - parse_duration(raw)
    except ValueError:
        pass  # not a time ago: a date, or nothing
    try:
        when = datetime.fromisoformat(raw) if raw and raw[0].isdigit() else None
    except ValueError:
        when = None
    if when is None:
        raise ValueError(
            f"not a time: {text!r} (expected a time ago like 7d, 24h, 90m or 3600s, "
            "or an ISO date or date-time like 2026-11-01 or 2026-11-01T12:00:00Z)"
        )
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()
