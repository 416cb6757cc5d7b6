"""Batch state changes that several callers share, applied inside the caller's transaction."""

from __future__ import annotations

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from storage.models import Batch, UnitStatus, WorkUnit
from storage.status import BatchStatus, transition

# states in which a batch's units may still run
ACTIVE = (BatchStatus.VALIDATING.value, BatchStatus.IN_PROGRESS.value)


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
    s.execute(
        update(WorkUnit)
        .where(WorkUnit.batch_id == batch.id, WorkUnit.status.in_([UnitStatus.PENDING, UnitStatus.QUEUED]))
        .values(status=UnitStatus.SKIPPED, finished_at=float(now))
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
