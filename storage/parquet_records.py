"""Rows to a Parquet file a record batch at a time, so a results file of millions of lines is
written in bounded memory: the one writer loop of the result and score tables."""

from __future__ import annotations

from collections.abc import Iterable
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

WRITE_ROWS = 4096  # rows in one record batch at most
# bytes of text in one record batch at most (then one row group): a row count alone let 4,096
# result lines of 800 KiB of logprobs each be held at once (+926 MiB in the API process)
WRITE_BYTES = 8 * 1024 * 1024


def record_bytes(values: Iterable[Any]) -> int:
    """The bytes a row's values hold, about: its strings' lengths (the big part of any row: a
    response body, a request body) and 8 for anything else."""
    return sum(len(v) if isinstance(v, str | bytes) else 8 for v in values)


def write_records(records: Iterable[dict[str, Any]], sink: IO[bytes] | str, schema: pa.Schema) -> int:
    """Write ``records`` (each a row of ``schema``) to ``sink``; returns the rows written. A batch
    (a row group) is written once it holds WRITE_ROWS rows or WRITE_BYTES of text, so memory is
    about WRITE_BYTES plus one row, whatever the rows' sizes. A file of no rows still gets its
    schema (one empty batch)."""
    rows = 0
    held = 0  # record_bytes of the buffered rows
    buffer: list[dict[str, Any]] = []
    with pq.ParquetWriter(sink, schema, compression="zstd") as writer:
        for record in records:
            buffer.append(record)
            rows += 1
            held += record_bytes(record.values())
            if len(buffer) >= WRITE_ROWS or held >= WRITE_BYTES:
                writer.write_table(pa.Table.from_pylist(buffer, schema=schema))
                buffer, held = [], 0
        if buffer or not rows:
            writer.write_table(pa.Table.from_pylist(buffer, schema=schema))
    return rows
