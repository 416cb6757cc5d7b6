"""The /metrics snapshot: batch, unit and worker state and the cost and SLA counters, read from
the database in one transaction at scrape time (so every API process answers the same)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sqlalchemy import ColumnElement, Row, case, func, select
from sqlalchemy.orm import Session

from api.services.reports import (
    ALL,
    NO_MODEL,
    SLA_WINDOW_SECONDS,
    UNIT_STATUSES,
    WORKER_STALE_SECONDS,
    as_int,
    consistent_snapshot,
    in_window,
    ratio,
)
from scheduler.cost import MICROS_PER_DOLLAR, charged_micros
from scheduler.sla import BatchOutcome, sla_summary
from storage.models import Batch, BatchRollup, EngineSample, EngineSampleTotal, Tenant, WorkUnit
from storage.registry import served_names
from storage.rollup import UNIT_COLUMNS
from storage.runtime import Runtime
from storage.status import BatchStatus

# --- /metrics ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerGauges:
    """One worker's latest engine sample; None where the sample cannot tell (the gauge is left out)."""

    worker: str
    model: str
    batch_fill: float | None  # the fractions are 0-1
    cache_hit: float | None
    mfu: float | None
    mbu: float | None


@dataclass(frozen=True)
class MetricsSnapshot:
    batches: Mapping[tuple[str, str], int]  # (status, model) -> batches
    queue_requests: Mapping[str, int]  # model -> requests of in_progress batches not yet finished
    work_units: Mapping[tuple[str, str], int]  # (model, status) -> units
    batches_at_risk: Mapping[str, int]  # model -> in_progress batches flagged at risk
    workers: tuple[WorkerGauges, ...]  # workers with a sample in the last WORKER_STALE_SECONDS
    engine_busy_seconds: Mapping[tuple[str, str], float]  # (worker, model), all samples
    engine_cost_dollars: Mapping[tuple[str, str], float]  # (worker, model), all samples
    # (worker, model, kind: prompt | output), all samples; cached prompt tokens are part of the
    # prompt ones, so they are counted apart (cached_prompt_tokens) and a sum over kind is the total
    tokens: Mapping[tuple[str, str, str], int]
    cached_prompt_tokens: Mapping[tuple[str, str], int]  # (worker, model), all samples
    batch_cost_dollars: Mapping[tuple[str, str], float]  # (tenant, model), charged, final batches
    sla_batches: Mapping[tuple[str, str, str], int]  # (tenant, model, met: "true" | "false")
    sla_attainment: Mapping[tuple[str, str], float]  # (tenant, model), last SLA_WINDOW_SECONDS
    # (worker, model), all samples that counted them (an inline engine core; none: no entry)
    engine_preemptions: Mapping[tuple[str, str], int] = field(default_factory=dict)


def live_samples(s: Session, now: float) -> Sequence[EngineSample]:
    """The engine samples of the last WORKER_STALE_SECONDS, oldest first: what the live-worker
    gauges of /metrics and of the console's workers page are read from (an idle engine writes no
    samples, so a worker idle longer drops out of both)."""
    return s.scalars(
        select(EngineSample)
        .where(
            # the first bound lets the index on started_at narrow the scan: no sample is
            # longer than an hour (a period closes every FREIGHT_SAMPLE_SECONDS)
            EngineSample.started_at >= now - WORKER_STALE_SECONDS - 3600,
            EngineSample.started_at + EngineSample.seconds >= now - WORKER_STALE_SECONDS,
        )
        .order_by(EngineSample.started_at, EngineSample.id)
    ).all()


