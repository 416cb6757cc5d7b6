"""A finalization the object store cannot complete hands its lease back at once, so the next
dispatcher tick retries it instead of waiting for the lease to run out."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sqlalchemy import update

from api.services.tenants import create_tenant
from storage.models import Batch, UnitStatus, WorkUnit
from storage.objectstore import ObjectStoreError
from storage.runtime import Runtime
from storage.status import BatchStatus
from tests import factories
from tests.conftest import now
from tests.factories import chat_line
from workers.finalize import finalize_batch


def validated_batch(rt: Runtime, requests: int = 4) -> str:
    """A tenant's batch of small chat requests, validated into units (no engine)."""
    tenant, _ = create_tenant(rt.db, "a", now())
    lines = [chat_line(f"r{i}", f"{i}", max_tokens=2) for i in range(requests)]
    return factories.validated_batch(rt, tenant.id, lines, name="f.jsonl")


def test_a_failed_finalization_releases_its_lease(settings):
    rt = Runtime(settings)
    try:
        batch_id = validated_batch(rt)
        with rt.db.write() as s:  # cancelled before any unit ran: finalization writes stopped lines
            s.execute(update(WorkUnit).where(WorkUnit.batch_id == batch_id).values(status=UnitStatus.SKIPPED))
            s.execute(update(Batch).where(Batch.id == batch_id).values(status=BatchStatus.CANCELLING))
    finally:
        rt.db.dispose()

    # the same database, an object store nobody answers at, and no time to retry
    dead = Runtime(replace(settings, object_store_url="s3://freight/x", s3_endpoint_url="http://127.0.0.1:1",
                           object_store_retry_seconds=0))  # fmt: skip
    try:
        with pytest.raises(ObjectStoreError):
            finalize_batch(dead, batch_id)
        with dead.db.read() as s:
            row = s.get(Batch, batch_id)
            assert row.status == BatchStatus.CANCELLING and row.finalizer_heartbeat_at is None
    finally:
        dead.db.dispose()
    # and the store back: the next attempt finalizes
    rt = Runtime(settings)
    try:
        assert finalize_batch(rt, batch_id) == BatchStatus.CANCELLED
    finally:
        rt.db.dispose()
