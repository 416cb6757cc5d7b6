"""The dispatcher against a real database and broker (no engine): packing across batches and
tenants, and re-sending packs whose message went with a dead worker."""

from __future__ import annotations

import io
import json
from dataclasses import replace

from sqlalchemy import select

from api.services import batches, files
from api.services.tenants import create_tenant
from scheduler import dispatcher
from storage.models import UnitStatus, WorkUnit
from tests.conftest import now
from workers.runtime import Runtime
from workers.validation import validate_batch


def submit(rt: Runtime, tenant_id: str, n: int, tag: str) -> str:
    lines = [
        {"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": f"{tag} {i}"}]}}
        for i in range(n)
    ]  # fmt: skip
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    stored = files.upload(rt, tenant_id, "batch", f"{tag}.jsonl", io.BytesIO(data))
    batch = batches.create(rt, tenant_id, {"input_file_id": stored.id, "endpoint": "/v1/chat/completions"})
    validate_batch(rt, batch.id)
    return batch.id


def units(rt: Runtime) -> list[WorkUnit]:
    with rt.db.read() as s:
        return list(s.scalars(select(WorkUnit).order_by(WorkUnit.id)).all())


def test_small_batches_are_packed_together_and_lost_packs_are_sent_again(settings):  # type: ignore[no-untyped-def]
    rt = Runtime(replace(settings, unit_size=4, pack_requests=12, queue_depth=1, lease_seconds=30))
    try:
        a, _ = create_tenant(rt.db, "a", now())
        b, _ = create_tenant(rt.db, "b", now())
        ids = [submit(rt, a.id, 4, "a1"), submit(rt, b.id, 4, "b1"), submit(rt, a.id, 8, "a2")]
        t0 = float(now())
        report = dispatcher.tick(rt, t0)
        assert len(report.packs) == 1 and len(report.enqueued) == 3  # depth 1: one pack of 12
        queued = [u for u in units(rt) if u.status == UnitStatus.QUEUED]
        tenant_of = {ids[0]: "a", ids[1]: "b", ids[2]: "a"}
        assert {tenant_of[u.batch_id] for u in queued} == {"a", "b"}  # tenants share the pack
        assert len({u.batch_id for u in queued}) >= 2
        assert len({u.pack_id for u in queued}) == 1
        # nothing changes while the pack may still be in the broker queue
        assert dispatcher.tick(rt, t0 + 10).requeued == []
        # a lease later (no throughput measured yet) the message counts as lost: packed again
        report = dispatcher.tick(rt, t0 + 31)
        assert sorted(report.requeued) == sorted(u.id for u in queued)
        again = [u for u in units(rt) if u.status == UnitStatus.QUEUED]
        assert {u.id for u in again} == {u.id for u in queued} and again[0].pack_id != queued[0].pack_id
        assert all(u.attempts == 0 for u in again)
    finally:
        rt.db.dispose()
