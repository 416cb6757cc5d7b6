"""Finalization counts only recorded units: a unit that was running when it was released, lost or
given up may still hold the live counts its heartbeats wrote for results that were discarded."""

from __future__ import annotations

from sqlalchemy import update

from storage.models import Batch, UnitStatus, WorkUnit
from storage.runtime import Runtime
from storage.status import BatchStatus
from tests.workers.test_finalize_release import validated_batch
from workers.finalize import finalize_batch


def test_stale_live_counts_are_not_counted(settings):
    rt = Runtime(settings)
    try:
        batch_id = validated_batch(rt, requests=4)
        with rt.db.write() as s:  # a heartbeat had counted 3 results, then the run was given back
            s.execute(
                update(WorkUnit)
                .where(WorkUnit.batch_id == batch_id)
                .values(status=UnitStatus.SKIPPED, completed=3, failed=1)
            )
            s.execute(update(Batch).where(Batch.id == batch_id).values(status=BatchStatus.CANCELLING))
        assert finalize_batch(rt, batch_id) == BatchStatus.CANCELLED
        with rt.db.read() as s:
            row = s.get(Batch, batch_id)
            assert (row.request_completed, row.request_failed) == (0, 4)
    finally:
        rt.db.dispose()
