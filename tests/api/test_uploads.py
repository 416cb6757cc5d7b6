"""/v1/uploads through Flask's test client on SQLite and PostgreSQL, on the local store and on S3
(SeaweedFS): a file sent in parts, out of order, joined in the order the completion names into a
file that validates into a batch; and OpenAI's refusals (another tenant's upload, a part after
completion or cancellation, an unknown or missing part, a wrong md5, an expired upload, a part
over the limit, a bad purpose or MIME type), with the parts counted against the quota."""

from __future__ import annotations

import hashlib
import io
import uuid

import pytest
from sqlalchemy import update

from api.services import uploads
from api.services.tenants import create_tenant
from storage.models import Batch, StoredFile, Tenant, Upload
from storage.objectstore import S3ObjectStore
from storage.quotas import stored_bytes
from tests.conftest import now
from tests.factories import chat_line, http_create, jsonl
from workers.cleanup import run as cleanup
from workers.validation import validate_batch

MB = 1024 * 1024


@pytest.fixture
def keys(runtime):
    a, key_a = create_tenant(runtime.db, "alpha", now())
    _, key_b = create_tenant(runtime.db, "beta", now())
    return {
        "a": {"Authorization": f"Bearer {key_a}"},
        "b": {"Authorization": f"Bearer {key_b}"},
        "tenant_a": a.id,
    }


