"""Batch, work-unit and estimate state changes that several callers share, applied inside the
caller's transaction. Every unit status change goes through ``move_units``, every estimate's
through ``move_estimates``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import ColumnElement, func, select, update
from sqlalchemy.orm import Session

from storage.db import changed_rows
from storage.models import Batch, Estimate, UnitStatus, WorkUnit
from storage.rollup import roll_up
from storage.status import BatchStatus, EstimateStatus, estimate_sources, transition, unit_sources
from storage.webhooks import record_events

# states in which a batch's units may still run
ACTIVE = (BatchStatus.VALIDATING.value, BatchStatus.IN_PROGRESS.value)

# a running attempt's live counts, which its heartbeats write (requests completed and failed,
# input and output tokens so far): set back to these whenever the attempt starts, or ends without
# ``record_unit`` (released, redelivered, given up, failed), so the sums over a batch's units
# (finalization, the console's chart) never count results that were discarded
NO_LIVE_COUNTS: dict[str, int] = {"completed": 0, "failed": 0, "prompt_tokens": 0, "completion_tokens": 0}


def stop_batch(s: Session, batch: Batch, target: BatchStatus, now: int) -> None:
    """Cancel (``target=CANCELLING``) or expire (``target=EXPIRED``) a batch that may still run.

    Units not yet started are skipped at once; running ones see the status and abort within a
    second, reporting their unfinished requests as ``batch_cancelled`` / ``batch_expired``.
    """
    if target is BatchStatus.EXPIRED:
        batch.final_status = BatchStatus.EXPIRED.value
        transition(batch, BatchStatus.FINALIZING, now)
    else:
        transition(batch, BatchStatus.CANCELLING, now)
    move_units(
        s,
        WorkUnit.batch_id == batch.id,
        from_=(UnitStatus.PENDING, UnitStatus.QUEUED),
        to=UnitStatus.SKIPPED,
        finished_at=float(now),
    )


def finish_batch(s: Session, batch: Batch, target: BatchStatus, now: int) -> None:
    """Move ``batch`` to a final state and, in the same transaction, add it to the rollup /metrics
    reads (``storage.rollup``; at most once, and only once its units have all finished) and record
    its event's webhook deliveries (``storage.webhooks``; the caller sends them after the commit,
    ``workers.webhooks.send_due``, and the tick sends any it did not)."""
    if not target.is_terminal:
        raise ValueError(f"{target} is not a final state")
    transition(batch, target, now)
    roll_up(s, Batch.id == batch.id, now=now)
    record_events(s, batch, now)


def fail_validating(s: Session, batch: Batch, errors: dict[str, Any], now: int) -> None:
    """``validating`` -> ``failed`` with ``errors`` (its file failed, or the quota or the SLA
    refused it). The units its early slices made (``workers.head_start``) and not yet started are
    skipped; running ones see the state and stop within a second; no result of theirs is output.
    The batch counts no requests."""
    batch.errors = errors
    batch.request_total = 0
    move_units(
        s,
        WorkUnit.batch_id == batch.id,
        from_=(UnitStatus.PENDING, UnitStatus.QUEUED),
        to=UnitStatus.SKIPPED,
        finished_at=float(now),
    )
    finish_batch(s, batch, BatchStatus.FAILED, now)


def move_units(
    s: Session, *where: ColumnElement[bool], from_: str | Iterable[str], to: str, **values: Any
) -> int:
    """Move the units matching ``where`` from ``from_`` (a state or several) to ``to``, setting
    ``values`` too, as one compare-and-set UPDATE: ``status IN from_`` is always part of the WHERE,
    so of two writers racing for a unit only one moves it. Raises ``IllegalUnitMove`` for a move
    ``UNIT_TRANSITIONS`` does not allow. Returns how many units moved."""
    sources = unit_sources(from_, to)
    statement = update(WorkUnit).where(*where, WorkUnit.status.in_(sources)).values(status=to, **values)
    return changed_rows(s, statement)


def move_estimates(
    s: Session,
    *where: ColumnElement[bool],
    to: str,
    now: int,
    errors: dict[str, Any] | None = None,
    **values: Any,
) -> int:
    """Move the estimates matching ``where`` to ``to`` as one compare-and-set UPDATE (the sources
    ``ESTIMATE_TRANSITIONS`` allows are part of the WHERE, so of the task and the cleanup racing for
    an estimate only one moves it), stamping ``finished_at`` with ``now``. A failed estimate says
    why (``errors``, listed as a batch's would be); a completed one has no errors. ``values`` sets
    the answer's other columns. Returns how many estimates moved."""
    sources = estimate_sources(to)
    if (to == EstimateStatus.FAILED) != (errors is not None):
        raise ValueError(f"an estimate moving to {to} {'needs' if errors is None else 'takes no'} errors")
    if errors is not None:
        values["errors"] = errors
    statement = (
        update(Estimate)
        .where(*where, Estimate.status.in_(sources))
        .values(status=to, finished_at=now, **values)
    )
    return changed_rows(s, statement)


# unit ids per statement of the passes that lock and move many units by id: PostgreSQL takes at
# most 65,535 parameters in one statement, and a fleet-wide outage can leave more units stale
IDS_PER_STATEMENT = 10_000


def lock_free_units(s: Session, ids: Iterable[int], *where: ColumnElement[bool]) -> list[int]:
    """Of the units ``ids`` that still match ``where``, lock those no other transaction holds
    (``FOR UPDATE SKIP LOCKED``) and return their ids, ascending. Locked in id order, the order
    heartbeats lock them in (two writers locking the same units in different orders deadlock),
    ``IDS_PER_STATEMENT`` at a time. On SQLite, which has no row locks, every match is free: its
    one writer holds them all."""
    ordered = sorted(set(ids))
    free: list[int] = []
    for start in range(0, len(ordered), IDS_PER_STATEMENT):
        chunk = ordered[start : start + IDS_PER_STATEMENT]
        free.extend(
            s.scalars(
                select(WorkUnit.id)
                .where(WorkUnit.id.in_(chunk), *where)
                .order_by(WorkUnit.id)
                .with_for_update(skip_locked=True)
            ).all()
        )
    return free


def move_units_by_id(
    s: Session,
    ids: list[int],
    *where: ColumnElement[bool],
    from_: str | Iterable[str],
    to: str,
    **values: Any,
) -> int:
    """``move_units`` of the units ``ids``, ``IDS_PER_STATEMENT`` at a time; how many moved."""
    return sum(
        move_units(s, WorkUnit.id.in_(ids[k : k + IDS_PER_STATEMENT]), *where, from_=from_, to=to, **values)
        for k in range(0, len(ids), IDS_PER_STATEMENT)
    )


def unfinished_units(s: Session, batch_id: str) -> int:
    return (
        s.scalar(
            select(func.count())
            .select_from(WorkUnit)
            .where(WorkUnit.batch_id == batch_id, WorkUnit.status.not_in(UnitStatus.FINISHED))
        )
        or 0
    )


def finish_if_done(s: Session, batch: Batch, now: int) -> bool:
    """``in_progress`` -> ``finalizing`` once every unit has finished; True if ready to finalize."""
    if unfinished_units(s, batch.id):
        return False
    if batch.status == BatchStatus.IN_PROGRESS:
        batch.final_status = BatchStatus.COMPLETED.value
        transition(batch, BatchStatus.FINALIZING, now)
    return batch.status in (BatchStatus.FINALIZING, BatchStatus.CANCELLING)


def abort_reason(status: str, final_status: str | None) -> str | None:
    """Why a running unit of a batch in this state must stop now, as an error-line code; None to
    go on."""
    if status == BatchStatus.CANCELLING:
        return "batch_cancelled"
    if final_status == BatchStatus.EXPIRED:
        return "batch_expired"
    if status not in ACTIVE:
        return "batch_cancelled"
    return None
