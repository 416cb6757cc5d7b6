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
- list values are counted from the page headers and the repetition levels (`_ListBound`), since
  a run of one repetition level and one dictionary index is a few bytes of page for any number of
  values (a 1,351-byte file of one row of 40 million strings grew a process by 1,153 MB): a row
  group whose values take, at the least (`element_bytes` each past a row's first), more than
  its rows may hold at the line limit, or a file whose take more than the file limit, is refused;
  where a row group could hold a row past the line limit, the values of each of its rows are
  counted from the levels run by run (`row_values`, `storage/parquet_pages.py`), summed over the
  row's list columns, and the first row past the limit refused. A file of more than `max_pages`
  pages is refused, since each header costs time to read.
What is not bounded below the file limit: values that are not list elements (one per row and
column) are sized from their pages, as above, not from their levels.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from storage.parquet_pages import Page, PageHeaderError, TooManyRuns, pages, row_values

SLICE_BYTES = 8 * 1024 * 1024  # decoded bytes made Python objects at once
SLICE_VALUES = 1_000_000  # list values a record batch is cut to hold (about 8 MB of integers)
SCALAR_BYTES = 24  # a number, bool or timestamp as JSON text, at most (an estimate, not a bound)
LIST_VALUE_BYTES = 2  # the least a list element takes as JSON text ("1,")
VALUE_OVERHEAD = 16  # page bytes a value takes besides its decoded size (length prefix, levels)
DECOMPRESSED_FACTOR = 8  # all pages decompressed, at most, in file limits (an int64 page holds
# a list element of 2 JSON bytes in 8, plus its levels)
STRING_ELEMENT_BYTES = 3  # the least a further element of a list of strings or structs takes as
# JSON text: '""' or '{}' (or '[]' of a list in a list) and a comma; of numbers, LIST_VALUE_BYTES
PAGE_BYTES = 4096  # a file may have a page per this many bytes of FREIGHT_MAX_FILE_BYTES ...
MIN_PAGES = 4096  # ... and this many pages whatever the limit: reading a header costs time, not
# memory (about 15 microseconds), and pyarrow's writer fills a page to 1 MB or 20,000 rows
RUN_BYTES = 1024  # runs of repetition levels counted, at most: two per row (pyarrow's writer
# starts a long list with a bit-packed group, then a run of its values) and one per this many
# bytes of the file limit (a bit-packed run holds up to 504 values of 2 bytes at least); a run
# costs 2 to 20 microseconds to count, so about 6 s at most at the default limits
ROWS_PAST_LIMIT = 1024  # rows past FREIGHT_MAX_REQUESTS_PER_FILE whose levels are still counted:
# the reader decodes a batch (at most 512 rows) before the row limit ends the lines


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


def max_pages(limits: DecodeLimits) -> int:
    """Pages a file may have: one per PAGE_BYTES of the file limit, MIN_PAGES at least."""
    return max(MIN_PAGES, limits.max_total_bytes // PAGE_BYTES)


def max_runs(limits: DecodeLimits) -> int:
    """Runs of repetition levels a file may have counted (`RUN_BYTES`)."""
    return 2 * (limits.max_rows + ROWS_PAST_LIMIT + 1) + limits.max_total_bytes // RUN_BYTES


def element_bytes(column: pq.ColumnSchema) -> int:
    """The least JSON text a further value of a repeated leaf column adds to its row: a comma and
    the least element it can start (a number: '1'; a string, struct or list: '""', '{}', '[]')."""
    if column.physical_type in ("BYTE_ARRAY", "FIXED_LEN_BYTE_ARRAY"):
        return STRING_ELEMENT_BYTES
    return LIST_VALUE_BYTES


def page_refusal(source: IO[bytes], pf: pq.ParquetFile, limits: DecodeLimits) -> Refusal | None:
    """The first page that would decompress to more than its values may take, or the page at
    which all pages together pass their bound, from the page headers alone; then the first row
    group whose list values take, at the least, more than its rows may hold; None if none does."""
    budget = DECOMPRESSED_FACTOR * limits.max_total_bytes
    most_pages = max_pages(limits)
    meta = pf.metadata
    first_rows = [1]  # of each row group, 1-based
    for g in range(meta.num_row_groups):
        first_rows.append(first_rows[-1] + meta.row_group(g).num_rows)
    lists = _ListBound(source, pf, limits, first_rows)
    total = count = 0
    try:
        for page in pages(source, meta):
            row = first_rows[page.row_group]
            count += 1
            if count > most_pages:
                return Refusal(
                    row,
                    "file_too_large",
                    f"{_where(page, row)}: the file has more than {most_pages} pages, one per "
                    f"{PAGE_BYTES} bytes of the {limits.max_total_bytes} byte limit on a file",
                )
            values = max(1, page.values)
            if page.uncompressed > limits.max_total_bytes + VALUE_OVERHEAD * values:
                return Refusal(
                    row,
                    "file_too_large",
                    f"{_where(page, row)}: a page decompresses to {page.uncompressed} bytes, more than the "
                    f"{limits.max_total_bytes} byte limit on a file",
                )
            if page.uncompressed > (limits.max_line_bytes + VALUE_OVERHEAD) * values:
                return Refusal(
                    row,
                    "line_too_large",
                    f"{_where(page, row)}: a page of {values} value(s) decompresses to {page.uncompressed} "
                    f"bytes, more than {values} line(s) may hold at the {limits.max_line_bytes} "
                    "byte limit on a line",
                )
            total += page.uncompressed
            if total > budget:
                return Refusal(
                    row,
                    "file_too_large",
                    f"{_where(page, row)}: the file's pages decompress to more than {budget} bytes, "
                    f"{DECOMPRESSED_FACTOR} times the {limits.max_total_bytes} byte limit",
                )
            refusal = lists.add(page)
            if refusal is not None:
                return refusal
        return lists.end()
    except PageHeaderError as exc:
        return Refusal(1, "invalid_parquet", f"the file is not readable Parquet: {exc}"[:500])


def _where(page: Page, row: int) -> str:
    return f"row group {page.row_group + 1} (from row {row}), column '{page.column}'"


class _ListBound:
    """The least a row group's list values take decoded, from the values its data pages state.

    A row's first value in a leaf column may be its list being empty; every further value is a
    further list element, which takes at least ``element_bytes`` of JSON text: a row group of R
    rows whose leaf column holds V values takes at least (V - R) times that, whatever the encoding
    (a run of one dictionary index or of one repetition level is a few bytes of page for millions
    of values). Leaves of one top-level column (a message's role and content) share elements, so
    a column counts its largest leaf; columns add up. R is the footer's rows, or fewer if a column
    holds fewer values (every row has a value in every leaf). Refused: a row group whose least
    exceeds its rows at the line limit, or the file's least exceeding the file limit; and a data
    page v2 (which states its rows, and starts at a row) whose least exceeds its own rows."""

    def __init__(
        self, source: IO[bytes], pf: pq.ParquetFile, limits: DecodeLimits, first_rows: list[int]
    ) -> None:
        schema = pf.schema
        repeated = [i for i in range(len(schema)) if schema.column(i).max_repetition_level > 0]
        self.cost = {schema.column(i).path: element_bytes(schema.column(i)) for i in repeated}
        self.index = {schema.column(i).path: i for i in repeated}
        self.depth = {schema.column(i).path: schema.column(i).max_repetition_level for i in repeated}
        self.leaves = len(schema)
        self.source, self.meta, self.limits, self.first_rows = source, pf.metadata, limits, first_rows
        self.group = -1
        self.values: dict[str, int] = {}  # data page values of each leaf column in this group
        self.chunks: dict[str, list[Page]] = {}  # the pages of each repeated leaf in this group
        self.v2_rows: dict[str, int] = {}  # rows of the data pages v2 so far, per repeated leaf
        self.total = 0  # the least the file's list values take, over the row groups done
        self.runs = max_runs(limits)
        self.runs_left = self.runs  # repetition level runs the file may still have counted

    def add(self, page: Page) -> Refusal | None:
        refusal = None
        if page.row_group != self.group:
            refusal = self.end()
            self.group, self.values, self.v2_rows, self.chunks = page.row_group, {}, {}, {}
        if page.column in self.cost:
            self.chunks.setdefault(page.column, []).append(page)
        if not page.is_data:
            return refusal
        self.values[page.column] = self.values.get(page.column, 0) + page.values
        cost = self.cost.get(page.column)
        if refusal is None and cost is not None and page.rows is not None:
            first = self.first_rows[self.group] + self.v2_rows.get(page.column, 0)
            self.v2_rows[page.column] = self.v2_rows.get(page.column, 0) + page.rows
            least = max(0, page.values - page.rows) * cost
            if least > max(1, page.rows) * self.limits.max_line_bytes:
                return Refusal(
                    first,
                    "line_too_large",
                    f"row group {self.group + 1} (from row {self.first_rows[self.group]}), column "
                    f"'{page.column}': a page of {page.rows} row(s) holds {page.values} list values, "
                    f"at least {least} bytes decoded, more than {max(1, page.rows)} line(s) may "
                    f"hold at the {self.limits.max_line_bytes} byte limit on a line",
                )
        return refusal

    def end(self) -> Refusal | None:
        """The row group read so far, once its pages are all read."""
        g = self.group
        if g < 0 or not self.values:
            return None
        rows = self.meta.row_group(g).num_rows
        if len(self.values) >= self.leaves:  # every leaf column: a row has a value in each
            rows = min(rows, *self.values.values())
        least: dict[str, int] = {}  # per top-level column, its largest leaf's least
        for column, cost in self.cost.items():
            bytes_ = max(0, self.values.get(column, 0) - rows) * cost
            top = column.split(".", 1)[0]
            least[top] = max(least.get(top, 0), bytes_)
        group_least = sum(least.values())
        self.total += group_least
        where = f"row group {g + 1} (from row {self.first_rows[g]})"
        if least and group_least > max(1, rows) * self.limits.max_line_bytes:
            column = max(least, key=least.__getitem__)
            return Refusal(
                self.first_rows[g],
                "line_too_large",
                f"{where}, column '{column}': its {max(1, rows)} row(s) hold list values of at "
                f"least {group_least} bytes decoded, more than {max(1, rows)} line(s) may hold at "
                f"the {self.limits.max_line_bytes} byte limit on a line",
            )
        if self.total > self.limits.max_total_bytes:
            return Refusal(
                self.first_rows[g],
                "file_too_large",
                f"{where}: the file's list values take at least {self.total} bytes decoded, more "
                f"than the {self.limits.max_total_bytes} byte limit",
            )
        try:
            return self._long_row(g, rows)
        except TooManyRuns:
            return Refusal(
                self.first_rows[g],
                "file_too_large",
                f"{where}: the file's repetition levels come in more than {self.runs} runs, two "
                f"a row and one per {RUN_BYTES} bytes of the {self.limits.max_total_bytes} byte "
                "limit",
            )

    def _long_row(self, g: int, rows: int) -> Refusal | None:
        """The first row of row group ``g`` whose list values take more than the line limit, if
        one may: its values in each repeated leaf counted from the levels, as the group's are."""
        first = self.first_rows[g]
        counted = min(rows, max(0, self.limits.max_rows + ROWS_PAST_LIMIT + 1 - first))
        most: dict[str, int] = {}  # per top-level column, the most its largest leaf can take
        for column, cost in self.cost.items():
            top = column.split(".", 1)[0]
            most[top] = max(most.get(top, 0), max(0, self.values.get(column, 0) - rows) * cost)
        if not counted or sum(most.values()) <= self.limits.max_line_bytes:
            return None  # no row can pass the line limit
        least: dict[str, np.ndarray] = {}  # per top-level column and row, its largest leaf's least
        counts: dict[str, np.ndarray] = {}
        for column, cost in self.cost.items():
            chunk = self.meta.row_group(g).column(self.index[column])
            counts[column], spent = row_values(
                self.source,
                self.chunks.get(column, []),
                chunk.compression,
                self.depth[column],
                counted,
                self.runs_left,
            )
            self.runs_left -= spent
            top = column.split(".", 1)[0]
            taken = np.maximum(counts[column] - 1, 0) * cost
            least[top] = np.maximum(least[top], taken) if top in least else taken
        total = sum(least.values(), np.zeros(counted, np.int64))
        over = np.flatnonzero(total > self.limits.max_line_bytes)
        if not len(over):
            return None
        i = int(over[0])
        column = max(counts, key=lambda c: int(counts[c][i]) * self.cost[c])
        return Refusal(
            first + i,
            "line_too_large",
            f"row {first + i}, column '{column}': holds {int(counts[column][i])} list values; the "
            f"row's list values take at least {int(total[i])} bytes decoded; the limit is "
            f"{self.limits.max_line_bytes}",
        )


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
