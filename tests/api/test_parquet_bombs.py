"""A Parquet decompression bomb through the API and validation (issue #19, section 1): a few
kilobytes that decode to 600 MB. Its JSONL download is a 202 while the control worker's task
converts it, then an OpenAI 400 naming the limit, remembered (not decoded again); no derived object
is left, and peak RSS grows by less than 100 MB; as a batch's input it fails validation with a row
error. Real database, object store and broker, Flask's test client."""

from __future__ import annotations

import io
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq

from api.app import create_app
from api.services.tenants import create_tenant
from storage.models import Batch
from storage.runtime import Runtime
from tests.conftest import now
from tests.factories import conversions_sent, converted_download, http_upload, validated_batch
from tests.storage.test_parquet_limits import body, bomb, peak_rss_mb
from tests.storage.test_parquet_list_bombs import list_bomb
from workers import conversions

LIMIT = 200 * 1024 * 1024  # FREIGHT_MAX_FILE_BYTES's default


def refused_as_jsonl(runtime: Runtime, data: bytes, name: str, code: str, max_bytes: int) -> tuple[str, dict]:
    """Upload ``data`` as tenant alpha, ask for its JSONL view: a 202 while the conversion task
    runs (here, in this process), then a 400 with ``code``, less than 100 MB of growth in this
    process (the API's requests and the task), nothing derived kept. The refusal is remembered:
    asked again, the same 400 without a task sent or run. Returns the tenant id and the error."""
    tenant, key = create_tenant(runtime.db, "alpha", now())
    headers = {"Authorization": f"Bearer {key}"}
    client = create_app(runtime=runtime).test_client()
    made = http_upload(client, headers, data, name)
    assert made.status_code == 200 and made.json["bytes"] == len(data) < max_bytes
    file_id = made.json["id"]

    before = peak_rss_mb(reset=True)
    refused = converted_download(client, runtime, headers, file_id, "jsonl")
    grown = peak_rss_mb() - before
    assert refused.status_code == 400, refused.get_data(as_text=True)[:300]
    error = refused.get_json()["error"]
    assert error["code"] == code, error
    assert grown < 100, f"the API and the task grew by {grown:.0f} MB refusing the bomb"
    assert not runtime.store.exists(f"derived/{file_id}.jsonl")  # nothing half-converted is kept
    # remembered: the next downloads answer the same refusal, and no task decodes the file again
    for _ in range(3):
        again = client.get(f"/v1/files/{file_id}/content?format=jsonl", headers=headers)
        assert again.status_code == 400 and again.get_json()["error"] == error
    assert conversions_sent(runtime, file_id, "jsonl") == 1  # the first download's message only
    assert conversions.convert(runtime, file_id, "jsonl") is None  # a redelivered one reads nothing
    # the file itself is intact and downloadable as it was sent
    assert client.get(f"/v1/files/{file_id}/content?format=parquet", headers=headers).data == data
    return tenant.id, error


def test_the_jsonl_view_of_a_bomb_is_a_400_within_bounded_memory(settings) -> None:
    rt = Runtime(replace(settings, max_file_bytes=LIMIT))
    try:
        _, error = refused_as_jsonl(rt, bomb(), "bomb.parquet", "file_too_large", 64 * 1024)
        assert f"the {LIMIT} byte limit" in error["message"], error
    finally:
        rt.db.dispose()


def test_a_bomb_as_a_batch_input_fails_validation_with_a_row_error(runtime) -> None:
    tenant, _ = create_tenant(runtime.db, "alpha", now())
    batch_id = validated_batch(runtime, tenant.id, bomb(rows=40, value_mb=1), name="bomb.parquet")
    with runtime.db.read() as s:
        batch = s.get(Batch, batch_id)
    assert batch.status == "failed"
    # the test settings allow 64 kB a file, which the first rows' decoded megabytes pass
    [error] = batch.errors["data"]
    assert (error["code"], error["line"]) == ("file_too_large", 1), error
    assert "65536 byte limit" in error["message"]


def page_bomb(value_mb: int = 40) -> bytes:
    """One row whose body is one ``value_mb`` MB string in one zstd page: a few kB."""
    table = pa.table({"custom_id": ["a"], "body": [body("a" * (value_mb * 1024 * 1024))]})
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", use_dictionary=False)
    return sink.getvalue()


def test_a_page_bomb_is_refused_from_its_header_on_download_and_at_validation(runtime) -> None:
    """A single value far over the limits in one page: the reader would decompress it whole before
    a row could be sized. Refused from the page header: a 400 naming the limit, nothing derived
    kept; as a batch input, a row error."""
    data = page_bomb()
    tenant_id, error = refused_as_jsonl(runtime, data, "page-bomb.parquet", "file_too_large", 64 * 1024)
    assert "a page decompresses to" in error["message"] and "65536 byte limit on a file" in error["message"]

    batch_id = validated_batch(runtime, tenant_id, data, name="page-bomb.parquet")
    with runtime.db.read() as s:
        batch = s.get(Batch, batch_id)
    assert batch.status == "failed"
    [line] = batch.errors["data"]
    assert (line["code"], line["line"]) == ("file_too_large", 1), line
    assert "column 'body': a page decompresses to" in line["message"]


def test_a_list_bomb_is_refused_from_its_levels_on_download_and_at_validation(settings) -> None:
    """One row of 20 million identical messages among small rows (1.5 kB; 1.4 GB decoded): its
    repetition levels name the row before anything is decoded. A 400 naming the row and the line
    limit, nothing derived kept, less than 100 MB of growth; as a batch input, that row's error."""
    runtime = Runtime(replace(settings, max_file_bytes=LIMIT))  # the footer's count passes it
    try:
        _list_bomb_is_refused(runtime)
    finally:
        runtime.db.dispose()


def _list_bomb_is_refused(runtime: Runtime) -> None:
    data, decoded = list_bomb("messages", 20_000_000, before=5)
    assert decoded > 1_000_000_000
    tenant_id, error = refused_as_jsonl(runtime, data, "list-bomb.parquet", "line_too_large", 4096)
    assert (
        error["message"].startswith("row 6, column 'messages.list.element.")
        and "the limit is" in error["message"]
    )

    batch_id = validated_batch(runtime, tenant_id, data, name="list-bomb.parquet")
    with runtime.db.read() as s:
        batch = s.get(Batch, batch_id)
    assert batch.status == "failed"
    lines = batch.errors["data"]
    assert (lines[-1]["code"], lines[-1]["line"]) == ("line_too_large", 6), lines
