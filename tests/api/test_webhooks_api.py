"""/v1/webhooks over HTTP and `freight webhooks` on the command line: one service behind both.
The secret is shown once; every malformed URL or event list, unknown field, private target and
endpoint past the limit is a 400 naming the field, never a 5xx; another tenant's endpoint is not
found; disabling, enabling and removing show in the listing; a batch's delivery log is served."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from api.app import create_app
from api.services.tenants import create_tenant
from storage.runtime import Runtime
from tests.conftest import now
from tests.factories import chat_line, cli_on, upload_and_create
from workers.task_policy import fail_validation


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def world(settings):
    rt = Runtime(replace(settings, webhook_max_endpoints=3))
    app = create_app(runtime=rt)
    alpha, key_a = create_tenant(rt.db, "alpha", now())
    _, key_b = create_tenant(rt.db, "beta", now())
    yield app.test_client(), rt, alpha.id, key_a, key_b
    rt.db.dispose()


BAD = [
    ({"url": "ftp://hooks.example.com/x", "events": ["batch.completed"]}, "url", "https://"),
    ({"url": "https://user:pw@hooks.example.com/", "events": ["batch.completed"]}, "url", "credentials"),
    ({"url": "https://hooks.example.com/" + "a" * 2100, "events": ["batch.completed"]}, "url", "2048"),
    ({"url": "https:///nohost", "events": ["batch.completed"]}, "url", "host"),
    ({"url": "https://hooks.example.com/a b", "events": ["batch.completed"]}, "url", "spaces"),
    ({"url": "https://hooks.example.com/\u0000", "events": ["batch.completed"]}, "url", "control"),
    ({"url": "https://hooks.example.com/\udc00", "events": ["batch.completed"]}, "url", "ASCII"),
    ({"url": "https://hooks.example.com/", "events": ["batch.completed\u0000"]}, "events", "unknown"),
    ({"url": "http://127.0.0.1:9/", "events": ["batch.completed"]}, "url", "public address"),
    ({"url": "http://169.254.169.254/latest", "events": ["batch.completed"]}, "url", "public address"),
    ({"url": "http://[::ffff:10.0.0.1]/", "events": ["batch.completed"]}, "url", "public address"),
    ({"url": "http://[64:ff9b::a9fe:a9fe]/", "events": ["batch.completed"]}, "url", "public address"),
    ({"url": "http://[::a9fe:a9fe]/", "events": ["batch.completed"]}, "url", "public address"),
    ({"url": "http://[fec0::1]/", "events": ["batch.completed"]}, "url", "public address"),
    ({"url": "https://hooks.example.com:99999/", "events": ["batch.completed"]}, "url", "valid URL"),
    ({"url": 7, "events": ["batch.completed"]}, "url", "string"),
    ({"events": ["batch.completed"]}, "url", "string"),
    ({"url": "https://hooks.example.com/", "events": []}, "events", "non-empty"),
    ({"url": "https://hooks.example.com/", "events": ["batch.done"]}, "events", "unknown event"),
    ({"url": "https://hooks.example.com/", "events": [{"a": 1}]}, "events", "unknown event"),
    ({"url": "https://hooks.example.com/", "events": 3}, "events", "list"),
    ({"url": "https://hooks.example.com/", "events": "batch.failed"}, "events", "list"),
    (
        {"url": "https://hooks.example.com/", "events": ["batch.completed"], "secret": "x"},
        "secret",
        "unknown",
    ),
]


def test_add_list_disable_enable_remove_over_http(world):
    client, _, _, key_a, key_b = world
    made = client.post(
        "/v1/webhooks",
        headers=bearer(key_a),
        json={"url": "https://hooks.example.com/freight?x=1", "events": ["batch.failed", "batch.completed"]},
    )
    assert made.status_code == 200, made.get_json()
    hook = made.get_json()
    assert hook["secret"].startswith("whsec_") and hook["object"] == "webhook_endpoint"
    assert hook["events"] == ["batch.completed", "batch.failed"] and hook["status"] == "active"
    listed = client.get("/v1/webhooks", headers=bearer(key_a)).get_json()["data"]
    assert [h["id"] for h in listed] == [hook["id"]] and "secret" not in listed[0]  # shown once
    assert "secret" not in client.get(f"/v1/webhooks/{hook['id']}", headers=bearer(key_a)).get_json()
    # beta sees nothing of alpha's and cannot touch it
    assert client.get("/v1/webhooks", headers=bearer(key_b)).get_json()["data"] == []
    for method, path in (("GET", ""), ("POST", "/disable"), ("DELETE", ""), ("GET", "/deliveries")):
        assert (
            client.open(f"/v1/webhooks/{hook['id']}{path}", method=method, headers=bearer(key_b)).status_code
            == 404
        )
    # rotating: a new secret shown this once, the old one's grace end shown from now on
    assert client.post(f"/v1/webhooks/{hook['id']}/rotate_secret", headers=bearer(key_b)).status_code == 404
    rotated = client.post(f"/v1/webhooks/{hook['id']}/rotate_secret", headers=bearer(key_a)).get_json()
    assert rotated["secret"].startswith("whsec_") and rotated["secret"] != hook["secret"]
    shown = client.get(f"/v1/webhooks/{hook['id']}", headers=bearer(key_a)).get_json()
    assert "secret" not in shown and shown["previous_secret_expires_at"] >= hook["created_at"] + 86400
    disabled = client.post(f"/v1/webhooks/{hook['id']}/disable", headers=bearer(key_a)).get_json()
    assert disabled["status"] == "disabled" and disabled["disabled_reason"] == "disabled by its tenant"
    enabled = client.post(f"/v1/webhooks/{hook['id']}/enable", headers=bearer(key_a)).get_json()
    assert enabled["status"] == "active" and enabled["disabled_reason"] is None
    gone = client.delete(f"/v1/webhooks/{hook['id']}", headers=bearer(key_a))
    assert gone.get_json() == {"id": hook["id"], "object": "webhook_endpoint", "deleted": True}
    assert client.get("/v1/webhooks", headers=bearer(key_a)).get_json()["data"] == []
    assert client.get(f"/v1/webhooks/{hook['id']}", headers=bearer(key_a)).status_code == 404


def test_malformed_endpoints_are_400s_naming_the_field(world):
    client, _, _, key_a, _ = world
    for body, param, words in BAD:
        response = client.post("/v1/webhooks", headers=bearer(key_a), json=body)
        error = response.get_json()["error"]
        assert response.status_code == 400 and error["param"] == param and words in error["message"], (
            body,
            error,
        )
    for raw in (b"[1]", b'"x"', b"{", b"null"):
        response = client.post(
            "/v1/webhooks", headers={**bearer(key_a), "Content-Type": "application/json"}, data=raw
        )
        assert response.status_code == 400
    for i in range(3):  # the limit (3 here): the fourth is refused, naming it
        ok = client.post("/v1/webhooks", headers=bearer(key_a), json={"url": f"https://h{i}.example.com/", "events": ["batch.failed"]})  # fmt: skip
        assert ok.status_code == 200
    over = client.post("/v1/webhooks", headers=bearer(key_a), json={"url": "https://h.example.com/", "events": ["batch.failed"]})  # fmt: skip
    assert over.status_code == 400 and over.get_json()["error"]["code"] == "too_many_webhooks"


def test_a_batch_delivery_log_over_http_and_the_cli(world, tmp_path):
    client, rt, alpha, key_a, key_b = world
    hook = client.post("/v1/webhooks", headers=bearer(key_a), json={"url": "https://hooks.example.com/", "events": ["batch.failed"]}).get_json()  # fmt: skip
    batch_id = upload_and_create(rt, alpha, [chat_line("r0", "hi")]).id
    assert fail_validation(rt, "boom", batch_id)
    [entry] = client.get(f"/v1/batches/{batch_id}/webhook_deliveries", headers=bearer(key_a)).get_json()[
        "data"
    ]
    assert entry["endpoint_id"] == hook["id"] and entry["status"] == "pending" and entry["attempts"] == 0
    assert entry["event"]["type"] == "batch.failed" and entry["event"]["batch_id"] == batch_id
    by_endpoint = client.get(f"/v1/webhooks/{hook['id']}/deliveries", headers=bearer(key_a)).get_json()[
        "data"
    ]
    assert by_endpoint == [entry]
    assert client.get(f"/v1/batches/{batch_id}/webhook_deliveries", headers=bearer(key_b)).status_code == 404

    # the operator's CLI: the same service, naming the tenant
    added = cli_on(
        rt, "webhooks", "add", "https://cli.example.com/h", "--tenant", "alpha", "--events", "batch.completed"
    )
    assert added.exit_code == 0, added.output
    assert "signing secret (shown once): whsec_" in added.stdout
    listed = cli_on(rt, "webhooks", "list", "--tenant", "alpha", "--json")
    assert sorted(h["url"] for h in json.loads(listed.stdout)["data"]) == [
        "https://cli.example.com/h",
        "https://hooks.example.com/",
    ]
    rotated = cli_on(rt, "webhooks", "rotate-secret", hook["id"], "--tenant", "alpha")
    assert rotated.exit_code == 0, rotated.output
    assert (
        "signing secret (shown once): whsec_" in rotated.stdout
        and "old secret also signs until" in rotated.stdout
    )
    log = cli_on(rt, "webhooks", "deliveries", "--tenant", "alpha", "--batch", batch_id)
    assert "batch.failed" in log.stdout and "pending" in log.stdout
    bad = cli_on(rt, "webhooks", "add", "http://10.1.2.3/", "--tenant", "alpha", "--events", "batch.nope")
    assert bad.exit_code == 1 and "Error:" in bad.stderr and "Traceback" not in bad.stderr
    nobody = cli_on(rt, "webhooks", "list", "--tenant", "nobody")
    assert nobody.exit_code == 1 and "no tenant named 'nobody'" in nobody.stderr
