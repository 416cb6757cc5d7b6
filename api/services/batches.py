"""Batches, the tenant's side after intake: read, list with live counts, cancel. (Creating one is
``workers.intake``: the API, the console and the drop folders share it.)"""

from __future__ import annotations

import time
from collections.abc import Iterable

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.services.paging import Page, page
from storage.errors import ServiceError
from storage.lifecycle import stop_batch
from storage.models import Batch, UnitStatus, WorkUnit
from storage.runtime import Runtime
from storage.status import BatchStatus


def get(rt: Runtime, tenant_id: str, batch_id: str) -> Batch:
    with rt.db.read() as s:
        return owned(s, tenant_id, batch_id)


def get_with_progress(rt: Runtime, tenant_id: str, batch_id: str) -> tuple[Batch, tuple[int, int]]:
    """The batch and its running units' (completed, failed) so far (see ``running_counts``)."""
    with rt.db.read() as s:
        batch = owned(s, tenant_id, batch_id)
        return batch, running_counts(s, [batch]).get(batch.id, (0, 0))


def owned(s: Session, tenant_id: str, batch_id: str) -> Batch:
    """The tenant's batch, in ``s``; another tenant's is not found, as one that does not exist."""
    batch = s.get(Batch, batch_id)
    if batch is None or batch.tenant_id != tenant_id:
        raise ServiceError("not_found", f"No such Batch object: {batch_id}", param="batch_id")
    return batch


def list_batches(
    rt: Runtime, tenant_id: str, after: str | None, limit: int
) -> tuple[Page, dict[str, tuple[int, int]]]:
    """A page of the tenant's batches and their running units' counts, in one read transaction
    (clients poll this: every transaction it saves is CPU the engines keep)."""
    with rt.db.read() as s:
        result = page(s, Batch, tenant_id, after, limit)
        return result, running_counts(s, result.rows)


def running_counts(s: Session, batches: Iterable[Batch]) -> dict[str, tuple[int, int]]:
    """(completed, failed) so far in each batch's running units, from their heartbeats.

    ``Batch.request_completed`` counts finished units only; adding these makes request_counts
    move within a unit (a unit of a few hundred long requests can run for minutes)."""
    ids = [b.id for b in batches if b.status in (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING)]
    if not ids:
        return {}
    rows = s.execute(
        select(WorkUnit.batch_id, func.sum(WorkUnit.completed), func.sum(WorkUnit.failed))
        .where(WorkUnit.batch_id.in_(ids), WorkUnit.status == UnitStatus.RUNNING)
        .group_by(WorkUnit.batch_id)
    ).all()
    return {batch_id: (int(done or 0), int(failed or 0)) for batch_id, done, failed in rows}


def cancel(rt: Runtime, tenant_id: str, batch_id: str) -> Batch:
    now = int(time.time())
    with rt.db.write() as s:
        batch = s.get(Batch, batch_id, with_for_update=True)
        if batch is None or batch.tenant_id != tenant_id:
            raise ServiceError("not_found", f"No such Batch object: {batch_id}", param="batch_id")
        if batch.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            return batch
        if batch.status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
            raise ServiceError(
                "conflict",
                f"Cannot cancel a batch with status {batch.status}.",
                param="batch_id",
                code="batch_not_cancellable",
            )
        stop_batch(s, batch, BatchStatus.CANCELLING, now)
    rt.queue.finalize(batch_id)  # a no-op while units still run; the dispatcher retries
    return batch
