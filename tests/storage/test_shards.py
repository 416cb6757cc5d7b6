"""The validated request store: shard schema, row-range reads, planning columns (real local store)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from scheduler.ordering import prompt_key
from storage.objectstore import LocalObjectStore
from storage.shards import PLAN_COLUMNS, SCHEMA, ShardRow, ShardWriter, read_columns, read_rows


def row(i: int, ids: list[int] | None) -> ShardRow:
    body = json.dumps({"model": "demo", "prompt": f"p{i}", "max_tokens": i % 7 or None})
    return ShardRow(i + 1, f"c{i}", body, prompt_key(ids or [i], 1024), ids, len(ids or []), i % 7 or None)


@pytest.fixture
def store(tmp_path):
    return LocalObjectStore(tmp_path / "objects")


def write(store, rows: list[ShardRow], group: int) -> str:
    with ShardWriter(store, "s/000000.parquet", group) as writer:
        for r in rows:
            writer.add(r)
    return "s/000000.parquet"


def test_schema_and_row_groups(store, tmp_path):
    rows = [row(i, list(range(i, i + 5)) if i % 3 else None) for i in range(23)]
    key = write(store, rows, 5)
    meta = pq.ParquetFile(tmp_path / "objects" / key).metadata
    assert meta.schema.to_arrow_schema().remove_metadata() == SCHEMA
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [5, 5, 5, 5, 3]


@pytest.mark.parametrize(
    ("start", "count"), [(0, 23), (0, 5), (3, 4), (4, 2), (5, 5), (7, 11), (20, 10), (22, 1)]
)
def test_row_ranges_read_exactly_their_rows(store, start, count):
    rows = [row(i, list(range(i, i + 3)) if i % 2 else None) for i in range(23)]
    key = write(store, rows, 5)
    got = list(read_rows(store, key, start, count))
    want = rows[start : start + count]
    assert [(r.line, r.custom_id, r.body_json, r.key, r.prompt_len, r.max_tokens) for r in got] == [
        (r.line, r.custom_id, r.body_json, r.key, r.prompt_len, r.max_tokens) for r in want
    ]
    assert [r.prompt_token_ids for r in got] == [r.prompt_token_ids for r in want]
    assert list(read_rows(store, key, 23, 5)) == []


def test_ids_given_as_big_endian_bytes_are_stored_as_int32(store):
    ids = [1, 255, 70_000, 2**31 - 1]
    r = ShardRow(1, "a", "{}", prompt_key(ids, 1024), prompt_key(ids, 1024), 4, None)
    key = write(store, [r], 8)
    (back,) = read_rows(store, key)
    assert back.prompt_token_ids == ids and back.prompt_len == 4 and back.max_tokens is None


def test_planning_reads_only_its_columns(store):
    key = write(store, [row(i, [i, i + 1]) for i in range(10)], 4)
    table = read_columns(store, key)
    assert table.column_names == list(PLAN_COLUMNS)
    assert table.column("prompt_len").to_pylist() == [2] * 10
    assert table.column("prefix_key").to_pylist()[3] == prompt_key([3, 4], 32)


def test_shared_tokens_round_trip(store):
    from dataclasses import replace

    rows = [replace(row(i, [7, 7, i]), shared_tokens=0 if i == 0 else 2) for i in range(6)]
    key = write(store, rows, 4)
    assert read_columns(store, key).column("shared_tokens").to_pylist() == [0, 2, 2, 2, 2, 2]
    assert [r.shared_tokens for r in read_rows(store, key, 3, 2)] == [2, 2]
