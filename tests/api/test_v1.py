"""The /v1 API through Flask's test client, on SQLite and PostgreSQL, with a real Redis broker.

No worker runs here: these tests pin the HTTP contract (shapes, status codes, auth, isolation,
pagination). The end-to-end tests run the same API with workers and vLLM.
"""

from __future__ import annotations

import io

import pytest

from api.app import create_app
from api.services.tenants import create_tenant
from tests.conftest import now
from tests.factories import chat_line, http_create, http_upload, jsonl

BATCH_FIELDS = {
    "id", "object", "endpoint", "model", "errors", "input_file_id", "completion_window", "status",
    "output_file_id", "error_file_id", "created_at", "in_progress_at", "expires_at", "finalizing_at",
    "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at", "request_counts",
    "metadata", "usage", "x_freight",
}  # fmt: skip


@pytest.fixture
def keys(runtime):
    _, a = create_tenant(runtime.db, "alpha", now())
    _, b = create_tenant(runtime.db, "beta", now())
    return {"a": {"Authorization": f"Bearer {a}"}, "b": {"Authorization": f"Bearer {b}"}}


def assert_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


ROUTES = [
    ("get", "/v1/files"), ("post", "/v1/files"), ("get", "/v1/files/file-x"),
    ("get", "/v1/files/file-x/content"), ("delete", "/v1/files/file-x"),
    ("get", "/v1/batches"), ("post", "/v1/batches"), ("get", "/v1/batches/batch_x"),
    ("post", "/v1/batches/batch_x/cancel"), ("get", "/v1/models"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize("header", [None, "Bearer fk-wrong", "Basic abc", "Bearer "])
def test_every_route_needs_a_valid_key(client, keys, method, path, header):
    headers = {"Authorization": header} if header else {}
    error = assert_error(getattr(client, method)(path, headers=headers), 401)
    assert error["type"] == "authentication_error"


def test_file_round_trip(client, keys):
    data = jsonl([chat_line("a"), chat_line("b")])
    created = http_upload(client, keys["a"], data, name="../../etc/passwd\x00.jsonl").get_json()
    assert created["object"] == "file" and created["bytes"] == len(data) and created["purpose"] == "batch"
    assert "/" not in created["filename"] and "\x00" not in created["filename"]
    assert client.get(f"/v1/files/{created['id']}", headers=keys["a"]).get_json() == created
    content = client.get(f"/v1/files/{created['id']}/content", headers=keys["a"])
    assert content.status_code == 200 and content.data == data
    listed = client.get("/v1/files", headers=keys["a"]).get_json()
    assert [f["id"] for f in listed["data"]] == [created["id"]] and listed["has_more"] is False
    deleted = client.delete(f"/v1/files/{created['id']}", headers=keys["a"]).get_json()
    assert deleted == {"id": created["id"], "object": "file", "deleted": True}
    assert_error(client.get(f"/v1/files/{created['id']}", headers=keys["a"]), 404)
    assert client.get("/v1/files", headers=keys["a"]).get_json()["data"] == []


def test_upload_errors(client, keys):
    assert_error(client.post("/v1/files", headers=keys["a"], data={"purpose": "batch"}), 400, "file")
    assert_error(
        client.post("/v1/files", headers=keys["a"], data={"purpose": "fine-tune", "file": (io.BytesIO(b"x"), "a")}),
        400, "purpose",
    )  # fmt: skip
    assert_error(http_upload(client, keys["a"], b""), 400, "file")
    too_big = b"x" * (64 * 1024 + 1)  # the fixture's max_file_bytes is 64 KiB
    assert http_upload(client, keys["a"], too_big).status_code == 413
    assert client.get("/v1/files", headers=keys["a"]).get_json()["data"] == []


def test_batch_create_and_object_shape(client, keys):
    file_id = http_upload(client, keys["a"]).get_json()["id"]
    response = http_create(client, keys["a"], file_id, metadata={"project": "evals"}, priority=7)
    batch = response.get_json()
    assert response.status_code == 200, batch
    assert set(batch) == BATCH_FIELDS
    assert batch["object"] == "batch" and batch["status"] == "validating"
    assert batch["metadata"] == {"project": "evals"}
    assert batch["expires_at"] - batch["created_at"] == 86400
    assert batch["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert batch["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    assert batch["x_freight"] == {
        "priority": 7, "deadline": batch["expires_at"], "eta": None, "at_risk": False,
        "at_risk_since": None, "sla_met": None, "warnings": [], "cache_hit_rate": None,
        "planned_cache_hit_rate": None,
        "cost": {
            "currency": "usd", "engine_seconds": 0.0, "engine_cost": 0.0, "price_multiplier": 1.0,
            "total": 0.0,
            "per_1m_tokens": {"input": None, "cached_input": None, "output": None, "all": None},
            "list_price": None, "saving": None,
        },
        "resumed_from": None, "chain_usage": None,
    }  # fmt: skip
    assert client.get(f"/v1/batches/{batch['id']}", headers=keys["a"]).get_json() == batch


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"completion_window": "2h"}, 400, "completion_window"),
        ({"completion_window": 24}, 400, "completion_window"),
        ({"endpoint": "/v1/moderations"}, 400, "endpoint"),
        ({"input_file_id": "file-nope"}, 404, "input_file_id"),
        ({"input_file_id": None}, 400, "input_file_id"),
        ({"metadata": {"k": 1}}, 400, "metadata.k"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
        ({"metadata": "text"}, 400, "metadata"),
        ({"priority": 101}, 400, "priority"),
        ({"priority": "high"}, 400, "priority"),
        ({"priority": True}, 400, "priority"),
    ],
)
def test_batch_create_errors(client, keys, change, status, param):
    file_id = http_upload(client, keys["a"]).get_json()["id"]
    payload = {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        **change,
    }
    assert_error(client.post("/v1/batches", headers=keys["a"], json=payload), status, param)


