"""OpenAI's file expiry over /v1: ``expires_after`` on upload (multipart fields, before or after the
file part), ``output_expires_after`` on batch create, the default retention, and an expired file
answering as gone before the cleanup has deleted it."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest

from api.app import create_app
from api.services.tenants import create_tenant
from storage.models import Batch, StoredFile
from storage.runtime import Runtime
from tests.conftest import now
from tests.factories import chat_line, http_create, jsonl


@pytest.fixture
def client_and_headers(runtime, client):
    _, key = create_tenant(runtime.db, "alpha", now())
    return client, {"Authorization": f"Bearer {key}"}


def post_file(client, headers, fields: dict, file_first: bool = False):
    part = {"file": (io.BytesIO(jsonl([chat_line()])), "in.jsonl")}
    data = {**part, "purpose": "batch", **fields} if file_first else {"purpose": "batch", **fields, **part}
    return client.post("/v1/files", headers=headers, data=data, content_type="multipart/form-data")


def test_expires_after_on_upload(client_and_headers):
    client, headers = client_and_headers
    for file_first in (False, True):
        response = post_file(
            client,
            headers,
            {"expires_after[anchor]": "created_at", "expires_after[seconds]": "7200"},
            file_first,
        )
        assert response.status_code == 200, response.get_data(as_text=True)
        body = response.get_json()
        assert body["expires_at"] == body["created_at"] + 7200
        shown = client.get(f"/v1/files/{body['id']}", headers=headers).get_json()
        assert shown["expires_at"] == body["expires_at"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"}, "expires_after.seconds"),
        (
            {"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"},
            "expires_after.seconds",
        ),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "soon"}, "expires_after.seconds"),
        (
            {"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"},
            "expires_after.anchor",
        ),
        ({"expires_after[seconds]": "3600"}, "expires_after.anchor"),
    ],
)
def test_bad_expires_after_is_a_400(client_and_headers, fields, param):
    client, headers = client_and_headers
    response = post_file(client, headers, fields)
    assert response.status_code == 400, response.get_data(as_text=True)
    assert response.get_json()["error"]["param"] == param


def test_default_retention_and_expired_files_answer_as_gone(runtime):
    rt = Runtime(replace(runtime.settings, file_retention_seconds=86400))
    _, key = create_tenant(rt.db, "alpha", now())
    client, headers = create_app(runtime=rt).test_client(), {"Authorization": f"Bearer {key}"}
    body = post_file(client, headers, {}).get_json()
    assert body["expires_at"] == body["created_at"] + 86400

    kept = Runtime(replace(runtime.settings, file_retention_seconds=0))  # 0: kept until deleted
    _, key2 = create_tenant(kept.db, "beta", now())
    other = post_file(create_app(runtime=kept).test_client(), {"Authorization": f"Bearer {key2}"}, {})
    assert other.get_json()["expires_at"] is None

    short = post_file(
        client, headers, {"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}
    ).get_json()
    with rt.db.write() as s:  # an hour later, before the cleanup comes by
        s.get(StoredFile, short["id"]).expires_at = now() - 1
    assert client.get(f"/v1/files/{short['id']}", headers=headers).status_code == 404
    assert client.get(f"/v1/files/{short['id']}/content", headers=headers).status_code == 404
    assert [f["id"] for f in client.get("/v1/files", headers=headers).get_json()["data"]] == [body["id"]]
    assert http_create(client, headers, short["id"]).status_code == 404


def test_output_expires_after_on_create(runtime, client_and_headers):
    client, headers = client_and_headers
    file_id = post_file(client, headers, {}).get_json()["id"]
    bad = http_create(client, headers, file_id, output_expires_after={"anchor": "created_at", "seconds": 5})
    assert bad.status_code == 400 and bad.get_json()["error"]["param"] == "output_expires_after.seconds"
    good = http_create(
        client, headers, file_id, output_expires_after={"anchor": "created_at", "seconds": 7200}
    )
    assert good.status_code == 200, good.get_data(as_text=True)
    with runtime.db.read() as s:
        assert s.get(Batch, good.get_json()["id"]).output_expires_after == 7200