def metrics_snapshot(rt: Runtime, now: float) -> MetricsSnapshot:
    """Everything GET /metrics reports, read in one transaction. Gauges of batch and unit counts
    list every status (0 included) for every model seen or configured, so a count that drops to 0
    reads 0 rather than vanishing."""
    with rt.db.read() as s:
        consistent_snapshot(s, rt.db.is_sqlite)
        # final batches come summed from the rollup; the rest (open ones, and final ones not added
        # yet) row by row, through the index on rolled_up_at: no scrape reads every batch or unit
        rolled = s.execute(
            select(BatchRollup, Tenant.name).join(Tenant, Tenant.id == BatchRollup.tenant_id)
        ).all()
        live = Batch.rolled_up_at.is_(None)
        batch_counts = _batch_counts(s, live, rolled)
        active = (Batch.status == BatchStatus.IN_PROGRESS.value,)
        remaining = func.sum(
            case(
                (
                    Batch.request_total > Batch.request_completed + Batch.request_failed,
                    Batch.request_total - Batch.request_completed - Batch.request_failed,
                ),
                else_=0,
            )
        )
        queue = {
            model or NO_MODEL: as_int(n)
            for model, n in s.execute(select(Batch.model, remaining).where(*active).group_by(Batch.model))
        }
        at_risk = {
            model or NO_MODEL: int(n)
            for model, n in s.execute(
                select(Batch.model, func.count())
                .where(*active, Batch.at_risk_since.is_not(None))
                .group_by(Batch.model)
            )
        }
        unit_counts = _unit_counts(s, live, rolled)
        latest = {(r.worker, r.model): r for r in live_samples(s, now)}  # ordered: the last one wins
        busy, engine_cost, tokens, cached_tokens = _engine_totals(s)
        preemptions = _engine_preemptions(s)
        charged, sla_batches = _charges_and_sla(s, live, rolled)
        since = now - SLA_WINDOW_SECONDS
        until = math.floor(now) + 1  # stamps are whole seconds: take the current one in
        outcomes = [
            BatchOutcome(tenant, model or NO_MODEL, final_at, met, done)
            for tenant, model, final_at, met, done in s.execute(
                select(Tenant.name, Batch.model, Batch.finished_at, Batch.sla_met, Batch.request_completed)
                .join(Tenant, Tenant.id == Batch.tenant_id)
                .where(*in_window(since, until), Batch.sla_met.is_not(None))
            )
        ]
    models = {m for _, m in batch_counts} | {m for m, _ in unit_counts} | served_names(rt.db, rt.settings)
    return MetricsSnapshot(
        batches={(st, m): batch_counts.get((st, m), 0) for m in sorted(models) for st in BatchStatus},
        queue_requests={m: queue.get(m, 0) for m in sorted(models)},
        work_units={
            (m, st): unit_counts.get((m, st), 0)
            for m in sorted(models)
            for st in sorted(UNIT_STATUSES | {st for _, st in unit_counts})
        },
        batches_at_risk={m: at_risk.get(m, 0) for m in sorted(models)},
        workers=tuple(_worker_gauges(latest[key]) for key in sorted(latest)),
        engine_busy_seconds=busy,
        engine_cost_dollars=engine_cost,
        tokens=tokens,
        cached_prompt_tokens=cached_tokens,
        engine_preemptions=preemptions,
        batch_cost_dollars={key: micros / MICROS_PER_DOLLAR for key, micros in sorted(charged.items())},
        sla_batches=dict(sla_batches),
        sla_attainment={
            (r.tenant, r.model): r.attainment
            for r in sla_summary(outcomes, since, until)
            if r.attainment is not None and r.tenant != ALL
        },
    )


def _worker_gauges(sample: EngineSample) -> WorkerGauges:
    return WorkerGauges(
        worker=sample.worker,
        model=sample.model,
        batch_fill=ratio(sample.running_mean, sample.max_num_seqs),
        cache_hit=ratio(sample.cached_tokens, sample.prompt_tokens),
        mfu=sample.mfu,
        mbu=sample.mbu,
    )


def _batch_counts(
    s: Session, live: ColumnElement[bool], rolled: Sequence[Row[BatchRollup, str]]
) -> dict[tuple[str, str], int]:
    """(status, model) -> batches: the batches not rolled up yet, and the rollup's."""
    batch_counts: dict[tuple[str, str], int] = defaultdict(int)
    for status, model, n in s.execute(
        select(Batch.status, Batch.model, func.count()).where(live).group_by(Batch.status, Batch.model)
    ):
        batch_counts[(status, model or NO_MODEL)] += int(n)
    for r, _ in rolled:
        batch_counts[(r.status, r.model or NO_MODEL)] += r.batches
    return batch_counts


def _unit_counts(
    s: Session, live: ColumnElement[bool], rolled: Sequence[Row[BatchRollup, str]]
) -> dict[tuple[str, str], int]:
    """(model, status) -> units: those of the batches not rolled up yet, and the rollup's."""
    unit_counts: dict[tuple[str, str], int] = defaultdict(int)
    for model, status, n in s.execute(
        select(WorkUnit.model, WorkUnit.status, func.count())
        .where(WorkUnit.batch_id.in_(select(Batch.id).where(live)))
        .group_by(WorkUnit.model, WorkUnit.status)
    ):
        unit_counts[(model, status)] += int(n)
    for r, _ in rolled:  # the units of a rolled-up batch carry its model (validation sets both)
        for status, column in UNIT_COLUMNS.items():
            if n := getattr(r, column):
                unit_counts[(r.model, status)] += n
    return unit_counts


