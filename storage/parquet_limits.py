"""How big a Parquet request file is once decoded, measured before its rows become Python objects.

Why: Parquet is compressed and dictionary-encoded, so a file of a few kilobytes can hold a
string of a megabyte repeated in every row: 1,785 bytes of upload grew the API by 533 MiB when it
was converted to JSONL. The limits a JSONL file meets on its bytes (`FREIGHT_MAX_FILE_BYTES`,
`FREIGHT_MAX_LINE_BYTES`, `FREIGHT_MAX_REQUESTS_PER_FILE`) must hold for what a Parquet file
decodes to, and be checked while decoding, not after.

How memory stays bounded:
- every string and binary column, nested ones included, is read as a dictionary array
  (`dictionary_columns`): a value repeated by the file stays one value in memory, and pages that
  are compressed runs of one value are folded into the dictionary as they are decompressed;
- the decoded size of each row is computed from the arrays' lengths (`row_sizes`): dictionary
  value lengths taken by index, no string copied. Rows over the line limit are reported, the
  running total is held to the file limit, and rows become Python objects a slice of at most
  `SLICE_BYTES` at a time;
- pages of distinct values that compress well, and list columns (token ids, messages) whose
  values repeat, are sized from the footer before anything is decoded: a record batch is cut so
  that its rows average at most a slice of uncompressed pages and `SLICE_VALUES` list values,
  and the count of list values is held to the file limit at 2 bytes a value (the least a list
  element takes as JSON text).
- every page's header is read before anything is decompressed (`page_refusal`,
  `storage/parquet_pages.py`), since one page can be one value of any size: no page may
  decompress to more than its values could take in a file within the limits (the line limit a
  value, the file limit in all, plus `VALUE_OVERHEAD` a value), and all pages together to no more
  than `DECOMPRESSED_FACTOR` times the file limit, since dictionary pages can hold values no row
  refers to. A page is the reader's unit of decompression, and pyarrow's writer puts up to 1,024
  values in one (30 kB prompts: 30 MB pages), so a file that would pass is never refused here, and
  a page as large as the file limit is decompressed before its rows are sized.
What is not bounded below the file limit: a single row whose lists hold far more values than the
rows around it is decoded (as a batch of its row group's average size) before its own size is
known; its dictionary-encoded values take no page bytes, so only the file's count of list values
holds them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from storage.parquet_pages import PageHeaderError, pages

SLICE_BYTES = 8 * 1024 * 1024  # decoded bytes made Python objects at once
SLICE_VALUES = 1_000_000  # list values a record batch is cut to hold (about 8 MB of integers)
SCALAR_BYTES = 24  # a number, bool or timestamp as JSON text, at most (an estimate, not a bound)
LIST_VALUE_BYTES = 2  # the least a list element takes as JSON text ("1,")
VALUE_OVERHEAD = 16  # page bytes a value takes besides its decoded size (length prefix, levels)
DECOMPRESSED_FACTOR = 8  # all pages decompressed, at most, in file limits (an int64 page holds
# a list element of 2 JSON bytes in 8, plus its levels)


@dataclass(frozen=True)
class DecodeLimits:
    """What a request file may decode to; the same limits a JSONL upload meets on its bytes."""

    max_rows: int
    max_line_bytes: int
    max_total_bytes: int


@dataclass(frozen=True)
class Refusal:
    """Why a file is not decoded at all: its first affected row, an error code, the message."""

    row: int
    code: str
    message: str


def page_refusal(source: IO[bytes], pf: pq.ParquetFile, limits: DecodeLimits) -> Refusal | None:
    """The first page that would decompress to more than its values may take, or the page at
    which all pages together pass their bound, from the page headers alone; None if none does."""
    budget = DECOMPRESSED_FACTOR * limits.max_total_bytes
    meta = pf.metadata
    first_rows = [1]  # of each row group, 1-based
    for g in range(meta.num_row_groups):
        first_rows.append(first_rows[-1] + meta.row_group(g).num_rows)
    total = 0
    try:
        for page in pages(source, meta):
            row = first_rows[page.row_group]
            where = f"row group {page.row_group + 1} (from row {row}), column '{page.column}'"
            values = max(1, page.values)
            if page.uncompressed > limits.max_total_bytes + VALUE_OVERHEAD * values:
                return Refusal(
                    row,
                    "file_too_large",
                    f"{where}: a page decompresses to {page.uncompressed} bytes, more than the "
                    f"{limits.max_total_bytes} byte limit on a file",
                )
            if page.uncompressed > (limits.max_line_bytes + VALUE_OVERHEAD) * values:
                return Refusal(
                    row,
                    "line_too_large",
                    f"{where}: a page of {values} value(s) decompresses to {page.uncompressed} "
                    f"bytes, more than {values} line(s) may hold at the {limits.max_line_bytes} "
                    "byte limit on a line",
                )
            total += page.uncompressed
            if total > budget:
                return Refusal(
                    row,
                    "file_too_large",
                    f"{where}: the file's pages decompress to more than {budget} bytes, "
                    f"{DECOMPRESSED_FACTOR} times the {limits.max_total_bytes} byte limit",
                )
    except PageHeaderError as exc:
        return Refusal(1, "invalid_parquet", f"the file is not readable Parquet: {exc}"[:500])
    return None


def dictionary_columns(schema: pq.ParquetSchema) -> list[str]:
    """Paths of the string and binary leaf columns, for ``ParquetFile(read_dictionary=...)``."""
    return [
        schema.column(i).path
        for i in range(len(schema))
        if schema.column(i).physical_type in ("BYTE_ARRAY", "FIXED_LEN_BYTE_ARRAY")
    ]


def list_values(pf: pq.ParquetFile) -> int:
    """Values of the file's repeated (list) leaf columns, from the footer: nothing is decoded."""
    repeated = [i for i in range(len(pf.schema)) if pf.schema.column(i).max_repetition_level > 0]
    meta = pf.metadata
    return sum(meta.row_group(g).column(i).num_values for g in range(meta.num_row_groups) for i in repeated)


