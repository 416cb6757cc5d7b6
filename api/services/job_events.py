"""A batch's event timeline for the console's job page, read from what the system records anyway:
the batch's state stamps (``created_at``, ``in_progress_at``, ``cancelling_at``, ...) and its work
units' own columns (``enqueued_at``, ``started_at``, ``finished_at``, ``attempts``, ``status``,
``note``). No event table is written for it.

Bounded: unit events are counted by the database per time bucket (GROUP BY over the batch's own
units, through the ``work_units.batch_id`` index), never read row by row, and the bucket grows with
the batch's span so a kind of unit event yields at most ``MAX_BUCKETS`` rows; the timeline shown is
then cut to ``MAX_EVENTS`` (the first and the latest, with a line saying how many were left out).
A batch of 10,000 units gives the same few dozen lines as one of ten.

What the rows cannot say: a unit's ``enqueued_at`` and ``started_at`` are those of its latest
delivery, and a lost worker's name and the moment it was found lost are not kept (the unit goes
back to pending without them). So a redelivery shows as "units restarted after a lost worker"
(attempts > 1) at the start of the attempt that followed, and units given up after repeated
losses at the time they were failed, with the dispatcher's note.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from sqlalchemy import ColumnElement, Float, case, cast, func, select
from sqlalchemy.orm import Session

from storage.models import Batch, UnitStatus, WorkUnit
from storage.status import BatchStatus

MAX_BUCKETS = 30  # time buckets per kind of unit event
MAX_EVENTS = 60  # lines of one timeline; the rest are counted in one "left out" line
MIN_BUCKET_SECONDS = 60.0


@dataclass(frozen=True)
class Event:
    at: float  # epoch seconds (a unit bucket: its first event's time)
    kind: str  # created, validated, dispatched, started, restarted, finished, skipped, gave_up, ...
    label: str
    detail: str = ""
    until: float | None = None  # a unit bucket's last event, when later than its first


@dataclass(frozen=True)
class Timeline:
    events: tuple[Event, ...]
    left_out: int  # events not shown: they were between events[gap - 1] and events[gap]
    gap: int
    bucket_seconds: float  # how unit events were grouped


def _units(first: int, last: int, n: int) -> str:
    """Units by 1-based number: ``unit 3``, ``units 1-40`` (all of them), ``12 units in 1-40``."""
    if n == 1:
        return f"unit {first + 1}"
    if last - first + 1 == n:
        return f"units {first + 1}-{last + 1}"
    return f"{n} units in {first + 1}-{last + 1}"


def _bucketed(
    s: Session,
    batch_id: str,
    column: ColumnElement[float] | object,
    start: float,
    width: float,
    *where: ColumnElement[bool],
) -> list[tuple[float, float, int, int, int]]:
    """(first time, last time, units, lowest seq, highest seq) per bucket of ``column``, oldest
    first."""
    col = cast(column, Float)
    bucket = func.floor((col - start) / width)
    rows = s.execute(
        select(func.min(col), func.max(col), func.count(), func.min(WorkUnit.seq), func.max(WorkUnit.seq))
        .where(WorkUnit.batch_id == batch_id, col.is_not(None), *where)
        .group_by(bucket)
        .order_by(func.min(col))
        .limit(MAX_BUCKETS + 1)  # a clock set back could make more; the cap holds regardless
    ).all()
    return [(float(at), float(last), int(n), int(lo), int(hi)) for at, last, n, lo, hi in rows]


def bucket_seconds(start: float, end: float) -> float:
    """A bucket width that splits [start, end] into at most ``MAX_BUCKETS``: whole minutes."""
    span = max(0.0, end - start)
    return max(MIN_BUCKET_SECONDS, math.ceil(span / MAX_BUCKETS / 60.0) * 60.0)


def _batch_events(b: Batch, units: int) -> list[Event]:
    events = [Event(float(b.created_at), "created", "created", "input uploaded, validation queued")]
    if b.in_progress_at is not None:
        detail = f"{b.request_total:,} requests in {units:,} work units"
        events.append(Event(float(b.in_progress_at), "validated", "validated", detail))
    if b.cancelling_at is not None:
        events.append(
            Event(float(b.cancelling_at), "cancel", "cancel requested", "units not started are skipped")
        )
    if b.finalizing_at is not None:
        if b.final_status == BatchStatus.EXPIRED:
            events.append(
                Event(float(b.finalizing_at), "expired", "window ended", "unfinished requests expire")
            )
        events.append(Event(float(b.finalizing_at), "finalizing", "finalizing", "assembling output files"))
    for status, column in (
        (BatchStatus.COMPLETED, b.completed_at),
        (BatchStatus.EXPIRED, b.expired_at),
        (BatchStatus.CANCELLED, b.cancelled_at),
        (BatchStatus.FAILED, b.failed_at),
    ):
        if column is not None:
            detail = "validation failed" if status == BatchStatus.FAILED and b.in_progress_at is None else ""
            events.append(Event(float(column), "final", f"finalized: {status}", detail))
    return events


def timeline(s: Session, b: Batch, now: float) -> Timeline:
    """The batch's events, oldest first, at most ``MAX_EVENTS`` of them (see the module's notes)."""
    start = float(b.in_progress_at or b.created_at)
    width = bucket_seconds(start, float(b.finished_at or now))
    units = int(s.scalar(select(func.count()).select_from(WorkUnit).where(WorkUnit.batch_id == b.id)) or 0)
    events = _batch_events(b, units)
    unit_kinds: list[tuple[str, str, object, tuple[ColumnElement[bool], ...]]] = [
        ("dispatched", "dispatched", WorkUnit.enqueued_at, ()),
        ("restarted", "restarted after a lost worker", WorkUnit.started_at, (WorkUnit.attempts > 1,)),
        ("finished", "finished", WorkUnit.finished_at, (WorkUnit.status == UnitStatus.DONE,)),
        ("skipped", "skipped (never ran)", WorkUnit.finished_at, (WorkUnit.status == UnitStatus.SKIPPED,)),
        ("gave_up", "failed", WorkUnit.finished_at, (WorkUnit.status == UnitStatus.FAILED,)),
    ]
    for kind, verb, column, where in unit_kinds:
        for at, last, n, lo, hi in _bucketed(s, b.id, column, start, width, *where):
            events.append(Event(at, kind, f"{_units(lo, hi, n)} {verb}", until=last if last > at else None))
    notes = s.execute(
        select(WorkUnit.note, func.count())
        .where(WorkUnit.batch_id == b.id, WorkUnit.status == UnitStatus.FAILED, WorkUnit.note.is_not(None))
        .group_by(WorkUnit.note)
        .limit(5)
    ).all()
    if notes:  # why units were given up: "worker lost 3 times", "pack failed: ..."
        why = "; ".join(f"{note} ({n})" for note, n in notes)
        events = [replace(e, detail=why) if e.kind == "gave_up" else e for e in events]
    order = {"created": 0, "validated": 1, "cancel": 2, "expired": 2, "finalizing": 8, "final": 9}
    events.sort(key=lambda e: (e.at, order.get(e.kind, 5)))
    left_out = max(0, len(events) - MAX_EVENTS)
    head = MAX_EVENTS // 3
    if left_out:  # the start and the latest are what an operator looks for
        events = events[:head] + events[len(events) - (MAX_EVENTS - head) :]
    return Timeline(tuple(events), left_out, head if left_out else len(events), width)


def stopped_at(b: Batch) -> int | None:
    """When a cancel or the window's end stopped the batch (epoch seconds); None if neither did."""
    if b.cancelling_at is not None:
        return b.cancelling_at
    return b.finalizing_at if b.final_status == BatchStatus.EXPIRED else None


