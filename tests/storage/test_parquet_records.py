"""Parquet writers cut their record batches (each a row group) by bytes of text as well as by rows:
4,096 rows of any size were held at once before (400 result lines of 800 KiB took +926 MiB)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from storage.parquet_records import WRITE_BYTES, record_bytes
from storage.request_tables import write_requests
from storage.result_tables import write_results
from workers.results import encode, success_line

ROW = 1024 * 1024  # a line's text: 1 MiB


def test_result_row_groups_are_bounded_by_bytes(tmp_path) -> None:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * ROW}}]}
    lines = (encode(success_line(f"r{i}", body)) for i in range(40))
    path = tmp_path / "out.parquet"
    assert write_results(lines, str(path)) == 40
    meta = pq.ParquetFile(path).metadata
    rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    # each row holds its content and its response body: 2 MiB of text, so 4 rows reach 8 MiB
    assert rows == [WRITE_BYTES // (2 * ROW)] * (40 * 2 * ROW // WRITE_BYTES), rows


def test_request_row_groups_are_bounded_by_bytes(tmp_path) -> None:
    lines = (
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "demo", "prompt": "y" * ROW}}).encode()
        for i in range(24)
    )  # fmt: skip
    path = tmp_path / "in.parquet"
    assert write_requests(lines, str(path)) == 24
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [8, 8, 8]


def test_small_rows_are_still_cut_by_count(tmp_path) -> None:
    lines = (encode(success_line(f"r{i}", {"choices": []})) for i in range(5000))
    path = tmp_path / "small.parquet"
    write_results(lines, str(path))
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [4096, 904]
    assert record_bytes(["abc", None, 5, b"xy"]) == 3 + 8 + 8 + 2