def _engine_totals(
    s: Session,
) -> tuple[
    dict[tuple[str, str], float],
    dict[tuple[str, str], float],
    dict[tuple[str, str, str], int],
    dict[tuple[str, str], int],
]:
    """The engine counters of every (worker, model): busy seconds, cost in dollars, tokens by
    kind, cached prompt tokens."""
    busy: dict[tuple[str, str], float] = {}
    engine_cost: dict[tuple[str, str], float] = {}
    tokens: dict[tuple[str, str, str], int] = {}
    cached_tokens: dict[tuple[str, str], int] = {}
    cost_micros: dict[tuple[str, str], int] = {}
    # the counters: the sums of the samples the cleanup pruned, plus the samples it keeps
    # (FREIGHT_SAMPLE_RETENTION_SECONDS of them), so pruning changes no total
    kept = select(
        EngineSample.worker,
        EngineSample.model,
        func.sum(EngineSample.seconds),
        func.sum(EngineSample.cost_micros),
        func.sum(EngineSample.prompt_tokens),
        func.sum(EngineSample.cached_tokens),
        func.sum(EngineSample.output_tokens),
    ).group_by(EngineSample.worker, EngineSample.model)
    pruned = select(
        EngineSampleTotal.worker,
        EngineSampleTotal.model,
        EngineSampleTotal.seconds,
        EngineSampleTotal.cost_micros,
        EngineSampleTotal.prompt_tokens,
        EngineSampleTotal.cached_tokens,
        EngineSampleTotal.output_tokens,
    )
    for query in (pruned, kept):
        for row in s.execute(query):
            key, (secs, cost, prompt, cached, output) = (row[0], row[1]), row[2:]
            busy[key] = busy.get(key, 0.0) + float(secs or 0.0)
            cost_micros[key] = cost_micros.get(key, 0) + as_int(cost)
            for kind, n in (("prompt", prompt), ("output", output)):
                tokens[(*key, kind)] = tokens.get((*key, kind), 0) + as_int(n)
            cached_tokens[key] = cached_tokens.get(key, 0) + as_int(cached)
    for key, micros in cost_micros.items():
        engine_cost[key] = micros / MICROS_PER_DOLLAR
    return busy, engine_cost, tokens, cached_tokens


def _engine_preemptions(s: Session) -> dict[tuple[str, str], int]:
    """vLLM's preemptions of every (worker, model) whose samples counted them (workers/kv_gate.py's
    target is none): the pruned rows' sum plus the rows kept. A worker whose engine core runs in
    its own process counts none and has no entry (vLLM's own vllm:num_preemptions counts them)."""
    counted: dict[tuple[str, str], int] = {}
    kept = select(EngineSample.worker, EngineSample.model, func.sum(EngineSample.preemptions)).group_by(
        EngineSample.worker, EngineSample.model
    )
    pruned = select(EngineSampleTotal.worker, EngineSampleTotal.model, EngineSampleTotal.preemptions)
    for query in (pruned, kept):
        for worker, model, n in s.execute(query):
            if n is not None:  # NULL: no sample of it counted them
                counted[(worker, model)] = counted.get((worker, model), 0) + as_int(n)
    return counted


def _charges_and_sla(
    s: Session, live: ColumnElement[bool], rolled: Sequence[Row[BatchRollup, str]]
) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str, str], int]]:
    """(tenant, model) -> micro-dollars charged, and (tenant, model, met) -> batches with an SLA
    outcome, of the final batches (rolled up or not)."""
    # the charge is rounded per batch; batches that cost nothing charge nothing
    charged: dict[tuple[str, str], int] = defaultdict(int)
    for tenant, model, cost, mult in s.execute(
        select(Tenant.name, Batch.model, Batch.cost_micros, Batch.price_multiplier)
        .join(Tenant, Tenant.id == Batch.tenant_id)
        .where(live, Batch.status.in_(BatchStatus.FINAL), Batch.cost_micros > 0)
    ):
        charged[(tenant, model or NO_MODEL)] += charged_micros(cost, mult)
    sla_batches: dict[tuple[str, str, str], int] = defaultdict(int)
    for tenant, model, met, n in s.execute(
        select(Tenant.name, Batch.model, Batch.sla_met, func.count())
        .join(Tenant, Tenant.id == Batch.tenant_id)
        .where(live, Batch.sla_met.is_not(None))
        .group_by(Tenant.name, Batch.model, Batch.sla_met)
    ):
        sla_batches[(tenant, model or NO_MODEL, "true" if met else "false")] += int(n)
    for r, tenant in rolled:
        if r.charged_batches:
            charged[(tenant, r.model or NO_MODEL)] += r.charged_micros
        if r.sla:
            sla_batches[(tenant, r.model or NO_MODEL, r.sla)] += r.batches
    return charged, sla_batches
