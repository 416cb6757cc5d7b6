"""Embeddings results as Parquet: a row per vector, the vector a float32 list column.

`storage.result_tables.write_results` hands an output file here when its first line is an
embeddings response (``{"object": "list", "data": [{"object": "embedding", ...}]}``), with its own
result columns and row builder (``custom_id``, ``id``, ``status_code``, usage, errors,
``response_body``: passed in, so this module does not import that one), and this adds three:

* ``embedding``: the vector as float32 values: ``fixed_size_list<float32, d>``
  (``pa.list_(pa.float32(), d)``; pyarrow, pandas and polars read it back as such, DuckDB as
  ``FLOAT[]``) when every vector of the file has the same ``d`` values (one model, one
  ``dimensions``), else ``list<float32>``. The width is known only
  once the last line is read, so the rows go first to a local spill file with the variable list,
  then are copied to the sink with the column cast: memory stays one record batch either way.
* ``embedding_base64``: a line that asked for ``encoding_format: "base64"`` keeps its string here
  (``embedding`` null): it is what the requester asked for, byte for byte.
* ``embedding_index``: the vector's ``data[i].index``. Why a row per vector rather than per line:
  a line's ``input`` may hold up to 2,048 texts, and a table of vectors is what an embedding job
  is read as (``np.stack``, a vector index). A line of several inputs gets a row per input, in
  order; its usage (``prompt_tokens``, ``completion_tokens`` 0) and ``response_body`` are on its
  first row and null on the others, so a sum over a column counts each line once.

``response_body`` is the body without its vectors (each ``data`` entry keeps ``object`` and
``index``): the values are in the typed columns exactly (the output's JSON numbers are float32
values), and as JSON text they would take the file twice over.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

Record = Callable[[dict[str, Any]], dict[str, Any]]  # one result line -> its result columns

WRITE_ROWS = 4096  # rows in one record batch at most
VARIABLE = pa.list_(pa.float32())
BATCH_VALUES = 1 << 20  # vector values in one record batch: about 32 MB as Python floats, 4 MB in Arrow


def embedding_schema(base: pa.Schema, vector: pa.DataType = VARIABLE) -> pa.Schema:
    """The result columns (``base``) and the three of embeddings, ``vector`` the type of ``embedding``."""
    schema = base
    for name, kind in (
        ("embedding_index", pa.int32()),
        ("embedding", vector),
        ("embedding_base64", pa.string()),
    ):
        schema = schema.append(pa.field(name, kind))
    return schema


def embeddings_body(line: dict[str, Any]) -> dict[str, Any] | None:
    """The line's response body if it is an embeddings response, else None."""
    response = line.get("response")
    body = response.get("body") if isinstance(response, dict) else None
    if not isinstance(body, dict) or body.get("object") != "list":
        return None
    data = body.get("data")
    if not isinstance(data, list) or not all(
        isinstance(d, dict) and d.get("object") == "embedding" for d in data
    ):
        return None
    return body


def embedding_records(line: dict[str, Any], result_record: Record) -> list[dict[str, Any]]:
    """One output or error line -> its rows of `embedding_schema`: one per vector, or a single row
    without one (an error line)."""
    body = embeddings_body(line)
    if body is None or not body["data"]:
        return [{**result_record(line), "embedding_index": None, "embedding": None, "embedding_base64": None}]
    data = body["data"]
    bare = {**body, "data": [{k: v for k, v in d.items() if k != "embedding"} for d in data]}
    first = result_record({**line, "response": {**line["response"], "body": bare}})
    first["completion_tokens"] = 0  # an embedding writes no tokens
    rest = {
        **first,
        "prompt_tokens": None,
        "cached_tokens": None,
        "completion_tokens": None,
        "response_body": None,
    }
    rows = []
    for position, item in enumerate(data):
        vector = item.get("embedding")
        index = item.get("index")
        rows.append(
            {
                **(first if position == 0 else rest),
                "embedding_index": index if isinstance(index, int) else position,
                "embedding": vector if isinstance(vector, list) else None,
                "embedding_base64": vector if isinstance(vector, str) else None,
            }
        )
    return rows


def write_embedding_results(
    lines: Iterable[dict[str, Any]], sink: IO[bytes] | str, base: pa.Schema, result_record: Record
) -> int:
    """Decoded result lines -> Parquet at ``sink``; returns the rows written (one per vector).
    ``base`` and ``result_record``: the result columns and how a line fills them. The spill file
    goes beside ``sink`` when it is a path (the caller's spill directory)."""
    rows = 0
    widths: set[int] = set()
    spill_dir = os.path.dirname(os.path.abspath(sink)) if isinstance(sink, str) else None
    with tempfile.TemporaryFile(dir=spill_dir, suffix=".parquet") as spill:
        variable = embedding_schema(base)
        with pq.ParquetWriter(spill, variable, compression="none") as writer:
            buffer: list[dict[str, Any]] = []
            values = 0
            for line in lines:
                for row in embedding_records(line, result_record):
                    buffer.append(row)
                    rows += 1
                    if row["embedding"] is not None:
                        widths.add(len(row["embedding"]))
                        values += len(row["embedding"])
                    if len(buffer) >= WRITE_ROWS or values >= BATCH_VALUES:
                        writer.write_table(pa.Table.from_pylist(buffer, schema=variable))
                        buffer, values = [], 0
            if buffer or not rows:
                writer.write_table(pa.Table.from_pylist(buffer, schema=variable))
        fixed = pa.list_(pa.float32(), next(iter(widths))) if len(widths) == 1 else VARIABLE
        final = embedding_schema(base, fixed)
        spill.seek(0)
        batch_rows = max(1, min(WRITE_ROWS, BATCH_VALUES // max(widths, default=1)))
        with pq.ParquetWriter(sink, final, compression="zstd") as writer:
            for batch in pq.ParquetFile(spill).iter_batches(batch_size=batch_rows):
                writer.write_table(pa.Table.from_batches([batch]).cast(final))
    return rows