def batch_rows(pf: pq.ParquetFile, most: int) -> int:
    """Rows per record batch: ``most``, fewer where a row group's rows average more than
    SLICE_BYTES / ``most`` bytes of uncompressed pages or SLICE_VALUES / ``most`` list values
    (both stated by the footer), so that a batch decodes to about a slice whatever the encoding."""
    meta = pf.metadata
    repeated = {i for i in range(len(pf.schema)) if pf.schema.column(i).max_repetition_level > 0}
    rows = most
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        if not group.num_rows:
            continue
        columns = [group.column(i) for i in range(group.num_columns)]
        page_bytes = sum(c.total_uncompressed_size for c in columns)
        values = sum(c.num_values for i, c in enumerate(columns) if i in repeated)
        rows = min(rows, SLICE_BYTES * group.num_rows // max(1, page_bytes))
        rows = min(rows, SLICE_VALUES * group.num_rows // max(1, values))
    return max(1, rows)


def row_sizes(array: pa.Array) -> np.ndarray:
    """Per row, the bytes its values take decoded (strings and binaries by length, numbers at
    SCALAR_BYTES, two bytes of brackets per list or struct), without copying a string."""
    kind = array.type
    n = len(array)
    if pa.types.is_dictionary(kind):
        sizes = row_sizes(array.dictionary)
        indices = pc.fill_null(array.indices, 0).to_numpy(zero_copy_only=False).astype(np.int64)
        out = sizes[indices] if len(sizes) else np.zeros(n, np.int64)
        return np.where(array.is_null().to_numpy(zero_copy_only=False), 0, out)
    if (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_fixed_size_binary(kind)
    ):
        lengths = pc.fill_null(pc.binary_length(array), 0)
        return lengths.to_numpy(zero_copy_only=False).astype(np.int64)
    if pa.types.is_struct(kind):
        total = np.full(n, 2, np.int64)
        for child in array.flatten():  # children as sliced as their parent
            total += row_sizes(child)
        return total
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        child = array.flatten()
        parents = pc.list_parent_indices(array).to_numpy(zero_copy_only=False)
        sums = np.bincount(parents, weights=row_sizes(child), minlength=n) if len(child) else np.zeros(n)
        return sums.astype(np.int64) + 2
    if pa.types.is_map(kind):
        keys, items = array.keys, array.items
        parents = pc.list_parent_indices(array).to_numpy(zero_copy_only=False)
        weights = row_sizes(keys) + row_sizes(items) if len(keys) else np.zeros(0)
        return np.bincount(parents, weights=weights, minlength=n).astype(np.int64) + 2
    return np.full(n, SCALAR_BYTES, np.int64)


def slices(
    sizes: np.ndarray, budget: int = SLICE_BYTES, alone: int | None = None
) -> Iterator[tuple[int, int]]:
    """Consecutive [start, end) row ranges of at most ``budget`` decoded bytes (at least a row); a
    row over ``alone`` bytes is a range of its own (the caller reports it, never decodes it)."""
    start, held = 0, 0
    for i, size in enumerate(sizes.tolist()):
        if (held and held + size > budget) or (alone is not None and size > alone and i > start):
            yield start, i
            start, held = i, 0
        held += size
        if alone is not None and size > alone:
            yield start, i + 1
            start, held = i + 1, 0
    if start < len(sizes):
        yield start, len(sizes)