def error_of(response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def start(client, headers, size: int, **fields) -> dict:
    body = {"bytes": size, "filename": "big.jsonl", "purpose": "batch", "mime_type": "text/jsonl", **fields}
    response = client.post("/v1/uploads", headers=headers, json=body)
    assert response.status_code == 200, response.get_data(as_text=True)
    return response.get_json()


def send_part(client, headers, upload_id: str, data: bytes):
    return client.post(
        f"/v1/uploads/{upload_id}/parts", headers=headers,
        data={"data": (io.BytesIO(data), "blob")}, content_type="multipart/form-data",
    )  # fmt: skip


def part_id(client, headers, upload_id: str, data: bytes) -> str:
    response = send_part(client, headers, upload_id, data)
    assert response.status_code == 200, response.get_data(as_text=True)
    part = response.get_json()
    assert part["object"] == "upload.part" and part["upload_id"] == upload_id
    return part["id"]


def complete(client, headers, upload_id: str, part_ids: list[str], md5: str | None = None):
    body: dict = {"part_ids": part_ids} | ({"md5": md5} if md5 else {})
    return client.post(f"/v1/uploads/{upload_id}/complete", headers=headers, json=body)


def test_parts_out_of_order_join_in_the_named_order_into_a_file_that_validates(
    runtime, client, keys, store_kind
):
    data = jsonl([chat_line(f"r{i}", f"question {i}") for i in range(30)])
    a, b, c = data[:700], data[700:1500], data[1500:]
    upload = start(client, keys["a"], len(data))
    assert upload["object"] == "upload" and upload["status"] == "pending" and upload["file"] is None
    assert upload["expires_at"] == upload["created_at"] + 3600
    ids = {}
    for name, chunk in (("c", c), ("a", a), ("b", b)):  # sent out of order
        ids[name] = part_id(client, keys["a"], upload["id"], chunk)
    done = complete(
        client, keys["a"], upload["id"], [ids["a"], ids["b"], ids["c"]], hashlib.md5(data).hexdigest()
    )
    assert done.status_code == 200, done.get_data(as_text=True)
    body = done.get_json()
    assert body["status"] == "completed" and body["id"] == upload["id"]
    file = body["file"]
    assert file["object"] == "file" and file["bytes"] == len(data) and file["purpose"] == "batch"
    assert file["filename"] == "big.jsonl"
    assert client.get(f"/v1/files/{file['id']}", headers=keys["a"]).get_json() == file
    assert client.get(f"/v1/files/{file['id']}/content", headers=keys["a"]).data == data
    assert not list(runtime.store.list(f"uploads/{keys['tenant_a']}/"))  # the parts are gone
    with runtime.db.read() as s:
        assert s.get(Upload, upload["id"]).purged_at is not None
        assert stored_bytes(s, keys["tenant_a"]) == len(data)  # the file, not the parts again
    batch = http_create(client, keys["a"], file["id"]).get_json()
    validate_batch(runtime, batch["id"])
    with runtime.db.read() as s:
        validated = s.get(Batch, batch["id"])
        assert validated.status == "in_progress" and validated.request_total == 30


def test_large_parts_on_s3_are_joined_by_the_store_itself(runtime, client, keys, s3_service):
    """Parts of 5 MiB or more are copied server-side (UploadPartCopy); the bytes are the same."""
    bucket = f"u-{uuid.uuid4().hex[:10]}"
    s3_service.create_bucket(bucket)
    runtime.store = S3ObjectStore(bucket, "freight", client=s3_service.client())
    first, second, last = b"a" * (5 * MB), b"b" * (5 * MB + 3), b"c\n" * 10
    data = first + second + last
    upload = start(client, keys["a"], len(data))
    ids = [part_id(client, keys["a"], upload["id"], chunk) for chunk in (last, first, second)]
    done = complete(client, keys["a"], upload["id"], [ids[1], ids[2], ids[0]])
    assert done.status_code == 200, done.get_data(as_text=True)
    with runtime.db.read() as s:
        key = s.get(StoredFile, done.get_json()["file"]["id"]).object_key
    with runtime.store.open(key) as stream:
        assert hashlib.md5(stream.read()).hexdigest() == hashlib.md5(data).hexdigest()


def test_another_tenants_upload_answers_404_everywhere(client, keys):
    upload = start(client, keys["a"], 10)
    pid = part_id(client, keys["a"], upload["id"], b"0123456789")
    error_of(send_part(client, keys["b"], upload["id"], b"x"), 404, param="upload_id")
    error_of(complete(client, keys["b"], upload["id"], [pid]), 404, param="upload_id")
    error_of(client.post(f"/v1/uploads/{upload['id']}/cancel", headers=keys["b"]), 404, param="upload_id")
    error_of(send_part(client, keys["a"], "upload_" + "0" * 24, b"x"), 404, param="upload_id")
    # beta's own upload cannot name alpha's part either
    other = start(client, keys["b"], 10)
    error_of(complete(client, keys["b"], other["id"], [pid]), 400, "unknown_part", "part_ids")
    assert complete(client, keys["a"], upload["id"], [pid]).get_json()["status"] == "completed"


def test_no_part_after_completion_or_cancellation(client, keys):
    upload = start(client, keys["a"], 4)
    pid = part_id(client, keys["a"], upload["id"], b"abcd")
    assert complete(client, keys["a"], upload["id"], [pid]).status_code == 200
    error_of(send_part(client, keys["a"], upload["id"], b"more"), 400, "upload_completed")
    error_of(complete(client, keys["a"], upload["id"], [pid]), 400, "upload_completed")
    error_of(client.post(f"/v1/uploads/{upload['id']}/cancel", headers=keys["a"]), 400, "upload_completed")

    cancelled = start(client, keys["a"], 4)
    part_id(client, keys["a"], cancelled["id"], b"ab")
    answer = client.post(f"/v1/uploads/{cancelled['id']}/cancel", headers=keys["a"])
    assert answer.status_code == 200 and answer.get_json()["status"] == "cancelled"
    error_of(send_part(client, keys["a"], cancelled["id"], b"cd"), 400, "upload_cancelled")
    error_of(complete(client, keys["a"], cancelled["id"], ["part_x"]), 400, "upload_cancelled")


def test_completion_refuses_unknown_missing_and_wrong_md5_and_stays_pending(runtime, client, keys):
    data = b"line one\nline two\n"
    upload = start(client, keys["a"], len(data))
    first = part_id(client, keys["a"], upload["id"], data[:9])
    second = part_id(client, keys["a"], upload["id"], data[9:])
    error_of(complete(client, keys["a"], upload["id"], [first, "part_nope"]), 400, "unknown_part", "part_ids")
    error_of(
        complete(client, keys["a"], upload["id"], [first]), 400, "bytes_mismatch", "part_ids"
    )  # one missing
    error_of(complete(client, keys["a"], upload["id"], [first, first]), 400, param="part_ids")
    error_of(complete(client, keys["a"], upload["id"], []), 400, param="part_ids")
    error_of(complete(client, keys["a"], upload["id"], [first, second], "0" * 32), 400, "md5_mismatch", "md5")
    error_of(complete(client, keys["a"], upload["id"], [first, second], "not-an-md5"), 400, param="md5")
    with runtime.db.read() as s:
        assert s.get(Upload, upload["id"]).status == "pending"
        assert s.query(StoredFile).count() == 0  # nothing was made by the refusals
    assert not list(runtime.store.list(f"files/{keys['tenant_a']}/"))
    done = complete(client, keys["a"], upload["id"], [first, second], hashlib.md5(data).hexdigest().upper())
    assert done.status_code == 200 and done.get_json()["file"]["bytes"] == len(data)


def test_an_expired_upload_takes_nothing_and_the_cleanup_deletes_its_parts(runtime, client, keys):
    upload = start(client, keys["a"], 6)
    pid = part_id(client, keys["a"], upload["id"], b"abc")
    with runtime.db.write() as s:
        s.execute(update(Upload).where(Upload.id == upload["id"]).values(expires_at=now() - 1))
    error_of(send_part(client, keys["a"], upload["id"], b"def"), 400, "upload_expired")
    error_of(complete(client, keys["a"], upload["id"], [pid]), 400, "upload_expired")
    report = cleanup(runtime, now())
    assert report.uploads_expired == [upload["id"]] and report.uploads_purged == [upload["id"]]
    assert not list(runtime.store.list(f"uploads/{keys['tenant_a']}/"))
    with runtime.db.read() as s:
        assert s.get(Upload, upload["id"]).status == "expired"
        assert stored_bytes(s, keys["tenant_a"]) == 0
    assert cleanup(runtime, now()).uploads_purged == []  # once


def test_a_part_over_the_limit_is_refused_and_not_kept(runtime, client, keys, monkeypatch):
    monkeypatch.setattr(uploads, "MAX_PART_BYTES", 1000)
    upload = start(client, keys["a"], 5000)
    error_of(send_part(client, keys["a"], upload["id"], b"x" * 1001), 413, "part_too_large", "data")
    error_of(send_part(client, keys["a"], upload["id"], b""), 400, param="data")
    assert part_id(client, keys["a"], upload["id"], b"x" * 1000)
    assert len(list(runtime.store.list(f"uploads/{keys['tenant_a']}/"))) == 1


def test_create_refuses_bad_fields(client, keys, runtime):
    good = {"bytes": 10, "filename": "a.jsonl", "purpose": "batch", "mime_type": "text/jsonl"}
    for change, param in (
        ({"purpose": "fine-tune"}, "purpose"),
        ({"mime_type": "image/png"}, "mime_type"),
        ({"mime_type": None}, "mime_type"),
        ({"bytes": 0}, "bytes"),
        ({"bytes": "10"}, "bytes"),
        ({"bytes": True}, "bytes"),
        ({"bytes": runtime.settings.max_upload_bytes + 1}, "bytes"),
        ({"filename": ""}, "filename"),
        ({"expires_after": {"anchor": "created_at", "seconds": 5}}, None),
    ):
        error_of(client.post("/v1/uploads", headers=keys["a"], json={**good, **change}), 400, param=param)
    for mime in (
        "application/jsonl",
        "application/x-ndjson",
        "text/jsonl; charset=utf-8",
        "application/vnd.apache.parquet",
    ):
        assert (
            client.post("/v1/uploads", headers=keys["a"], json={**good, "mime_type": mime}).status_code == 200
        )
    # FREIGHT_MAX_FILE_BYTES (64 kB here) does not bound an upload; FREIGHT_MAX_UPLOAD_BYTES does
    assert runtime.settings.max_file_bytes < 10 * MB
    assert start(client, keys["a"], 10 * MB)["bytes"] == 10 * MB


def test_parts_count_against_the_stored_bytes_quota_as_they_arrive(runtime, client, keys):
    with runtime.db.write() as s:
        s.execute(update(Tenant).where(Tenant.id == keys["tenant_a"]).values(quota_stored_bytes=1000))
    error_of(client.post("/v1/uploads", headers=keys["a"], json={"bytes": 1001, "filename": "a.jsonl", "purpose": "batch", "mime_type": "text/jsonl"}), 403, "quota_exceeded")  # fmt: skip
    upload = start(client, keys["a"], 900)
    first = part_id(client, keys["a"], upload["id"], b"a" * 600)
    with runtime.db.read() as s:
        assert stored_bytes(s, keys["tenant_a"]) == 600
    error_of(send_part(client, keys["a"], upload["id"], b"b" * 500), 403, "quota_exceeded")
    assert len(list(runtime.store.list(f"uploads/{keys['tenant_a']}/"))) == 1  # the refused part is not kept
    second = part_id(client, keys["a"], upload["id"], b"b" * 300)
    assert complete(client, keys["a"], upload["id"], [first, second]).status_code == 200
    with runtime.db.read() as s:
        assert stored_bytes(s, keys["tenant_a"]) == 900


def test_a_part_without_a_filename_streams_too(client, keys):
    """Raw multipart clients may send ``data`` as a plain field (no filename): it is the part."""
    upload = start(client, keys["a"], 3)
    boundary = "b0undary"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="data"\r\n\r\nabc\r\n--{boundary}--\r\n'
    ).encode()
    response = client.post(
        f"/v1/uploads/{upload['id']}/parts", headers=keys["a"], data=body,
        content_type=f"multipart/form-data; boundary={boundary}",
    )  # fmt: skip
    assert response.status_code == 200, response.get_data(as_text=True)
    assert complete(client, keys["a"], upload["id"], [response.get_json()["id"]]).status_code == 200
