"""Validated requests, stored once as Parquet shards: one shard per work unit.

Validation writes them in prefix order; workers read their units' shards. The original JSONL is
never re-parsed for planning or execution. Columns: ``line`` (1-based line number in the input
file), ``custom_id``, ``body`` (the request body as JSON text), ``key`` (the prompt's sort key,
see ``scheduler.ordering``; rows of a shard are sorted by it).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from storage.objectstore import ObjectStore

SCHEMA = pa.schema(
    [("line", pa.int64()), ("custom_id", pa.string()), ("body", pa.string()), ("key", pa.binary())]
)


@dataclass(frozen=True)
class ShardRow:
    line: int
    custom_id: str
    body_json: str
    key: bytes = b""

    @property
    def body(self) -> dict[str, Any]:
        return json.loads(self.body_json)  # type: ignore[no-any-return]


def write_shard(store: ObjectStore, key: str, rows: Sequence[ShardRow]) -> int:
    table = pa.table(
        {
            "line": [r.line for r in rows],
            "custom_id": [r.custom_id for r in rows],
            "body": [r.body_json for r in rows],
            "key": [r.key for r in rows],
        },
        schema=SCHEMA,
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    buffer.seek(0)
    return store.put_stream(key, buffer)


def read_shard(store: ObjectStore, key: str) -> Iterator[ShardRow]:
    with store.open(key) as stream:
        data = stream.read()
    table = pq.read_table(pa.BufferReader(data))
    has_key = "key" in table.column_names
    for batch in table.to_batches():
        lines = batch.column("line").to_pylist()
        ids = batch.column("custom_id").to_pylist()
        bodies = batch.column("body").to_pylist()
        keys = batch.column("key").to_pylist() if has_key else [b""] * len(lines)
        for line, custom_id, body, sort_key in zip(lines, ids, bodies, keys, strict=True):
            yield ShardRow(line, custom_id, body, sort_key or b"")
