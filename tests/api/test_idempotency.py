"""``Idempotency-Key`` on POST /v1/files and POST /v1/batches through Flask's test client, on
SQLite and PostgreSQL with a real broker and store (the uploads' on local disk and on S3): a retry answers the first answer and makes
nothing, a different request with the key is a 409 naming it, keys are per tenant, a key in flight
is a 409, a refused request frees its key, and bad keys are 400s. The live API (gunicorn, lost
answers, the official client) is tests/api/test_idempotency_live.py."""

from __future__ import annotations

import io
import threading

import pytest
from sqlalchemy import func, select

from api.services.tenants import create_tenant
from storage import idempotency
from storage.models import Batch, IdempotencyKey, StoredFile
from tests.conftest import now
from tests.factories import chat_line, http_create, http_upload, jsonl


@pytest.fixture
def keys(runtime):
    _, a = create_tenant(runtime.db, "alpha", now())
    _, b = create_tenant(runtime.db, "beta", now())
    return {"a": {"Authorization": f"Bearer {a}"}, "b": {"Authorization": f"Bearer {b}"}}


def keyed(headers: dict, key: str) -> dict:
    return {**headers, "Idempotency-Key": key}


def count(runtime, model) -> int:
    with runtime.db.read() as s:
        return int(s.scalar(select(func.count()).select_from(model)) or 0)


def stored_objects(runtime) -> list[str]:
    return sorted(runtime.store.list("files/"))


def conflict(response, code: str) -> str:
    assert response.status_code == 409, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert error["code"] == code and error["param"] == "Idempotency-Key"
    assert error["type"] == "invalid_request_error"
    return error["message"]


def test_a_retried_batch_create_answers_the_first_batch_and_makes_no_other(client, keys, runtime):
    file_id = http_upload(client, keys["a"]).get_json()["id"]
    first = http_create(client, keyed(keys["a"], "create-1"), file_id, metadata={"run": "1"})
    again = http_create(client, keyed(keys["a"], "create-1"), file_id, metadata={"run": "1"})
    assert first.status_code == again.status_code == 200
    assert again.get_json() == first.get_json() and again.data == first.data
    assert again.headers["Idempotent-Replayed"] == "true" and "Idempotent-Replayed" not in first.headers
    assert count(runtime, Batch) == 1
    # without a key, or with another, the same request makes a batch of its own
    assert (
        http_create(client, keys["a"], file_id, metadata={"run": "1"}).get_json()["id"]
        != first.get_json()["id"]
    )
    other = http_create(client, keyed(keys["a"], "create-2"), file_id, metadata={"run": "1"})
    assert other.get_json()["id"] != first.get_json()["id"] and count(runtime, Batch) == 3


def test_the_same_key_with_another_request_is_a_409_naming_it(client, keys, runtime):
    file_id = http_upload(client, keys["a"]).get_json()["id"]
    assert http_create(client, keyed(keys["a"], "k-1"), file_id).status_code == 200
    message = conflict(
        http_create(client, keyed(keys["a"], "k-1"), file_id, priority=3), "idempotency_key_reused"
    )
    assert "'k-1'" in message
    # the key of a batch create sent with a file upload: another path
    conflict(http_upload(client, keyed(keys["a"], "k-1")), "idempotency_key_reused")
    assert count(runtime, Batch) == 1 and count(runtime, StoredFile) == 1


def test_keys_are_per_tenant(client, keys, runtime):
    a_file = http_upload(client, keys["a"]).get_json()["id"]
    b_file = http_upload(client, keys["b"]).get_json()["id"]
    a = http_create(client, keyed(keys["a"], "shared"), a_file).get_json()
    b = http_create(client, keyed(keys["b"], "shared"), b_file).get_json()
    assert a["id"] != b["id"] and b["input_file_id"] == b_file
    assert http_create(client, keyed(keys["b"], "shared"), b_file).get_json() == b
    assert count(runtime, Batch) == 2


