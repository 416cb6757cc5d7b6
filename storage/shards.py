"""The validated request store: a batch's requests as Parquet shards, written once by validation.

One shard holds up to ``SHARD_UNITS`` work units' worth of rows, in prompt-prefix order, in row
groups of ``row_group_rows`` rows (the unit size), so a worker reads its unit by shard and row
range and touches only the row groups it needs, and the planner reads only its few small columns
(``columns=``). Columns:

==================  ===============  =====================================================
``line``            int64            the request's line (or row) number in the input file
``custom_id``       string
``body``            string           the request body as JSON text, as given (the truth)
``key``             binary           prompt key: leading token ids, big-endian (ordering)
``prefix_key``      binary           the key's first 32 tokens (what planning packs by)
``prompt_token_ids`` list<int32>     the rendered prompt's token ids; null when validation
                                     could not render it exactly (the engine renders then)
``prompt_len``      int32            len(prompt_token_ids), or the key's length in tokens
``max_tokens``      int32            the body's output budget; null: the engine's default
``shared_tokens``   int32            leading tokens ``key`` shares with the previous row's
                                     in the batch (0 for its first): predicted cache hits
``sequences``       int32            the outputs the request asks for (its ``n``, inputs,
                                     pairs: ``scheduler.request_work``); absent in shards
                                     written before it: 1
``work``            int64            what the request weighs in the fair shares
                                     (``scheduler.request_work``); absent before: 1
==================  ===============  =====================================================

Writes stream (``ShardWriter``): memory is one row group, whatever the batch size.
"""

from __future__ import annotations

import bisect
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from storage.objectstore import ObjectStore

SHARD_UNITS = 64  # row groups (units' worth of rows) per shard
PREFIX_KEY_BYTES = 128  # of a row's key kept as prefix_key: 32 tokens, what packing compares
PLAN_COLUMNS = ("line", "prefix_key", "prompt_len", "max_tokens", "shared_tokens", "sequences", "work")

