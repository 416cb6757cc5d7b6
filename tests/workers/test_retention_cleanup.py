"""File expiry and the periodic cleanup against SeaweedFS: an expired input and its batch's output
and error files, the batch's Parquet shards and unit results are really gone from the bucket, and
the rows answer as they should afterwards (files 404, the batch still readable)."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest
from sqlalchemy import func, select, update

from api.app import create_app
from api.services.tenants import create_tenant
from storage.models import Batch, StoredFile, UnitStatus, WorkUnit
from storage.runtime import Runtime
from storage.status import BatchStatus
from tests import factories
from tests.conftest import now
from tests.factories import chat_line
from workers import cleanup
from workers.finalize import finalize_batch
from workers.validation import validate_batch

HOUR = 3600


@pytest.fixture
def s3_rt(settings, s3_service, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "freight")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "freight")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    bucket = s3_service.create_bucket(f"ret-{uuid.uuid4().hex[:10]}")
    rt = Runtime(
        replace(settings, object_store_url=f"s3://{bucket}/freight", s3_endpoint_url=s3_service.endpoint_url)
    )
    rt.bucket = bucket  # type: ignore[attr-defined]
    yield rt
    rt.db.dispose()


def bucket_keys(s3_service, bucket: str) -> set[str]:
    listed = s3_service.client().list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"].removeprefix("freight/") for o in listed}


def finished_batch(rt: Runtime, tenant_id: str) -> str:
    """A batch that ran (unit results written as an engine worker writes them) and was finalized;
    its input expires after an hour, and so do its output files."""
    source = factories.upload(rt, tenant_id, [chat_line(f"r{i}", max_tokens=2) for i in range(3)])
    with rt.db.write() as s:  # what intake.upload does with expires_after
        s.get(StoredFile, source.id).expires_at = source.created_at + HOUR
    batch = factories.create(
        rt, tenant_id, source.id, output_expires_after={"anchor": "created_at", "seconds": HOUR}
    )
    validate_batch(rt, batch.id)
    with rt.db.write() as s:
        for unit in s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch.id)):
            base = f"batches/{batch.id}/units/{unit.seq:06d}.1"
            rt.store.put_chunks(f"{base}.output.jsonl", [b'{"custom_id": "r0"}\n'])
            rt.store.put_chunks(f"{base}.errors.jsonl", [b'{"custom_id": "r1"}\n'])
            unit.status, unit.output_key, unit.error_key = (
                UnitStatus.DONE,
                f"{base}.output.jsonl",
                f"{base}.errors.jsonl",
            )
            unit.completed = 1
        s.execute(update(Batch).where(Batch.id == batch.id).values(status=BatchStatus.FINALIZING.value))
    assert finalize_batch(rt, batch.id) == BatchStatus.COMPLETED
    return batch.id


def test_expired_files_and_old_batch_data_are_gone_from_the_bucket(s3_rt, s3_service):
    rt = s3_rt
    tenant, key = create_tenant(rt.db, "alpha", now())
    batch_id = finished_batch(rt, tenant.id)
    with rt.db.read() as s:
        batch = s.get(Batch, batch_id)
        output = s.get(StoredFile, batch.output_file_id)
        errors = s.get(StoredFile, batch.error_file_id)
        source = s.get(StoredFile, batch.input_file_id)
    assert output.expires_at == output.created_at + HOUR and errors.expires_at == errors.created_at + HOUR
    before = bucket_keys(s3_service, rt.bucket)
    shards = {k for k in before if k.startswith(f"batches/{batch_id}/shards/")}
    units = {k for k in before if k.startswith(f"batches/{batch_id}/units/")}
    assert shards and units and {source.object_key, output.object_key, errors.object_key} <= before

    # not yet expired, not yet past retention: the cleanup leaves everything
    report = cleanup.run(rt, now())
    assert not report.files_expired and not report.batches_purged
    assert bucket_keys(s3_service, rt.bucket) == before

    later = now() + HOUR + 1  # the files expired; the batch ended less than a day before
    report = cleanup.run(rt, later)
    assert set(report.files_expired) == {source.id, output.id, errors.id}
    assert report.batches_purged == [batch_id]  # its input is gone: its shards held those prompts
    assert bucket_keys(s3_service, rt.bucket) == set()

    # the rows answer: the files are gone, the batch is still there with its figures
    client = create_app(runtime=rt).test_client()
    headers = {"Authorization": f"Bearer {key}"}
    for file_id in (source.id, output.id, errors.id):
        assert client.get(f"/v1/files/{file_id}", headers=headers).status_code == 404
        assert client.get(f"/v1/files/{file_id}/content", headers=headers).status_code == 404
    assert client.get("/v1/files", headers=headers).get_json()["data"] == []
    shown = client.get(f"/v1/batches/{batch_id}", headers=headers).get_json()
    assert shown["status"] == "completed" and shown["request_counts"]["total"] == 3
    with rt.db.read() as s:
        assert s.get(Batch, batch_id).purged_at == later
        assert all(s.get(StoredFile, f).deleted_at == later for f in (source.id, output.id, errors.id))

    assert cleanup.run(rt, later + 10).files_expired == []  # nothing twice


def test_batch_data_expires_after_retention_and_file_delete_purges(s3_rt, s3_service):
    rt = s3_rt
    tenant, key = create_tenant(rt.db, "alpha", now())
    kept = finished_batch(rt, tenant.id)
    deleted = finished_batch(rt, tenant.id)
    with rt.db.write() as s:  # these files are kept a long time: only the batch data ages out
        s.execute(update(StoredFile).values(expires_at=None))
        input_of_deleted = s.get(Batch, deleted).input_file_id

    # deleting an input file takes its batches' shards and unit results at once
    client = create_app(runtime=rt).test_client()
    response = client.delete(f"/v1/files/{input_of_deleted}", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200
    left = bucket_keys(s3_service, rt.bucket)
    assert not {
        k
        for k in left
        if k.startswith(f"batches/{deleted}/shards/") or k.startswith(f"batches/{deleted}/units/")
    }
    assert {k for k in left if k.startswith(f"batches/{kept}/shards/")}

    # a day after it ended, the other batch's data goes too; its output files stay
    report = cleanup.run(rt, now() + rt.settings.batch_data_retention_seconds + 1)
    assert report.batches_purged == [kept]
    left = bucket_keys(s3_service, rt.bucket)
    assert not {k for k in left if "/shards/" in k or "/units/" in k}
    assert f"batches/{kept}/output.jsonl" in left and f"batches/{kept}/errors.jsonl" in left


def test_an_expired_input_waits_for_its_running_batch(runtime):
    tenant, _ = create_tenant(runtime.db, "alpha", now())
    batch_id = factories.validated_batch(runtime, tenant.id, [chat_line()])
    with runtime.db.write() as s:
        source = s.get(StoredFile, s.get(Batch, batch_id).input_file_id)
        source.expires_at = now() - 1
        source_id, source_key = source.id, source.object_key
    assert cleanup.run(runtime, now()).files_expired == []
    assert runtime.store.exists(source_key)
    with runtime.db.write() as s:
        s.execute(update(Batch).where(Batch.id == batch_id).values(status=BatchStatus.CANCELLED.value))
    assert cleanup.run(runtime, now()).files_expired == [source_id]
    assert not runtime.store.exists(source_key)


def test_expired_console_sessions_are_deleted_and_live_ones_kept(runtime) -> None:
    from api.services import sessions
    from storage.models import ApiKey, ConsoleSession

    tenant, _ = create_tenant(runtime.db, "alpha", now())
    with runtime.db.read() as s:
        key_id = s.scalar(select(ApiKey.id).where(ApiKey.tenant_id == tenant.id))
    # a sign-in deletes its tenant's expired rows; one whose tenant never signs in again is left
    fresh = sessions.start(runtime.db, tenant.id, key_id, now(), HOUR)
    old = sessions.start(runtime.db, tenant.id, key_id, now() - 2 * HOUR, HOUR)
    report = cleanup.run(runtime, now())
    assert report.sessions_ended == 1
    with runtime.db.read() as s:
        assert s.scalar(select(func.count()).select_from(ConsoleSession)) == 1
    assert sessions.resume(runtime.db, fresh, now()) is not None
    assert sessions.resume(runtime.db, old, now()) is None


def test_a_lost_estimate_fails_and_finished_ones_go_after_retention(runtime) -> None:
    """An estimate whose task never ran is failed once a validation time limit old (it would
    otherwise stay ``validating`` for ever), a young one is left to its task, and finished ones
    are deleted FREIGHT_ESTIMATE_RETENTION_SECONDS (a day, not the files' 30 days) after they
    finished."""
    from storage.models import Estimate
    from storage.status import EstimateStatus

    tenant, _ = create_tenant(runtime.db, "alpha", now())
    limit = runtime.settings.validation_time_limit_seconds
    keep = runtime.settings.estimate_retention_seconds
    assert keep == 86400 < runtime.settings.file_retention_seconds
    t = now()
    rows = {
        "lost": (EstimateStatus.VALIDATING, t - limit - 5, None),
        "young": (EstimateStatus.VALIDATING, t - 5, None),
        "old": (EstimateStatus.COMPLETED, t - keep - 10, t - keep - 5),
        "recent": (EstimateStatus.FAILED, t - 10, t - 5),
    }
    ids = {}
    with runtime.db.write() as s:
        for name, (status, created, finished) in rows.items():
            row = Estimate(tenant_id=tenant.id, input_file_id="file-x", endpoint="/v1/chat/completions",
                           completion_window="24h", price_multiplier=1.0, status=status,
                           created_at=created, finished_at=finished)  # fmt: skip
            s.add(row)
            s.flush()
            ids[name] = row.id
    report = cleanup.run(runtime, t)
    assert (report.estimates_lost, report.estimates_pruned) == (1, 1)
    with runtime.db.read() as s:
        left = {row.id: row for row in s.scalars(select(Estimate))}
    assert set(left) == {ids["lost"], ids["young"], ids["recent"]}
    lost = left[ids["lost"]]
    assert lost.status == EstimateStatus.FAILED and lost.finished_at == t
    assert lost.errors["data"][0]["code"] == "estimate_lost"
    assert "ask again" in lost.errors["data"][0]["message"]
    assert left[ids["young"]].status == EstimateStatus.VALIDATING
    assert cleanup.run(runtime, t).estimates_lost == 0  # nothing twice


def test_idempotency_keys_go_once_past_their_24_hours(runtime) -> None:
    from storage import idempotency
    from storage.models import IdempotencyKey

    tenant, _ = create_tenant(runtime.db, "alpha", now())
    t = now()
    for key, at in [("old", t - idempotency.KEY_SECONDS - 1), ("new", t - 60)]:
        claimed = idempotency.claim(runtime.db, tenant.id, key, at)
        assert isinstance(claimed, idempotency.Claim)
        idempotency.complete(runtime.db, tenant.id, key, claimed, "d" * 64, 200, "{}")
    assert cleanup.run(runtime, t).keys_pruned == 1
    with runtime.db.read() as s:
        assert list(s.scalars(select(IdempotencyKey.key))) == ["new"]
