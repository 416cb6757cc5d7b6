"""A create with ``Idempotency-Key`` whose process dies after the create committed and before its
answer was recorded, retried with the key: the retry answers the object made (same id, as it is
now, ``Idempotent-Replayed: true``) and nothing is made twice, however long after; the key with
another request is still a 409. Through Flask's test client on SQLite and PostgreSQL, the files'
and parts' on the local store and on S3 (SeaweedFS). The death is the request's end at the
answer's record (``storage.idempotency.complete`` raising, as nothing after it would run); the
same with a real API process SIGKILLed there is tests/api/test_idempotency_live.py."""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import func, select

from api.services.tenants import create_tenant
from storage import idempotency
from storage.errors import ServiceError
from storage.models import Batch, Estimate, IdempotencyKey, StoredFile, Upload, UploadPart
from tests.conftest import now
from tests.factories import chat_line, http_create, http_upload, jsonl
from workers import intake


class ProcessDied(BaseException):
    """The API process's death: nothing of the request runs after it."""


def die(*args: Any, **kwargs: Any) -> bool:
    raise ProcessDied


def crashed(request: Callable[[], Any]) -> None:
    """Send ``request`` (a test client call) from a process that dies once its create has
    committed, before the answer is recorded: the client never gets an answer."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(idempotency, "complete", die)
        with pytest.raises(ProcessDied):
            request()


@pytest.fixture
def tenant(runtime) -> tuple[str, dict]:
    tenant_row, key = create_tenant(runtime.db, "alpha", now())
    return tenant_row.id, {"Authorization": f"Bearer {key}"}


def keyed(headers: dict, key: str) -> dict:
    return {**headers, "Idempotency-Key": key}


def ids(runtime, model) -> list[str]:
    with runtime.db.read() as s:
        return list(s.scalars(select(model.id)))


def key_status(runtime, key: str) -> str | None:
    with runtime.db.read() as s:
        return s.scalar(select(IdempotencyKey.status).where(IdempotencyKey.key == key))


def replayed(response) -> dict:
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.headers["Idempotent-Replayed"] == "true"
    return response.get_json()


def test_a_file_upload_retried_after_a_crash_answers_the_file_it_made(client, tenant, runtime, store_kind):
    tenant_id, auth = tenant
    data = jsonl([chat_line("a"), chat_line("b")])
    crashed(lambda: http_upload(client, keyed(auth, "f"), data))  # each post draws its own boundary
    [file_id] = ids(runtime, StoredFile)
    objects = sorted(runtime.store.list("files/"))
    assert key_status(runtime, "f") == "created" and len(objects) == 1
    first = replayed(http_upload(client, keyed(auth, "f"), data))
    assert first["id"] == file_id and first["bytes"] == len(data) and first["filename"] == "in.jsonl"
    assert replayed(http_upload(client, keyed(auth, "f"), data)) == first
    # the key with other bytes, or another file name: its misuse, refused
    for other in (
        http_upload(client, keyed(auth, "f"), data + data),
        http_upload(client, keyed(auth, "f"), data, "x.jsonl"),
    ):
        assert other.status_code == 409 and other.get_json()["error"]["code"] == "idempotency_key_reused"
    assert ids(runtime, StoredFile) == [file_id] and sorted(runtime.store.list("files/")) == objects
    assert client.get(f"/v1/files/{file_id}/content", headers=auth).data == data
    # never taken over, as a key whose process died before making anything is after 15 minutes
    later = idempotency.claim(runtime.db, tenant_id, "f", time.time() + idempotency.ABANDONED_SECONDS + 60)
    assert isinstance(later, idempotency.Created) and later.object_id == file_id


def test_a_batch_create_retried_after_a_crash_answers_the_batch_as_it_is_now(client, tenant, runtime):
    _, auth = tenant
    file_id = http_upload(client, auth).get_json()["id"]
    crashed(lambda: http_create(client, keyed(auth, "b"), file_id, metadata={"run": "1"}))
    [batch_id] = ids(runtime, Batch)
    again = replayed(http_create(client, keyed(auth, "b"), file_id, metadata={"run": "1"}))
    assert again["id"] == batch_id and again["status"] == "validating" and again["metadata"] == {"run": "1"}
    client.post(f"/v1/batches/{batch_id}/cancel", headers=auth)
    # the object as it is now: cancelled since (the first answer was never recorded)
    assert replayed(http_create(client, keyed(auth, "b"), file_id, metadata={"run": "1"}))["status"] in (
        "cancelling",
        "cancelled",
    )
    refused = http_create(client, keyed(auth, "b"), file_id, metadata={"run": "2"})
    assert refused.status_code == 409 and refused.get_json()["error"]["code"] == "idempotency_key_reused"
    assert ids(runtime, Batch) == [batch_id]


def test_a_dry_run_retried_after_a_crash_answers_its_estimate(client, tenant, runtime):
    _, auth = tenant
    file_id = http_upload(client, auth).get_json()["id"]
    crashed(lambda: http_create(client, keyed(auth, "price"), file_id, dry_run=True))
    [estimate_id] = ids(runtime, Estimate)
    assert replayed(http_create(client, keyed(auth, "price"), file_id, dry_run=True))["id"] == estimate_id
    assert ids(runtime, Estimate) == [estimate_id] and ids(runtime, Batch) == []


def test_an_upload_its_parts_and_completion_retried_after_crashes_are_made_once(
    client, tenant, runtime, store_kind
):
    _, auth = tenant
    data = jsonl([chat_line(f"r{i}") for i in range(6)])
    halves = data[: len(data) // 2], data[len(data) // 2 :]
    body = {"bytes": len(data), "filename": "big.jsonl", "purpose": "batch", "mime_type": "text/jsonl"}
    crashed(lambda: client.post("/v1/uploads", headers=keyed(auth, "up"), json=body))
    [upload_id] = ids(runtime, Upload)
    assert replayed(client.post("/v1/uploads", headers=keyed(auth, "up"), json=body))["status"] == "pending"

    def part(key: str, chunk: bytes):
        return client.post(
            f"/v1/uploads/{upload_id}/parts", headers=keyed(auth, key),
            data={"data": (io.BytesIO(chunk), "blob")}, content_type="multipart/form-data",
        )  # fmt: skip

    crashed(lambda: part("p1", halves[0]))
    [first_part] = ids(runtime, UploadPart)
    assert replayed(part("p1", halves[0]))["id"] == first_part
    assert part("p1", halves[1]).status_code == 409  # the key with the other part's bytes
    second_part = part("p2", halves[1]).get_json()["id"]
    assert sorted(ids(runtime, UploadPart)) == sorted([first_part, second_part])
    complete = {"part_ids": [first_part, second_part]}
    crashed(
        lambda: client.post(f"/v1/uploads/{upload_id}/complete", headers=keyed(auth, "done"), json=complete)
    )
    [file_id] = ids(runtime, StoredFile)
    done = replayed(
        client.post(f"/v1/uploads/{upload_id}/complete", headers=keyed(auth, "done"), json=complete)
    )
    assert done["status"] == "completed" and done["file"]["id"] == file_id
    # the upload's create retried now answers it as it is now: completed, with its file
    assert replayed(client.post("/v1/uploads", headers=keyed(auth, "up"), json=body))["file"]["id"] == file_id
    assert ids(runtime, StoredFile) == [file_id] and ids(runtime, Upload) == [upload_id]
    assert client.get(f"/v1/files/{file_id}/content", headers=auth).data == data


def test_a_create_whose_key_was_taken_over_meanwhile_makes_nothing(tenant, runtime):
    """A request that ran past ``ABANDONED_SECONDS`` lost its key to a retry: its create rolls
    back at the commit rather than make a second object beside the retry's."""
    tenant_id, _ = tenant
    file_id = intake.upload(runtime, tenant_id, "batch", "in.jsonl", io.BytesIO(jsonl([chat_line()]))).id
    slow = idempotency.claim(runtime.db, tenant_id, "slow", time.time())
    assert isinstance(slow, idempotency.Claim)
    retry = idempotency.claim(runtime.db, tenant_id, "slow", time.time() + idempotency.ABANDONED_SECONDS + 1)
    assert isinstance(retry, idempotency.Claim) and retry != slow
    create = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    with (
        idempotency.creating(tenant_id, "slow", slow, lambda: ("0" * 64, None)),
        pytest.raises(ServiceError) as refused,
    ):
        intake.create(runtime, tenant_id, create)
    assert refused.value.code == "idempotency_key_in_use"
    assert ids(runtime, Batch) == []
    with idempotency.creating(tenant_id, "slow", retry, lambda: ("1" * 64, None)):
        made = intake.create(runtime, tenant_id, create)
    assert ids(runtime, Batch) == [made.id] and key_status(runtime, "slow") == "created"
    with runtime.db.read() as s:
        assert s.scalar(select(func.count()).select_from(IdempotencyKey)) == 1
