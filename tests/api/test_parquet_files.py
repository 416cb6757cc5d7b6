"""Parquet through /v1/files: upload a .parquet input, download any file as Parquet or JSONL (a
conversion is a 202 until the control worker's task has made it), and an unknown format is a 400
(Flask test client, real database, store and broker)."""

from __future__ import annotations

import io
import json
import time

import duckdb
import pyarrow as pa
import pytest

from api.services.tenants import create_tenant
from storage.models import StoredFile, new_id
from storage.quotas import stored_bytes
from tests.conftest import now
from tests.factories import converted_download, http_upload, parquet_bytes
from workers.results import encode, stopped_line, success_line


@pytest.fixture
def tenant(runtime):
    record, key = create_tenant(runtime.db, "alpha", now())
    return record.id, {"Authorization": f"Bearer {key}"}


def test_parquet_upload_and_its_jsonl_view(client, tenant, runtime):
    _, headers = tenant
    data = parquet_bytes(pa.table({"custom_id": ["a", "b"], "prompt": ["x", "y"], "model": ["demo", "demo"]}))
    made = http_upload(client, headers, data, "rows.parquet")
    assert (
        made.status_code == 200
        and made.json["bytes"] == len(data)
        and made.json["filename"] == "rows.parquet"
    )
    same = client.get(f"/v1/files/{made.json['id']}/content?format=parquet", headers=headers)
    assert same.data == data and same.mimetype == "application/vnd.apache.parquet"
    lines = converted_download(client, runtime, headers, made.json["id"], "jsonl")
    assert lines.status_code == 200
    assert [json.loads(x) for x in lines.data.splitlines()] == [
        {"custom_id": c, "method": "POST", "url": "/v1/completions", "body": {"prompt": p, "model": "demo"}}
        for c, p in (("a", "x"), ("b", "y"))
    ]


def test_results_download_as_typed_parquet(client, tenant, runtime, tmp_path):
    tenant_id, headers = tenant
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}}  # fmt: skip
    data = encode(success_line("ok", body)) + encode(stopped_line("gone", "batch_cancelled"))
    file_id = new_id("file-")
    key = f"batches/x/{file_id}.jsonl"
    size = runtime.store.put_stream(key, io.BytesIO(data))
    with runtime.db.write() as s:
        s.add(StoredFile(id=file_id, tenant_id=tenant_id, purpose="batch_output", filename="out.jsonl",
                         bytes=size, object_key=key, created_at=int(time.time())))  # fmt: skip
    got = converted_download(client, runtime, headers, file_id, "parquet")
    assert got.status_code == 200 and got.headers["Content-Length"] == str(len(got.data))
    assert got.headers["Content-Disposition"] == f'attachment; filename="{file_id}.parquet"'
    path = tmp_path / "r.parquet"
    path.write_bytes(got.data)
    rows = (
        duckdb.connect()
        .execute(
            f"select custom_id, status_code, content, finish_reason, completion_tokens, error_code from '{path}'"
        )
        .fetchall()
    )
    assert rows == [("ok", 200, "hi", "length", 2, None), ("gone", None, None, None, None, "batch_cancelled")]
    again = client.get(f"/v1/files/{file_id}/content?format=parquet", headers=headers)
    assert again.data == got.data  # converted once, then read back
    with runtime.db.read() as s:  # kept, and counted in the tenant's stored bytes
        assert stored_bytes(s, tenant_id) == size + len(got.data)
    assert client.get(f"/v1/files/{file_id}/content?format=jsonl", headers=headers).data == data


def test_unknown_format_is_an_openai_400(client, tenant):
    _, headers = tenant
    made = http_upload(client, headers, b'{"custom_id": "a"}\n', "a.jsonl")
    bad = client.get(f"/v1/files/{made.json['id']}/content?format=csv", headers=headers)
    assert bad.status_code == 400
    assert bad.json["error"]["param"] == "format" and bad.json["error"]["type"] == "invalid_request_error"
