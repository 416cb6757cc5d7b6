"""A tenant's monthly usage statement: one row per batch it created in the calendar month (UTC),
then one row per model and one for the whole month, each with its requests, tokens by kind, what
it was charged and whether it met its SLA; as CSV or Parquet (``freight report --statement``, the
console's usage page).

The month is the budget's (``scheduler/budgets.py``): batches counted by when they were created,
so the statement's total is what the tenant's budget counts as spent that month. A batch still
running is in it with what it has been charged so far (its status says so). Money is the charge
(engine cost x the tier's multiplier, ``scheduler.cost.charged_micros``) in dollars; a token
kind's part is the engine cost of that kind times the multiplier, each rounded per batch.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

from sqlalchemy import select

from api.report_format import csv_cell
from scheduler.budgets import Period
from scheduler.cost import MICROS_PER_DOLLAR, charged_micros
from storage.errors import ServiceError
from storage.models import Batch, Tenant
from storage.runtime import Runtime

ALL = "*"  # batch_id of a model's row; model of the month's row
NO_MODEL = "-"  # a batch whose file failed validation before its model was known


@dataclass
class StatementRow:
    tenant: str
    period: str  # YYYY-MM
    row: str  # "batch", "model" (a model's batches summed) or "total" (the month's)
    batch_id: str
    model: str
    endpoint: str
    status: str
    completion_window: str
    created_at: int | None  # epoch seconds (None in summed rows)
    batches: int
    requests_completed: int
    requests_failed: int
    prompt_tokens: int  # cached included
    cached_tokens: int
    output_tokens: int
    engine_seconds: float
    cost_input: float  # dollars: uncached prompt tokens' part of the charge
    cost_cached: float
    cost_output: float
    cost: float  # the charge
    sla_met: bool | None  # a batch's verdict (None: none yet or no SLA); summed rows: all met
    sla_batches: int  # batches with a verdict
    sla_met_batches: int


def _dollars(micros: int) -> float:
    return micros / MICROS_PER_DOLLAR


def _batch_row(tenant: str, period: Period, b: Batch) -> StatementRow:
    m = b.price_multiplier
    verdict = b.sla_met
    return StatementRow(
        tenant=tenant,
        period=period.key,
        row="batch",
        batch_id=b.id,
        model=b.model or NO_MODEL,
        endpoint=b.endpoint,
        status=b.status,
        completion_window=b.completion_window,
        created_at=b.created_at,
        batches=1,
        requests_completed=b.request_completed or 0,
        requests_failed=b.request_failed or 0,
        prompt_tokens=b.prompt_tokens or 0,
        cached_tokens=b.cached_tokens or 0,
        output_tokens=b.completion_tokens or 0,
        engine_seconds=round(b.engine_seconds or 0.0, 3),
        cost_input=_dollars(charged_micros(b.cost_input_micros or 0, m)),
        cost_cached=_dollars(charged_micros(b.cost_cached_micros or 0, m)),
        cost_output=_dollars(charged_micros(b.cost_output_micros or 0, m)),
        cost=_dollars(charged_micros(b.cost_micros or 0, m)),
        sla_met=verdict,
        sla_batches=int(verdict is not None),
        sla_met_batches=int(bool(verdict)),
    )


def _summed(tenant: str, period: Period, kind: str, model: str, rows: Sequence[StatementRow]) -> StatementRow:
    def total(name: str) -> float:
        return sum(getattr(r, name) for r in rows)

    sla_batches = int(total("sla_batches"))
    sla_met = int(total("sla_met_batches"))
    return StatementRow(
        tenant=tenant,
        period=period.key,
        row=kind,
        batch_id=ALL,
        model=model,
        endpoint="",
        status="",
        completion_window="",
        created_at=None,
        batches=len(rows),
        requests_completed=int(total("requests_completed")),
        requests_failed=int(total("requests_failed")),
        prompt_tokens=int(total("prompt_tokens")),
        cached_tokens=int(total("cached_tokens")),
        output_tokens=int(total("output_tokens")),
        engine_seconds=round(total("engine_seconds"), 3),
        # sums of micro-dollar figures already rounded per batch: exact in micro-dollars
        cost_input=round(total("cost_input"), 6),
        cost_cached=round(total("cost_cached"), 6),
        cost_output=round(total("cost_output"), 6),
        cost=round(total("cost"), 6),
        sla_met=None if not sla_batches else sla_met == sla_batches,
        sla_batches=sla_batches,
        sla_met_batches=sla_met,
    )


def statement(rt: Runtime, tenant_name: str, period: Period) -> list[StatementRow]:
    """The tenant's batches created in ``period``, oldest first, then a row per model (by name)
    and the month's total row (always present, zero when there was no batch)."""
    with rt.db.read() as s:
        tenant = s.scalar(select(Tenant).where(Tenant.name == tenant_name))
        if tenant is None:
            raise ServiceError("not_found", f"no tenant named {tenant_name[:64]!r}", param="tenant")
        batches = s.scalars(
            select(Batch)
            .where(
                Batch.tenant_id == tenant.id, Batch.created_at >= period.start, Batch.created_at < period.end
            )
            .order_by(Batch.created_at, Batch.id)
        ).all()
        rows = [_batch_row(tenant.name, period, b) for b in batches]
    by_model: dict[str, list[StatementRow]] = {}
    for r in rows:
        by_model.setdefault(r.model, []).append(r)
    models = [_summed(tenant_name, period, "model", m, by_model[m]) for m in sorted(by_model)]
    return [*rows, *models, _summed(tenant_name, period, "total", ALL, rows)]


FIELDS = tuple(f.name for f in fields(StatementRow))


def _cell(value: object) -> object:
    """A boolean as true/false; anything else as the usage report writes a cell (the formula escape
    included)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return csv_cell(value)


def statement_csv(rows: Sequence[StatementRow]) -> str:
    """A header of the field names, a line per row; None is an empty cell, a boolean true/false,
    and a text cell a spreadsheet would run as a formula starts with an apostrophe."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=FIELDS, lineterminator="\r\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: _cell(v) for k, v in asdict(r).items()})
    return buffer.getvalue()


def statement_parquet(rows: Sequence[StatementRow]) -> bytes:
    """One typed column per field (string, int64, float64, bool; None is null)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = {"str": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_()}
    schema = pa.schema([(f.name, types[str(f.type).replace(" | None", "")]) for f in fields(StatementRow)])
    table = pa.Table.from_pylist([asdict(r) for r in rows], schema=schema)
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()
