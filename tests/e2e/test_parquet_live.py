"""Parquet end to end on the live stack: a Parquet input submitted with the official openai client,
run on the real vLLM engine, and the results downloaded as Parquet and read by DuckDB."""

from __future__ import annotations

import json

import duckdb
import pyarrow as pa
import pytest

from tests.e2e.batch_client import converted
from tests.e2e.conftest import wait_final
from tests.factories import parquet_bytes

pytestmark = pytest.mark.stack

N = 12


def test_parquet_in_parquet_out(live, tmp_path):
    client = live.client()
    table = pa.table(
        {
            "custom_id": [f"pq-{i}" for i in range(N)],
            "messages": [
                [{"role": "user", "content": f"Parquet question {i}: name a colour."}] for i in range(N)
            ],
            "temperature": [0.0] * N,
            "max_tokens": [3 + i % 3 for i in range(N)],
        }
    ).replace_schema_metadata({"freight.defaults": json.dumps({"model": "demo", "ignore_eos": True})})
    uploaded = client.files.create(file=("questions.parquet", parquet_bytes(table)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_final(client, batch.id)
    assert batch.status == "completed", batch.errors
    assert (batch.request_counts.total, batch.request_counts.completed) == (N, N)

    raw = converted(
        lambda: client.files.with_raw_response.content(
            batch.output_file_id, extra_query={"format": "parquet"}
        )
    )  # made by the control worker's convert_file task: 202 with Retry-After until then
    assert raw.headers["content-type"] == "application/vnd.apache.parquet"
    path = tmp_path / "output.parquet"
    path.write_bytes(raw.content)
    rows = (
        duckdb.connect()
        .execute(
            f"select custom_id, status_code, completion_tokens, finish_reason, prompt_tokens, response_body from '{path}'"
            " order by custom_id"
        )
        .fetchall()
    )
    assert sorted(r[0] for r in rows) == sorted(f"pq-{i}" for i in range(N))
    expected = {f"pq-{i}": 3 + i % 3 for i in range(N)}
    for custom_id, status, completion, finish, prompt, body in rows:
        assert (status, completion, finish) == (200, expected[custom_id], "length")
        assert prompt > 0 and json.loads(body)["usage"]["completion_tokens"] == completion
    jsonl = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert {x["custom_id"]: x["response"]["body"] for x in jsonl} == {r[0]: json.loads(r[5]) for r in rows}