def stopped_requests(s: Session, stopped: Iterable[Batch]) -> dict[str, int]:
    """Of cancelled or expired batches, the requests the stop kept from running, per batch id: those
    of their skipped units, and the failures of units that finished after the stop (their
    unfinished requests end as ``batch_cancelled`` / ``batch_expired`` lines). A request that
    failed on its own in a unit the stop cut short is counted here too: the unit's row does not
    tell them apart. One GROUP BY over these batches' units (a page of the jobs list is one
    query); batches that were not stopped are left out (0)."""
    ids = [b.id for b in stopped if stopped_at(b) is not None]
    if not ids:
        return {}
    stop = case((Batch.cancelling_at.is_not(None), Batch.cancelling_at), else_=Batch.finalizing_at)
    cut_short = (WorkUnit.status == UnitStatus.DONE) & (WorkUnit.finished_at >= stop)
    rows = s.execute(
        select(
            WorkUnit.batch_id,
            func.sum(case((WorkUnit.status == UnitStatus.SKIPPED, WorkUnit.n_requests), else_=0)),
            func.sum(case((cut_short, WorkUnit.failed), else_=0)),
        )
        .join(Batch, Batch.id == WorkUnit.batch_id)
        .where(WorkUnit.batch_id.in_(ids))
        .group_by(WorkUnit.batch_id)
    ).all()
    return {batch_id: int(skipped or 0) + int(cut or 0) for batch_id, skipped, cut in rows}