SCHEMA = pa.schema(
    [
        ("line", pa.int64()),
        ("custom_id", pa.string()),
        ("body", pa.string()),
        ("key", pa.binary()),
        ("prefix_key", pa.binary()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("prompt_len", pa.int32()),
        ("max_tokens", pa.int32()),
        ("shared_tokens", pa.int32()),
        ("sequences", pa.int32()),
        ("work", pa.int64()),
    ]
)


@dataclass(frozen=True)
class ShardRow:
    line: int
    custom_id: str
    body_json: str
    key: bytes = b""
    prompt_token_ids: Sequence[int] | bytes | None = None  # bytes: big-endian uint32 ids
    prompt_len: int = 0
    max_tokens: int | None = None
    shared_tokens: int = 0  # leading key tokens shared with the previous row of the batch
    sequences: int = 1  # outputs asked for (n, inputs, pairs: scheduler.request_work)
    work: int = 1  # its weight in the fair shares (scheduler.request_work)

    @property
    def body(self) -> dict:
        import json

        return json.loads(self.body_json)


def _table(rows: Sequence[ShardRow]) -> pa.Table:
    return pa.Table.from_arrays(
        [
            pa.array([r.line for r in rows], pa.int64()),
            pa.array([r.custom_id for r in rows], pa.string()),
            pa.array([r.body_json for r in rows], pa.string()),
            pa.array([r.key for r in rows], pa.binary()),
            pa.array([r.key[:PREFIX_KEY_BYTES] for r in rows], pa.binary()),
            _token_lists(rows),
            pa.array([r.prompt_len for r in rows], pa.int32()),
            pa.array([r.max_tokens for r in rows], pa.int32()),
            pa.array([r.shared_tokens for r in rows], pa.int32()),
            pa.array([r.sequences for r in rows], pa.int32()),
            pa.array([r.work for r in rows], pa.int64()),
        ],
        schema=SCHEMA,
    )


def _token_lists(rows: Sequence[ShardRow]) -> pa.Array:
    """The prompt_token_ids column, built from numpy buffers (validation hands ids over as
    big-endian uint32 bytes, readers as lists)."""
    import numpy as np

    offsets = [0]
    parts = []
    nulls = []
    for row in rows:
        ids = row.prompt_token_ids
        nulls.append(ids is None)
        if ids is None:
            offsets.append(offsets[-1])
            continue
        if isinstance(ids, (bytes, bytearray)):
            arr = np.frombuffer(ids, dtype=">u4").astype(np.int32)
        else:
            arr = np.asarray(ids, dtype=np.int32)
        parts.append(arr)
        offsets.append(offsets[-1] + len(arr))
    values = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
    return pa.ListArray.from_arrays(
        pa.array(offsets, pa.int32()), pa.array(values, pa.int32()), mask=pa.array(nulls, pa.bool_())
    )


class ShardWriter:
    """Streams rows into one shard: a row group at a time to a local temporary file, which goes to
    the object store on ``close``. Holds one row group of rows in memory."""

    def __init__(self, store: ObjectStore, key: str, row_group_rows: int, spill_dir: str | None = None):
        self.store = store
        self.key = key
        self.row_group_rows = max(1, row_group_rows)
        self.rows = 0
        self.size = 0
        self._pending: list[ShardRow] = []
        self._file = tempfile.NamedTemporaryFile(dir=spill_dir, suffix=".parquet", delete=False)  # noqa: SIM115
        self._writer = pq.ParquetWriter(self._file, SCHEMA, compression="zstd")

    def add(self, row: ShardRow) -> None:
        self._pending.append(row)
        self.rows += 1
        if len(self._pending) >= self.row_group_rows:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._writer.write_table(_table(self._pending), row_group_size=len(self._pending))
            self._pending = []

    def close(self) -> None:
        try:
            self._flush()
            self._writer.close()
            self._file.flush()
            self._file.seek(0)
            self.size = self.store.put_stream(self.key, self._file)
        finally:
            self._file.close()
            os.unlink(self._file.name)

    def abort(self) -> None:
        self._file.close()
        os.unlink(self._file.name)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


@contextmanager
def _parquet(store: ObjectStore, key: str) -> Iterator[pq.ParquetFile]:
    """A shard opened for reading: in place when the store's stream can seek (a local store), so
    only the footer and the pages asked for are read; otherwise fetched whole (a shard is small)."""
    with store.open(key) as stream:
        seekable = getattr(stream, "seekable", lambda: False)()
        yield pq.ParquetFile(stream if seekable else pa.BufferReader(stream.read()))


def read_columns(store: ObjectStore, key: str, columns: Sequence[str] = PLAN_COLUMNS) -> pa.Table:
    """Only these columns of a shard (Parquet reads just their pages); a column the shard was
    written without (``sequences``, ``work``: shards of an earlier version) is left out."""
    with _parquet(store, key) as pf:
        names = set(pf.schema_arrow.names)
        return pf.read(columns=[c for c in columns if c in names])


def custom_ids(store: ObjectStore, key: str) -> list[str]:
    """Every row's custom id, in order: one column (a shard holds SHARD_UNITS units' rows)."""
    column = read_columns(store, key, ("custom_id",)).column("custom_id")
    return column.to_pylist()


def read_rows(store: ObjectStore, key: str, start: int = 0, count: int | None = None) -> Iterator[ShardRow]:
    """The rows ``[start, start + count)`` of a shard (all from ``start`` when count is None),
    reading only the row groups that hold them."""
    with _parquet(store, key) as pf:
        meta = pf.metadata
        bounds = [0]
        for i in range(meta.num_row_groups):
            bounds.append(bounds[-1] + meta.row_group(i).num_rows)
        end = bounds[-1] if count is None else min(bounds[-1], start + count)
        if start >= end:
            return
        first = bisect.bisect_right(bounds, start) - 1
        last = bisect.bisect_left(bounds, end) - 1
        offset = bounds[first]
        table = pf.read_row_groups(list(range(first, last + 1)))
    table = table.slice(start - offset, end - start)
    for batch in table.to_batches(max_chunksize=1024):
        yield from _rows(batch)


def _rows(batch: pa.RecordBatch) -> Iterator[ShardRow]:
    names = batch.schema.names
    lines = batch.column("line").to_pylist()
    ids = batch.column("custom_id").to_pylist()
    bodies = batch.column("body").to_pylist()
    keys = batch.column("key").to_pylist() if "key" in names else [b""] * len(lines)
    tokens = batch.column("prompt_token_ids").to_pylist() if "prompt_token_ids" in names else None
    lens = batch.column("prompt_len").to_pylist() if "prompt_len" in names else None
    budgets = batch.column("max_tokens").to_pylist() if "max_tokens" in names else None
    shared = batch.column("shared_tokens").to_pylist() if "shared_tokens" in names else None
    sequences = batch.column("sequences").to_pylist() if "sequences" in names else None
    work = batch.column("work").to_pylist() if "work" in names else None
    for i, line in enumerate(lines):
        yield ShardRow(
            line,
            ids[i],
            bodies[i],
            keys[i] or b"",
            None if tokens is None else tokens[i],
            0 if lens is None else lens[i],
            None if budgets is None else budgets[i],
            0 if shared is None else shared[i] or 0,
            1 if sequences is None else sequences[i] or 1,
            1 if work is None else work[i] or 1,
        )
