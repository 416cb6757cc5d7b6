"""Per-tenant quotas at intake and validation: stored bytes, open batches, queued requests. A tenant
over a limit gets ``quota_exceeded`` naming the limit and its current use; others are not held."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
from sqlalchemy import select, update

from api.app import create_app
from api.services import files
from api.services.tenants import create_tenant, set_quota
from storage.errors import ServiceError
from storage.models import Batch, StoredFile
from storage.quotas import queued_requests
from storage.runtime import Runtime
from storage.status import BatchStatus
from tests import factories
from tests.conftest import now
from tests.factories import chat_line, jsonl


@pytest.fixture
def quota_rt(settings):
    rt = Runtime(replace(settings, quota_stored_bytes=100_000, quota_open_batches=2, quota_queued_requests=5))
    yield rt
    rt.db.dispose()


def stored_keys(rt: Runtime, tenant_id: str) -> list[str]:
    return list(rt.store.list(f"files/{tenant_id}/"))


def test_stored_bytes_quota_refuses_past_the_limit_and_keeps_nothing(quota_rt):
    alpha, _ = create_tenant(quota_rt.db, "alpha", now())
    beta, _ = create_tenant(quota_rt.db, "beta", now())
    set_quota(quota_rt.db, "alpha", {"quota_stored_bytes": "1000"})  # its own limit, under the default
    first = factories.upload(quota_rt, alpha.id, b"x" * 600)
    with pytest.raises(ServiceError) as refused:
        factories.upload(quota_rt, alpha.id, b"y" * 600)
    assert refused.value.code == "quota_exceeded" and refused.value.kind == "forbidden"
    assert "1,000 bytes" in refused.value.message and "current use 600 bytes" in refused.value.message
    assert len(stored_keys(quota_rt, alpha.id)) == 1  # the refused upload left no object behind
    factories.upload(quota_rt, beta.id, b"z" * 600)  # another tenant's use and limit are its own
    factories.upload(quota_rt, beta.id, b"z" * 600)

    # deleting frees the room; 0 is unlimited
    files.delete(quota_rt, alpha.id, first.id)
    factories.upload(quota_rt, alpha.id, b"y" * 600)
    set_quota(quota_rt.db, "alpha", {"quota_stored_bytes": "0"})
    factories.upload(quota_rt, alpha.id, b"y" * 5000)


def test_open_batches_quota(quota_rt):
    alpha, _ = create_tenant(quota_rt.db, "alpha", now())
    data = jsonl([chat_line()])
    first = factories.upload_and_create(quota_rt, alpha.id, data)
    factories.upload_and_create(quota_rt, alpha.id, data)
    source = factories.upload(quota_rt, alpha.id, data)
    with pytest.raises(ServiceError) as refused:
        factories.create(quota_rt, alpha.id, source.id)
    assert refused.value.code == "quota_exceeded"
    assert (
        "open batches is limited to 2" in refused.value.message and "current use 2" in refused.value.message
    )
    with quota_rt.db.write() as s:  # one ends: room for another
        s.execute(update(Batch).where(Batch.id == first.id).values(status=BatchStatus.CANCELLED.value))
    factories.create(quota_rt, alpha.id, source.id)


def test_queued_requests_quota_fails_the_batch_that_would_pass_it(quota_rt):
    alpha, _ = create_tenant(quota_rt.db, "alpha", now())
    set_quota(quota_rt.db, "alpha", {"quota_open_batches": "10"})
    running = factories.validated_batch(quota_rt, alpha.id, [chat_line(f"r{i}") for i in range(4)])
    over = factories.validated_batch(quota_rt, alpha.id, [chat_line(f"s{i}") for i in range(2)])
    with quota_rt.db.read() as s:
        assert s.get(Batch, running).status == BatchStatus.IN_PROGRESS
        refused = s.get(Batch, over)
        assert refused.status == BatchStatus.FAILED
        (error,) = refused.errors["data"]
        assert error["code"] == "quota_exceeded"
        assert "queued requests is limited to 5" in error["message"] and "current use 4" in error["message"]
        assert "this batch has 2 requests" in error["message"]
    # one more request fits
    fits = factories.validated_batch(quota_rt, alpha.id, [chat_line("t0")])
    with quota_rt.db.read() as s:
        assert s.get(Batch, fits).status == BatchStatus.IN_PROGRESS
    # and at the limit no new batch is taken at all
    with pytest.raises(ServiceError) as at_limit:
        factories.upload_and_create(quota_rt, alpha.id, [chat_line()])
    assert at_limit.value.code == "quota_exceeded" and "queued requests" in at_limit.value.message


def test_queued_requests_count_the_sequences_a_line_asks_for(quota_rt):
    """Issue #49 part 4: one line of n=4 is 4 queued requests, so a tenant cannot queue n times
    the work of another under the same limit: with 3 queued, a batch of one n=3 line is refused
    (3 + 3 > 5) where a line of n=2 still fits (3 + 2 = 5)."""
    alpha, _ = create_tenant(quota_rt.db, "alpha", now())
    set_quota(quota_rt.db, "alpha", {"quota_open_batches": "10"})
    running = factories.validated_batch(quota_rt, alpha.id, [chat_line("r0", n=3)])
    over = factories.validated_batch(quota_rt, alpha.id, [chat_line("s0", n=3)])
    fits = factories.validated_batch(quota_rt, alpha.id, [chat_line("t0", n=2)])
    with quota_rt.db.read() as s:
        assert s.get(Batch, running).status == BatchStatus.IN_PROGRESS
        refused = s.get(Batch, over)
        assert refused.status == BatchStatus.FAILED
        (error,) = refused.errors["data"]
        assert "current use 3" in error["message"] and "this batch has 3 requests" in error["message"]
        assert s.get(Batch, fits).status == BatchStatus.IN_PROGRESS
        assert queued_requests(s, alpha.id) == 5
    with pytest.raises(ServiceError) as at_limit:
        factories.upload_and_create(quota_rt, alpha.id, [chat_line()])
    assert "current use 5" in at_limit.value.message


def test_quota_over_http_is_a_403_with_the_figures(quota_rt):
    _, key = create_tenant(quota_rt.db, "alpha", now())
    set_quota(quota_rt.db, "alpha", {"quota_stored_bytes": "1000"})
    client = create_app(runtime=quota_rt).test_client()
    headers = {"Authorization": f"Bearer {key}"}
    assert factories.http_upload(client, headers, b"a" * 900).status_code == 200
    response = factories.http_upload(client, headers, b"b" * 200)
    assert response.status_code == 403, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert error["code"] == "quota_exceeded" and error["param"] == "file"
    assert "1,000 bytes" in error["message"] and "900 bytes" in error["message"]


def test_console_upload_over_quota_leaves_no_file(quota_rt):
    """The console stores the file and creates its batch in one call: a refused batch takes its
    stored file with it."""
    from api.services.console import submit

    alpha, _ = create_tenant(quota_rt.db, "alpha", now())
    data = jsonl([chat_line()])
    for _ in range(2):
        submit(quota_rt, alpha.id, "in.jsonl", io.BytesIO(data), "/v1/chat/completions", "demo", "24h", None)
    with pytest.raises(ServiceError) as refused:
        submit(quota_rt, alpha.id, "in.jsonl", io.BytesIO(data), "/v1/chat/completions", "demo", "24h", None)
    assert refused.value.code == "quota_exceeded"
    with quota_rt.db.read() as s:
        assert len(s.scalars(select(StoredFile)).all()) == 2
    assert len(stored_keys(quota_rt, alpha.id)) == 2
