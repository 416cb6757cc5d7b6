"""The ledger of a batch's objects beyond its file rows (storage.object_ledger): charged once per
object at its latest size, counted in the tenant's stored bytes, released when the batch's data
is purged, on SQLite and PostgreSQL and on the local store and S3."""

from __future__ import annotations

from sqlalchemy import update

from api.services.tenants import create_tenant
from storage.models import Batch
from storage.object_ledger import charge_bytes, charge_listed, charged_bytes, release_batch, release_bytes
from storage.quotas import stored_bytes
from storage.retention import purge_batch_data, validated_prefixes
from storage.runtime import Runtime
from storage.status import BatchStatus
from tests import factories
from tests.conftest import now
from tests.factories import chat_line, jsonl


def test_an_object_is_charged_once_at_its_latest_size_and_released(runtime: Runtime) -> None:
    alpha, _ = create_tenant(runtime.db, "alpha", now())
    beta, _ = create_tenant(runtime.db, "beta", now())
    with runtime.db.write() as s:
        charge_bytes(s, alpha.id, "batches/b1/units/000000.1.output.jsonl", 700, batch_id="b1")
        charge_bytes(s, alpha.id, "batches/b1/units/000000.1.output.jsonl", 900, batch_id="b1")  # again
        charge_bytes(s, alpha.id, "batches/b2/shards/000000.parquet", 50, batch_id="b2")
        charge_bytes(s, alpha.id, "derived/file-x.parquet", 30)  # an object of no batch
        charge_bytes(s, beta.id, "batches/b3/shards/000000.parquet", 5_000, batch_id="b3")
    with runtime.db.read() as s:
        assert charged_bytes(s, alpha.id) == 980
        assert stored_bytes(s, alpha.id) == 980  # no files: the ledger is all it stores
        assert charged_bytes(s, beta.id) == 5_000
    with runtime.db.write() as s:
        assert release_batch(s, "b1") == 900
        release_bytes(s, "derived/file-x.parquet")
        release_bytes(s, "derived/never-charged")  # nothing to release is no error
    with runtime.db.read() as s:
        assert charged_bytes(s, alpha.id) == 50 and charged_bytes(s, beta.id) == 5_000


def test_a_batch_charged_as_listed_is_released_by_its_purge(runtime: Runtime, store_kind: str) -> None:
    """What validation left (shards, images, audio) is charged as the store lists it, its sorted
    runs are not (scratch), and the purge of the final batch deletes and releases all of it."""
    alpha, _ = create_tenant(runtime.db, "alpha", now())
    data = jsonl([chat_line()])
    batch = factories.upload_and_create(runtime, alpha.id, data)
    objects = {
        f"batches/{batch.id}/shards/000000.parquet": 4_000,
        f"batches/{batch.id}/images/ab12": 1_500,
        f"batches/{batch.id}/audio/cd34": 2_500,
        f"batches/{batch.id}/validation/run-0": 9_000,  # scratch: not charged
    }
    for key, size in objects.items():
        runtime.store.put_chunks(key, [b"x" * size])
    assert charge_listed(runtime, batch.id, validated_prefixes(batch.id)) == 8_000
    assert charge_listed(runtime, batch.id, validated_prefixes(batch.id)) == 8_000  # listed again: once
    with runtime.db.read() as s:
        assert stored_bytes(s, alpha.id) == len(data) + 8_000

    with runtime.db.write() as s:
        s.execute(
            update(Batch).where(Batch.id == batch.id).values(status=BatchStatus.COMPLETED, completed_at=now())
        )
    assert purge_batch_data(runtime, batch.id, now()) == 4
    assert list(runtime.store.list(f"batches/{batch.id}/")) == []
    with runtime.db.read() as s:
        assert stored_bytes(s, alpha.id) == len(data)  # the input file alone
