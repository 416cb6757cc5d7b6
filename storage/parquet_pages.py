"""The pages of a Parquet file as their headers state them, read without decompressing a page.

Why: the reader allocates each page's decompressed size (``uncompressed_page_size`` in the page
header) before it decodes a value, and one page can hold a single value of any size. A 10 kB file
with one 300 MB string in one zstd page grew the process by 916 MB before any row could be sized
(issue #19, section 1). The footer's column totals cannot tell one huge page from many small ones,
and a writer can leave a dictionary page's values unreferenced, so neither the rows nor the
footer bound what decompression costs; the page headers do, and they are what the reader trusts.

Page headers are Thrift structs in the compact protocol (``PageHeader`` in parquet.thrift): fields
1-3 are the page type, its uncompressed and its compressed size; the rest (statistics, encodings)
is skipped. A column chunk's pages follow each other from its first page (the dictionary page, if
any) for ``total_compressed_size`` bytes, the range the reader reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

BLOCK = 1024 * 1024  # file bytes read at once while walking headers
MAX_HEADER_BYTES = 16 * 1024 * 1024  # the reader's own limit on one page header
MAX_DEPTH = 32  # nesting of Thrift structs and lists in a header (PageHeader needs 4)


COUNTED = frozenset({5, 7, 8})  # data page, dictionary page, data page v2: field 1 is num_values
NUM_VALUES = -1  # where _struct puts a counted page header's num_values
NUM_ROWS = -3  # and a data page v2's num_rows (its field 3)
REP_ENCODING = -4  # a data page's repetition_level_encoding (its field 4; RLE is 3)
REP_BYTES = -6  # a data page v2's repetition_levels_byte_length (its field 6)
RLE = 3
DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 1, 2, 3  # PageHeader field 1


class PageHeaderError(ValueError):
    """A page header that cannot be read: the file is not readable Parquet."""


@dataclass(frozen=True)
class Page:
    row_group: int
    column: str  # the column's path in the schema, "messages.list.element.content"
    uncompressed: int  # bytes the reader decompresses the page to
    compressed: int
    values: int  # values the page holds, nulls and list elements included (0: an index page)
    kind: int = DATA_PAGE  # DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE or DATA_PAGE_V2
    rows: int | None = None  # rows the page holds: stated by a data page v2 alone
    offset: int = 0  # where the page's bytes start in the file, after its header
    rep_encoding: int | None = None  # a data page's encoding of its repetition levels
    rep_bytes: int | None = None  # a data page v2's bytes of repetition levels (not compressed)

    @property
    def is_data(self) -> bool:
        return self.kind in (DATA_PAGE, DATA_PAGE_V2)


class TooManyRuns(ValueError):
    """Repetition levels in more runs than the caller allows: counting them costs time."""


class _Short(Exception):
    """The header runs past the bytes read so far."""


def pages(source: IO[bytes], metadata: pq.FileMetaData) -> Iterator[Page]:
    """Every page of every column chunk, in file order of row groups; ``source`` is seekable."""
    blocks = _Blocks(source)  # shared by the chunks: a file of many small chunks reads each block once
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            start = chunk.data_page_offset
            if chunk.has_dictionary_page and 0 < (chunk.dictionary_page_offset or 0) < start:
                start = chunk.dictionary_page_offset  # as the reader computes the chunk's range
            yield from _chunk_pages(
                blocks, g, chunk.path_in_schema, start, start + chunk.total_compressed_size
            )


class _Blocks:
    """File bytes [at, at + len(buf)) held; eof: they reach the end of the file."""

    def __init__(self, source: IO[bytes]) -> None:
        self.source, self.buf, self.at, self.eof = source, b"", 0, False

    def header(self, pos: int, column: str) -> tuple[dict[int, int], int]:
        """The page header at ``pos``: its fields, and the file position where it ends."""
        want = BLOCK
        while True:
            if not self.at <= pos < self.at + len(self.buf):
                self.source.seek(pos)
                self.buf, self.at = self.source.read(want), pos
                self.eof = len(self.buf) < want
            try:
                fields, used = _struct(self.buf, pos - self.at, 0, {1, 2, 3}, COUNTED)
                return fields, self.at + used
            except _Short:
                if self.eof or want >= MAX_HEADER_BYTES:
                    raise PageHeaderError(
                        f"column '{column}': the page header at byte {pos} is cut off"
                    ) from None
                if pos == self.at:  # a header longer than a block: read more of it
                    want *= 4
                self.buf = b""


def _chunk_pages(blocks: _Blocks, group: int, column: str, pos: int, end: int) -> Iterator[Page]:
    while pos < end:
        fields, after = blocks.header(pos, column)
        uncompressed, compressed = fields.get(2, -1), fields.get(3, -1)
        if uncompressed < 0 or compressed < 0:
            raise PageHeaderError(f"column '{column}': the page header at byte {pos} states no sizes")
        values = max(0, fields.get(NUM_VALUES, 0))
        rows = max(0, fields[NUM_ROWS]) if NUM_ROWS in fields else None
        yield Page(
            group,
            column,
            uncompressed,
            compressed,
            values,
            fields.get(1, DATA_PAGE),
            rows,
            after,
            fields.get(REP_ENCODING),
            fields.get(REP_BYTES),
        )
        pos = after + compressed


def row_values(
    source: IO[bytes], chunk: list[Page], compression: str, max_repetition: int, rows: int, runs: int
) -> tuple[np.ndarray, int]:
    """Values of each of the first ``rows`` rows of a column chunk (a null or empty list is one),
    from the repetition levels of the chunk's data pages (``chunk``, in file order).

    A row starts at each repetition level 0, so a run of millions of levels 1 (a few bytes of
    page) is one row of millions of list values. A data page v2 keeps its levels uncompressed
    before its values; a data page (v1) is decompressed (its size already bounded by its header)
    and begins with them. Levels are the RLE / bit-packed hybrid, counted run by run; levels in
    another encoding, or a page that does not decompress, are a PageHeaderError; more than
    ``runs`` runs, TooManyRuns. Returns the values of each row and the runs counted."""
    counts = _RowCounts(rows, runs)
    width = max_repetition.bit_length()
    for page in chunk:
        if not page.is_data or not page.values:
            continue
        if page.kind == DATA_PAGE_V2:
            source.seek(page.offset)
            levels = memoryview(source.read(max(0, min(page.rep_bytes or 0, page.compressed))))
        else:
            if page.rep_encoding != RLE:  # BIT_PACKED, deprecated: not counted, so not read
                raise PageHeaderError(
                    f"column '{page.column}': repetition levels in encoding {page.rep_encoding} "
                    "(only RLE is read for lists this long)"
                )
            source.seek(page.offset)
            raw = _decompress(source.read(page.compressed), page.uncompressed, compression, page.column)
            size = int.from_bytes(raw[:4], "little")
            levels = raw[4 : 4 + size]
        _count_levels(levels, page.values, width, counts)
        if counts.row >= rows:  # every row wanted is counted
            break
    return counts.counts, runs - counts.runs_left


class _RowCounts:
    """Repetition levels fed in order, counted into the rows they belong to (the first ``rows``)."""

    def __init__(self, rows: int, runs: int) -> None:
        self.counts = np.zeros(rows, np.int64)
        self.row = -1  # the row the next value joins unless it starts one
        self.runs_left = runs

    def spend(self) -> None:
        self.runs_left -= 1
        if self.runs_left < 0:
            raise TooManyRuns

    def run(self, level: int, n: int) -> None:
        if level == 0:  # n rows start, each with one value
            first = self.row + 1
            self.row += n
            self.counts[first : self.row + 1] += 1
        elif 0 <= self.row < len(self.counts):
            self.counts[self.row] += n

    def few(self, values: list[int]) -> None:
        """As ``levels``, for a few values: Python is faster than numpy's calls on a handful."""
        row, held, counts = self.row, 0, self.counts
        for value in values:
            if value == 0:
                if held and 0 <= row < len(counts):
                    counts[row] += held
                row, held = row + 1, 1
            else:
                held += 1
        if held and 0 <= row < len(counts):
            counts[row] += held
        self.row = row

    def levels(self, values: np.ndarray) -> None:
        ids = self.row + np.cumsum(values == 0)  # the row of each value
        self.row = int(ids[-1])
        ids = ids[(ids >= 0) & (ids < len(self.counts))]
        if len(ids):
            rows, n = np.unique(ids, return_counts=True)
            self.counts[rows] += n


