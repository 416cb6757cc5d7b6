"""The rollup of final batches that ``/metrics`` reads instead of every batch and work unit.

A batch is rolled up once it is final and all its work units have finished (then nothing of it
that the metrics count changes any more): one conditional UPDATE sets its ``rolled_up_at`` (``WHERE
rolled_up_at IS NULL``), and the same transaction adds the figures of exactly the batches that
UPDATE changed to ``batch_rollups``. A re-run, or a concurrent finalizer, changes no row and adds
nothing, so no batch is counted twice. The scrape reads the rollup plus the batches whose
``rolled_up_at`` is NULL (an index), which are the open ones and the few final ones not yet added.

Finalization, expiry, cancellation and failure call ``roll_up`` in the transaction that makes the
batch final; a final batch with a unit still running (a failed finalization) is added by the
cleanup's pass (``roll_up_stragglers``) once its units have finished.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, exists, func, select, update
from sqlalchemy.orm import Session

from scheduler.cost import charged_micros
from storage.models import Batch, BatchRollup, WorkUnit
from storage.status import BatchStatus, UnitStatus

UNIT_COLUMNS = {
    UnitStatus.DONE: "units_done",
    UnitStatus.SKIPPED: "units_skipped",
    UnitStatus.FAILED: "units_failed",
}
SUMMED = ("batches", "charged_batches", "charged_micros", *UNIT_COLUMNS.values())
CHUNK = 500  # batch ids per IN list


def sla_label(met: bool | None) -> str:
    return "" if met is None else "true" if met else "false"


def roll_up(s: Session, *where: ColumnElement[bool], now: int) -> int:
    """Add the final batches matching ``where`` that are not rolled up yet and whose units have all
    finished to ``batch_rollups``, and mark them; returns how many were added. Flushes the session
    first, so a batch the caller has just made final counts with its final figures."""
    s.flush()
    marked = s.execute(
        update(Batch)
        .where(*where, *_ready())
        .values(rolled_up_at=now)
        .returning(
            Batch.id,
            Batch.tenant_id,
            Batch.model,
            Batch.status,
            Batch.sla_met,
            Batch.cost_micros,
            Batch.price_multiplier,
        )
        .execution_options(synchronize_session=False)
    ).all()
    if not marked:
        return 0
    sums: dict[tuple[str, str, str, str], dict[str, int]] = defaultdict(lambda: dict.fromkeys(SUMMED, 0))
    key_of = {}
    for batch_id, tenant_id, model, status, met, cost, multiplier in marked:
        key = key_of[batch_id] = (tenant_id, model or "", status, sla_label(met))
        acc = sums[key]
        acc["batches"] += 1
        if cost > 0:  # batches that cost nothing charge nothing
            acc["charged_batches"] += 1
            acc["charged_micros"] += charged_micros(cost, multiplier)
    ids = list(key_of)
    for start in range(0, len(ids), CHUNK):
        for batch_id, unit_status, n in s.execute(
            select(WorkUnit.batch_id, WorkUnit.status, func.count())
            .where(WorkUnit.batch_id.in_(ids[start : start + CHUNK]))
            .group_by(WorkUnit.batch_id, WorkUnit.status)
        ):
            sums[key_of[batch_id]][UNIT_COLUMNS[unit_status]] += int(n)
    add_to_rollup(
        s,
        [
            {**dict(zip(("tenant_id", "model", "status", "sla"), k, strict=True)), **v}
            for k, v in sorted(sums.items())  # one order of row locks for every writer
        ],
    )
    return len(marked)


def add_to_rollup(s: Session, rows: Sequence[dict[str, Any]]) -> None:
    """Insert-or-add each row's sums: concurrent transactions adding to one key both count."""
    if not rows:
        return
    if s.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
    statement = insert(BatchRollup)
    statement = statement.on_conflict_do_update(
        index_elements=["tenant_id", "model", "status", "sla"],
        set_={name: getattr(BatchRollup, name) + getattr(statement.excluded, name) for name in SUMMED},
    )
    s.execute(statement, list(rows))


def roll_up_stragglers(s: Session, now: int, limit: int) -> int:
    """Final batches not rolled up yet (made final while a unit still ran, or by an older release)
    whose units have all finished, up to ``limit``."""
    return roll_up(s, Batch.id.in_(select(Batch.id).where(*_ready()).limit(limit).scalar_subquery()), now=now)


def _ready() -> tuple[ColumnElement[bool], ...]:
    """Batches to roll up: not yet (the index on rolled_up_at finds them), final, units finished."""
    unfinished = exists().where(WorkUnit.batch_id == Batch.id, WorkUnit.status.not_in(UnitStatus.FINISHED))
    return (Batch.rolled_up_at.is_(None), Batch.status.in_(BatchStatus.FINAL), ~unfinished)
