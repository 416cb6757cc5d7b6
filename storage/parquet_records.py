"""Rows to a Parquet file a record batch at a time, so a results file of millions of lines is
written in bounded memory: the one writer loop of the result and score tables."""

from __future__ import annotations

from collections.abc import Iterable
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

WRITE_ROWS = 4096  # rows in one record batch at most


def write_records(records: Iterable[dict[str, Any]], sink: IO[bytes] | str, schema: pa.Schema) -> int:
    """Write ``records`` (each a row of ``schema``) to ``sink``; returns the rows written. A file of
    no rows still gets its schema (one empty batch)."""
    rows = 0
    buffer: list[dict[str, Any]] = []
    with pq.ParquetWriter(sink, schema, compression="zstd") as writer:
        for record in records:
            buffer.append(record)
            rows += 1
            if len(buffer) >= WRITE_ROWS:
                writer.write_table(pa.Table.from_pylist(buffer, schema=schema))
                buffer = []
        if buffer or not rows:
            writer.write_table(pa.Table.from_pylist(buffer, schema=schema))
    return rows