def test_a_retried_upload_answers_the_first_file_and_stores_nothing_more(client, keys, runtime, store_kind):
    data = jsonl([chat_line("a"), chat_line("b")])
    first = http_upload(client, keyed(keys["a"], "up-1"), data)  # each post draws its own boundary
    objects = stored_objects(runtime)
    again = http_upload(client, keyed(keys["a"], "up-1"), data)
    assert first.status_code == again.status_code == 200 and again.get_json() == first.get_json()
    assert count(runtime, StoredFile) == 1 and len(objects) == 1 and stored_objects(runtime) == objects
    conflict(
        http_upload(client, keyed(keys["a"], "up-1"), data + jsonl([chat_line("c")])),
        "idempotency_key_reused",
    )
    conflict(
        http_upload(client, keyed(keys["a"], "up-1"), data, name="other.jsonl"), "idempotency_key_reused"
    )
    assert count(runtime, StoredFile) == 1 and stored_objects(runtime) == objects


def test_a_refused_request_frees_its_key(client, keys, runtime):
    refused = http_create(client, keyed(keys["a"], "retry-me"), "file-nothere")
    assert refused.status_code == 404
    assert count(runtime, IdempotencyKey) == 0
    assert http_upload(client, keyed(keys["a"], "too-small"), b"").status_code == 400
    assert count(runtime, IdempotencyKey) == 0
    file_id = http_upload(client, keys["a"]).get_json()["id"]
    # the same key, now with a request that succeeds
    assert http_create(client, keyed(keys["a"], "retry-me"), file_id).status_code == 200
    assert count(runtime, IdempotencyKey) == 1


def test_a_key_in_flight_is_a_409_and_runs_nothing(client, keys, runtime):
    tenant_id = _tenant_of(runtime, "alpha")
    running = idempotency.claim(runtime.db, tenant_id, "busy", now())
    assert isinstance(running, idempotency.Claim)
    file_id = http_upload(client, keys["a"]).get_json()["id"]
    message = conflict(http_create(client, keyed(keys["a"], "busy"), file_id), "idempotency_key_in_use")
    assert "'busy'" in message
    conflict(http_upload(client, keyed(keys["a"], "busy")), "idempotency_key_in_use")
    assert count(runtime, Batch) == 0 and count(runtime, StoredFile) == 1


def _tenant_of(runtime, name: str) -> str:
    from storage.models import Tenant

    with runtime.db.read() as s:
        return str(s.scalar(select(Tenant.id).where(Tenant.name == name)))


@pytest.mark.parametrize(
    ("key", "why"),
    [("k" * 256, "1 to 255 characters"), ("", "1 to 255 characters"), ("tab\there", "control"),
     ("bell\x07", "control"), ("del\x7f", "control")],
)  # fmt: skip
def test_a_bad_key_is_a_400(client, keys, runtime, key, why):
    file_id = http_upload(client, keys["a"]).get_json()["id"]
    for response in (
        http_create(client, keyed(keys["a"], key), file_id),
        http_upload(client, keyed(keys["a"], key)),
    ):
        assert response.status_code == 400, response.get_data(as_text=True)
        error = response.get_json()["error"]
        assert error["code"] == "invalid_idempotency_key" and error["param"] == "Idempotency-Key"
        assert why in error["message"]
    assert count(runtime, Batch) == 0 and count(runtime, StoredFile) == 1


def test_a_key_of_255_characters_works(client, keys, runtime):
    key = "é" + "k" * 254
    file_id = http_upload(client, keys["a"]).get_json()["id"]
    first = http_create(client, keyed(keys["a"], key), file_id)
    assert first.status_code == 200
    assert http_create(client, keyed(keys["a"], key), file_id).get_json() == first.get_json()