PACKED_GROUPS = 1 << 16  # groups of 8 bit-packed levels unpacked at once (memory: 4 MB)
FEW_GROUPS = 8  # groups of a bit-packed run counted in Python: faster than numpy below it


def _count_levels(levels: memoryview | bytes, count: int, width: int, rows: _RowCounts) -> None:
    pos, left, size = 0, count, len(levels)
    value_bytes = (width + 7) // 8
    weights = 1 << np.arange(width, dtype=np.int64)
    while left > 0 and pos < size and rows.row < len(rows.counts):
        rows.spend()
        head, pos = _varint(levels, pos)
        if head & 1:  # bit-packed: groups of 8 values, ``width`` bits each
            end = min(size, pos + (head >> 1) * width)
            if end - pos <= FEW_GROUPS * width:  # a few groups of 8, as at a list's start
                n = min(left, (end - pos) // max(1, width) * 8)
                word = int.from_bytes(levels[pos:end], "little")
                rows.few([(word >> (i * width)) & ((1 << width) - 1) for i in range(n)])
                left -= n
                pos = end
                continue
            while pos < end and left > 0:  # a slice of groups at a time, however many are claimed
                packed = np.frombuffer(levels[pos : min(end, pos + PACKED_GROUPS * width)], np.uint8)
                pos += len(packed)
                bits = np.unpackbits(packed, bitorder="little")
                n = min(left, len(bits) // max(1, width))
                if n:
                    rows.levels(bits[: n * width].reshape(n, width) @ weights)
                left -= n
            pos = end
        else:  # a run of one value
            n = min(left, head >> 1)
            level = int.from_bytes(levels[pos : pos + value_bytes], "little")
            pos += value_bytes
            rows.run(level, n)
            left -= n


CODECS = {"SNAPPY": "snappy", "GZIP": "gzip", "BROTLI": "brotli", "ZSTD": "zstd", "LZ4_RAW": "lz4_raw"}


def _decompress(data: bytes, size: int, compression: str, column: str) -> memoryview:
    if compression == "UNCOMPRESSED":
        return memoryview(data)
    tries = (
        [CODECS[compression]] if compression in CODECS else ["lz4_raw", "lz4"] if compression == "LZ4" else []
    )
    for codec in tries:
        try:
            return memoryview(pa.decompress(data, size, codec=codec, asbytes=True))
        except (pa.ArrowException, ValueError):
            continue
    if compression == "LZ4" and len(data) > 8:  # Hadoop's framing: two sizes before each block
        try:
            return memoryview(pa.decompress(data[8:], size, codec="lz4_raw", asbytes=True))
        except (pa.ArrowException, ValueError):
            pass
    raise PageHeaderError(f"column '{column}': a page cannot be decompressed as {compression}")


def _varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise _Short
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise PageHeaderError("a page header holds a varint of more than 64 bits")


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _struct(
    buf: bytes, pos: int, depth: int, wanted: set[int] | None = None, counted: frozenset[int] = frozenset()
) -> tuple[dict[int, int], int]:
    """A compact-protocol struct from ``pos``: the ``wanted`` i32 fields (and field 1 of the
    ``counted`` struct fields, as NUM_VALUES; a data page v2's field 3, as NUM_ROWS), and where
    it ends."""
    if depth > MAX_DEPTH:
        raise PageHeaderError("a page header is nested too deeply")
    fields: dict[int, int] = {}
    field = 0
    while True:
        if pos >= len(buf):
            raise _Short
        head = buf[pos]
        pos += 1
        if head == 0:  # STOP
            return fields, pos
        kind, delta = head & 0x0F, head >> 4
        if delta:
            field += delta
        else:
            raw, pos = _varint(buf, pos)
            field = _zigzag(raw)
        if wanted and field in wanted and kind == 5:  # i32
            raw, pos = _varint(buf, pos)
            fields[field] = _zigzag(raw)
        elif kind in (1, 2):  # a bool field's value is its type nibble
            continue
        elif kind == 12 and field in counted:
            inner, pos = _struct(buf, pos, depth + 1, {1, 3, 4, 6})
            if 1 in inner:
                fields[NUM_VALUES] = inner[1]
            if field == 5 and 4 in inner:  # DataPageHeader.repetition_level_encoding
                fields[REP_ENCODING] = inner[4]
            if field == 8 and 3 in inner:  # DataPageHeaderV2.num_rows
                fields[NUM_ROWS] = inner[3]
            if field == 8 and 6 in inner:  # DataPageHeaderV2.repetition_levels_byte_length
                fields[REP_BYTES] = inner[6]
        else:
            pos = _skip(buf, pos, kind, depth)


def _skip(buf: bytes, pos: int, kind: int, depth: int) -> int:
    """Past one value of compact type ``kind`` (bools here are a byte: list elements)."""
    if kind in (1, 2, 3):  # bool element, byte
        end = pos + 1
    elif kind in (4, 5, 6):  # i16, i32, i64: zigzag varints
        _, end = _varint(buf, pos)
    elif kind == 7:  # double
        end = pos + 8
    elif kind == 8:  # binary: varint length, bytes
        size, pos = _varint(buf, pos)
        end = pos + size
    elif kind in (9, 10):  # list, set: size and element type, elements
        if pos >= len(buf):
            raise _Short
        size, element = buf[pos] >> 4, buf[pos] & 0x0F
        pos += 1
        if size == 15:
            size, pos = _varint(buf, pos)
        for _ in range(size):  # each element takes a byte at least, so _Short ends a false size
            pos = _skip(buf, pos, element, depth + 1)
        end = pos
    elif kind == 11:  # map: size, key and value types, pairs
        size, pos = _varint(buf, pos)
        if size:
            if pos >= len(buf):
                raise _Short
            key, value = buf[pos] >> 4, buf[pos] & 0x0F
            pos += 1
            for _ in range(size):
                pos = _skip(buf, _skip(buf, pos, key, depth + 1), value, depth + 1)
        end = pos
    elif kind == 12:
        _, end = _struct(buf, pos, depth + 1)
    else:
        raise PageHeaderError(f"a page header holds a value of unknown type {kind}")
    if end > len(buf):
        raise _Short
    return end
