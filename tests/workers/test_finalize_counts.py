"""Finalization counts only recorded units: a unit that was running when it was released, lost or
given up may still hold the live counts its heartbeats wrote for results that were discarded."""

from __future__ import annotations

import io
import json

from sqlalchemy import update

from api.services import batches, files
from api.services.tenants import create_tenant
from storage.models import Batch, UnitStatus, WorkUnit
from storage.status import BatchStatus
from tests.conftest import now
from workers.finalize import finalize_batch
from workers.runtime import Runtime
from workers.validation import validate_batch


def test_stale_live_counts_are_not_counted(settings):  # type: ignore[no-untyped-def]
    rt = Runtime(settings)
    try:
        tenant, _ = create_tenant(rt.db, "a", now())
        lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": f"{i}"}]}}
                 for i in range(4)]  # fmt: skip
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        stored = files.upload(rt, tenant.id, "batch", "f.jsonl", io.BytesIO(data))
        batch = batches.create(
            rt, tenant.id, {"input_file_id": stored.id, "endpoint": "/v1/chat/completions"}
        )
        validate_batch(rt, batch.id)
        with rt.db.write() as s:  # a heartbeat had counted 3 results, then the run was given back
            s.execute(
                update(WorkUnit)
                .where(WorkUnit.batch_id == batch.id)
                .values(status=UnitStatus.SKIPPED, completed=3, failed=1)
            )
            s.execute(update(Batch).where(Batch.id == batch.id).values(status=BatchStatus.CANCELLING))
        assert finalize_batch(rt, batch.id) == BatchStatus.CANCELLED
        with rt.db.read() as s:
            row = s.get(Batch, batch.id)
            assert (row.request_completed, row.request_failed) == (0, len(lines))
    finally:
        rt.db.dispose()