def test_batch_create_needs_a_json_object(client, keys):
    assert_error(client.post("/v1/batches", headers=keys["a"], data="not json"), 400)
    assert_error(client.post("/v1/batches", headers=keys["a"], json=[1, 2]), 400)


def test_tenants_cannot_see_each_other(client, keys):
    file_id = http_upload(client, keys["a"]).get_json()["id"]
    batch_id = http_create(client, keys["a"], file_id).get_json()["id"]
    b = keys["b"]
    assert_error(client.get(f"/v1/files/{file_id}", headers=b), 404)
    assert_error(client.get(f"/v1/files/{file_id}/content", headers=b), 404)
    assert_error(client.delete(f"/v1/files/{file_id}", headers=b), 404)
    assert_error(client.get(f"/v1/batches/{batch_id}", headers=b), 404)
    assert_error(client.post(f"/v1/batches/{batch_id}/cancel", headers=b), 404)
    assert_error(http_create(client, b, file_id), 404, "input_file_id")
    assert_error(client.get(f"/v1/batches?after={batch_id}", headers=b), 400, "after")
    assert client.get("/v1/files", headers=b).get_json()["data"] == []
    assert client.get("/v1/batches", headers=b).get_json()["data"] == []
    # and the owner still sees everything untouched
    assert client.get(f"/v1/batches/{batch_id}", headers=keys["a"]).get_json()["status"] == "validating"


def test_batch_pagination(client, keys):
    file_id = http_upload(client, keys["a"]).get_json()["id"]
    made = [http_create(client, keys["a"], file_id).get_json()["id"] for _ in range(23)]
    newest_first = list(reversed(made))
    first = client.get("/v1/batches", headers=keys["a"]).get_json()
    assert len(first["data"]) == 20 and first["has_more"] is True
    assert first["first_id"] == first["data"][0]["id"] and first["last_id"] == first["data"][-1]["id"]
    seen, after = [], None
    while True:
        query = "?limit=7" + (f"&after={after}" if after else "")
        page = client.get(f"/v1/batches{query}", headers=keys["a"]).get_json()
        seen += [b["id"] for b in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert sorted(seen) == sorted(newest_first) and len(seen) == len(set(seen)) == 23
    created = [client.get(f"/v1/batches/{i}", headers=keys["a"]).get_json()["created_at"] for i in seen]
    assert created == sorted(created, reverse=True)
    for bad in ("0", "101", "x"):
        assert_error(client.get(f"/v1/batches?limit={bad}", headers=keys["a"]), 400, "limit")


def test_cancel_a_validating_batch(client, keys):
    file_id = http_upload(client, keys["a"]).get_json()["id"]
    batch_id = http_create(client, keys["a"], file_id).get_json()["id"]
    cancelled = client.post(f"/v1/batches/{batch_id}/cancel", headers=keys["a"]).get_json()
    assert cancelled["status"] == "cancelling" and cancelled["cancelling_at"] is not None
    again = client.post(f"/v1/batches/{batch_id}/cancel", headers=keys["a"])
    assert again.status_code == 200 and again.get_json()["status"] == "cancelling"
    # a running batch's input file cannot be deleted out from under it
    assert_error(client.delete(f"/v1/files/{file_id}", headers=keys["a"]), 409, "file_id")


def test_models_and_unknown_routes(client, keys):
    models = client.get("/v1/models", headers=keys["a"]).get_json()
    assert [m["id"] for m in models["data"]] == ["demo"] and models["object"] == "list"
    assert client.get("/v1/models/demo", headers=keys["a"]).get_json()["id"] == "demo"
    assert_error(client.get("/v1/models/nope", headers=keys["a"]), 404, "model")
    assert_error(client.get("/v1/nothing-here", headers=keys["a"]), 404)
    assert_error(client.put("/v1/batches", headers=keys["a"]), 405)


def test_creating_a_batch_with_the_broker_down_is_a_503_and_leaves_no_batch(settings):
    from dataclasses import replace

    from storage.runtime import Runtime

    rt = Runtime(replace(settings, broker_url="redis://127.0.0.1:1/0"))  # nothing listens on port 1
    rt.queue.celery.conf.task_publish_retry = False
    rt.queue.celery.conf.broker_connection_timeout = 0.5  # kombu's connect retries: 4 s by default
    try:
        app = create_app(runtime=rt)
        _, key = create_tenant(rt.db, "alpha", now())
        headers = {"Authorization": f"Bearer {key}"}
        client = app.test_client()
        file_id = http_upload(client, headers).get_json()["id"]
        response = client.post("/v1/batches", headers=headers, json={
            "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"})  # fmt: skip
        assert response.status_code == 503, response.get_json()
        assert response.get_json()["error"]["code"] == "queue_unavailable" and response.headers["Retry-After"]
        assert client.get("/v1/batches", headers=headers).get_json()["data"] == []
    finally:
        rt.db.dispose()
