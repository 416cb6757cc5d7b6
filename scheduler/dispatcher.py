"""The dispatcher: applies the planning decisions to the database and the broker.

Run by the periodic ``freight.tick`` task and, for promptness, right after events that free
queue room (validation done, unit done). Safe to run concurrently with itself: every state
change is a compare-and-set, so a unit is queued once and a batch finalized once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sqlalchemy import func, or_, select, update

from scheduler.lifecycle import finish_if_done, stop_batch
from scheduler.planning import PendingUnit, RunningUnit, plan_enqueue, plan_redelivery
from storage.models import Batch, UnitStatus, WorkUnit
from storage.status import BatchStatus
from workers.runtime import Runtime

log = logging.getLogger(__name__)


@dataclass
class TickReport:
    expired: list[str] = field(default_factory=list)
    redelivered: list[int] = field(default_factory=list)
    given_up: list[int] = field(default_factory=list)
    enqueued: list[int] = field(default_factory=list)
    finalizing: list[str] = field(default_factory=list)


def tick(rt: Runtime, now: float) -> TickReport:
    report = TickReport()
    expire_overdue(rt, int(now), report)
    redeliver_stale(rt, now, report)
    enqueue_units(rt, now, report)
    start_finalization(rt, int(now), report)
    return report


def expire_overdue(rt: Runtime, now: int, report: TickReport) -> None:
    with rt.db.write() as s:
        overdue = s.scalars(
            select(Batch)
            .where(
                Batch.status.in_([BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS]), Batch.expires_at <= now
            )
            .with_for_update()
        ).all()
        for batch in overdue:
            stop_batch(s, batch, BatchStatus.EXPIRED, now)
            report.expired.append(batch.id)
    for batch_id in report.expired:
        log.warning("batch %s expired", batch_id)


def redeliver_stale(rt: Runtime, now: float, report: TickReport) -> None:
    with rt.db.write() as s:
        rows = s.execute(
            select(WorkUnit.id, WorkUnit.model, WorkUnit.heartbeat_at, WorkUnit.attempts).where(
                WorkUnit.status == UnitStatus.RUNNING
            )
        ).all()
        retry, give_up = plan_redelivery(
            (RunningUnit(*row) for row in rows), now, rt.settings.lease_seconds, rt.settings.max_unit_attempts
        )
        for unit in retry:
            changed = s.execute(
                update(WorkUnit)
                .where(WorkUnit.id == unit.unit_id, WorkUnit.status == UnitStatus.RUNNING)
                .values(status=UnitStatus.QUEUED, worker=None, enqueued_at=now)
            ).rowcount
            if changed:
                report.redelivered.append(unit.unit_id)
        for unit in give_up:
            s.execute(
                update(WorkUnit)
                .where(WorkUnit.id == unit.unit_id, WorkUnit.status == UnitStatus.RUNNING)
                .values(status=UnitStatus.FAILED, finished_at=now, note=f"worker lost {unit.attempts} times")
            )
            report.given_up.append(unit.unit_id)
    models = {u.unit_id: u.model for u in retry}
    for unit_id in report.redelivered:
        log.warning("unit %s lost its worker; redelivering", unit_id)
        rt.queue.run_unit(unit_id, models[unit_id])


def enqueue_units(rt: Runtime, now: float, report: TickReport) -> None:
    """Keep each model's broker queue ``queue_depth`` units deep, earliest deadline first."""
    sends: list[tuple[int, str]] = []
    with rt.db.write() as s:
        queued = dict(
            s.execute(
                select(WorkUnit.model, func.count())
                .where(WorkUnit.status == UnitStatus.QUEUED)
                .group_by(WorkUnit.model)
            ).all()
        )
        pending = s.execute(
            select(WorkUnit.id, WorkUnit.model, Batch.expires_at, Batch.created_at, WorkUnit.seq)
            .join(Batch, Batch.id == WorkUnit.batch_id)
            .where(WorkUnit.status == UnitStatus.PENDING, Batch.status == BatchStatus.IN_PROGRESS)
            .order_by(Batch.expires_at, Batch.created_at, WorkUnit.seq)
            .limit(1000)
        ).all()
        for unit in plan_enqueue((PendingUnit(*row) for row in pending), queued, rt.settings.queue_depth):
            changed = s.execute(
                update(WorkUnit)
                .where(WorkUnit.id == unit.unit_id, WorkUnit.status == UnitStatus.PENDING)
                .values(status=UnitStatus.QUEUED, enqueued_at=now)
            ).rowcount
            if changed:
                sends.append((unit.unit_id, unit.model))
    # after the commit: a task never refers to a row state that might roll back
    for unit_id, model in sends:
        rt.queue.run_unit(unit_id, model)
        report.enqueued.append(unit_id)


def start_finalization(rt: Runtime, now: int, report: TickReport) -> None:
    with rt.db.write() as s:
        candidates = s.scalars(
            select(Batch)
            .where(
                Batch.status.in_([BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING]),
                # a finalizer holding a fresh lease is already on it; do not send it another
                or_(
                    Batch.finalizer_heartbeat_at.is_(None),
                    Batch.finalizer_heartbeat_at < now - rt.settings.lease_seconds,
                ),
            )
            .with_for_update()
        ).all()
        ready = [b.id for b in candidates if finish_if_done(s, b, now)]
    for batch_id in ready:
        rt.queue.finalize(batch_id)
        report.finalizing.append(batch_id)