def test_concurrent_creates_with_one_key_make_one_batch(app, keys, runtime):
    file_id = http_upload(app.test_client(), keys["a"]).get_json()["id"]
    answers: list = []
    start = threading.Barrier(4)

    def create() -> None:
        client = app.test_client()
        start.wait()
        answers.append(http_create(client, keyed(keys["a"], "together"), file_id))

    threads = [threading.Thread(target=create) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert count(runtime, Batch) == 1
    made = {a.get_json()["id"] for a in answers if a.status_code == 200}
    assert len(made) == 1 and made == {runtime_batch_id(runtime)}
    for answer in answers:
        if answer.status_code != 200:
            conflict(answer, "idempotency_key_in_use")


def runtime_batch_id(runtime) -> str:
    with runtime.db.read() as s:
        return str(s.scalar(select(Batch.id)))


def test_a_dry_run_replays_its_estimate(client, keys, runtime):
    file_id = http_upload(client, keys["a"]).get_json()["id"]
    first = http_create(client, keyed(keys["a"], "price"), file_id, dry_run=True)
    assert first.status_code == 200 and first.get_json()["id"].startswith("estimate_")
    assert (
        http_create(client, keyed(keys["a"], "price"), file_id, dry_run=True).get_json()["id"]
        == first.get_json()["id"]
    )


def test_a_json_body_is_compared_as_json(client, keys, runtime):
    file_id = http_upload(client, keys["a"]).get_json()["id"]
    texts = [
        f'{{"input_file_id": "{file_id}", "endpoint": "/v1/chat/completions", "completion_window": "24h"}}',
        f'{{"completion_window":"24h","endpoint":"/v1/chat/completions","input_file_id":"{file_id}"}}',
    ]
    answers = [
        client.post(
            "/v1/batches", headers=keyed(keys["a"], "spaced"), data=text, content_type="application/json"
        )
        for text in texts
    ]
    assert answers[0].status_code == answers[1].status_code == 200
    assert answers[1].get_json() == answers[0].get_json() and count(runtime, Batch) == 1


def test_an_uploads_create_parts_and_complete_retried_with_their_keys_are_made_once(
    client, keys, runtime, store_kind
):
    from storage.models import Upload, UploadPart

    data = jsonl([chat_line(f"r{i}") for i in range(6)])
    first, second = data[: len(data) // 2], data[len(data) // 2 :]
    body = {"bytes": len(data), "filename": "big.jsonl", "purpose": "batch", "mime_type": "text/jsonl"}
    created = [client.post("/v1/uploads", headers=keyed(keys["a"], "up"), json=body) for _ in range(2)]
    assert created[0].status_code == 200 and created[1].get_json() == created[0].get_json()
    upload_id = created[0].get_json()["id"]
    assert count(runtime, Upload) == 1

    def part(key: str, chunk: bytes):
        return client.post(
            f"/v1/uploads/{upload_id}/parts", headers=keyed(keys["a"], key),
            data={"data": (io.BytesIO(chunk), "blob")}, content_type="multipart/form-data",
        )  # fmt: skip

    parts = [part("part-1", first), part("part-1", first), part("part-2", second)]
    assert [p.status_code for p in parts] == [200, 200, 200]
    assert parts[1].get_json() == parts[0].get_json() and parts[1].headers["Idempotent-Replayed"] == "true"
    conflict(part("part-1", second), "idempotency_key_reused")  # the key with another part's bytes
    assert count(runtime, UploadPart) == 2
    ids = [parts[0].get_json()["id"], parts[2].get_json()["id"]]
    done = [
        client.post(
            f"/v1/uploads/{upload_id}/complete", headers=keyed(keys["a"], "done"), json={"part_ids": ids}
        )
        for _ in range(2)
    ]
    assert done[0].status_code == done[1].status_code == 200
    assert done[1].get_json() == done[0].get_json() and done[0].get_json()["status"] == "completed"
    assert count(runtime, StoredFile) == 1
    assert client.get(f"/v1/files/{done[0].get_json()['file']['id']}/content", headers=keys["a"]).data == data
