"""A finalization the object store cannot complete hands its lease back at once, so the next
dispatcher tick retries it instead of waiting for the lease to run out."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from sqlalchemy import update

from api.services.tenants import create_tenant
from storage.leases import FINALIZER_LEASE
from storage.models import Batch, UnitStatus, WorkUnit
from storage.objectstore import ObjectStoreError
from storage.runtime import Runtime
from storage.status import BatchStatus
from tests import factories
from tests.conftest import now
from tests.factories import chat_line
from workers.finalize import _Lease, finalize_batch


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


def test_a_finalizer_whose_lease_was_taken_over_neither_renews_nor_releases_it(settings):
    """The finalizer's token is the time it took or last renewed its lease: once its lease ran out
    and another finalizer took it, its renewal and its release leave the new holder's alone (they
    were raw UPDATEs that took the lease back, then cleared it)."""
    lease = 0.4
    rt = Runtime(replace(settings, lease_seconds=lease))
    try:
        batch_id = validated_batch(rt)
        with rt.db.write() as s:
            s.execute(update(Batch).where(Batch.id == batch_id).values(status=BatchStatus.FINALIZING))
        taken = time.time() - lease / 2  # over a quarter of the lease has gone: a renewal is due
        with rt.db.write() as s:
            assert FINALIZER_LEASE.take(s, batch_id, taken, now=taken, lease_seconds=lease)
        mine = _Lease(rt, batch_id, taken)
        mine.renew_if_due()  # under its own token: renewed, and the token moves with it
        assert not mine.lost and mine.token > taken
        with rt.db.read() as s:
            assert s.get(Batch, batch_id).finalizer_heartbeat_at == mine.token

        later = mine.token + 2 * lease  # the lease ran out (a stalled finalizer): another takes it
        with rt.db.write() as s:
            assert FINALIZER_LEASE.take(s, batch_id, later, now=later, lease_seconds=lease)
        time.sleep(lease / 2)  # the stalled one's renewal is due again
        mine.renew_if_due()
        mine.release()
        assert mine.lost
        with rt.db.read() as s:
            assert s.get(Batch, batch_id).finalizer_heartbeat_at == later
    finally:
        rt.db.dispose()
