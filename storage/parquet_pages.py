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

import pyarrow.parquet as pq

BLOCK = 1024 * 1024  # file bytes read at once while walking headers
MAX_HEADER_BYTES = 16 * 1024 * 1024  # the reader's own limit on one page header
MAX_DEPTH = 32  # nesting of Thrift structs and lists in a header (PageHeader needs 4)


COUNTED = frozenset({5, 7, 8})  # data page, dictionary page, data page v2: field 1 is num_values
NUM_VALUES = -1  # where _struct puts a counted page header's num_values


class PageHeaderError(ValueError):
    """A page header that cannot be read: the file is not readable Parquet."""


@dataclass(frozen=True)
class Page:
    row_group: int
    column: str  # the column's path in the schema, "messages.list.element.content"
    uncompressed: int  # bytes the reader decompresses the page to
    compressed: int
    values: int  # values the page holds, nulls and list elements included (0: an index page)


class _Short(Exception):
    """The header runs past the bytes read so far."""


def pages(source: IO[bytes], metadata: pq.FileMetaData) -> Iterator[Page]:
    """Every page of every column chunk, in file order of row groups; ``source`` is seekable."""
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            start = chunk.data_page_offset
            if chunk.has_dictionary_page and 0 < (chunk.dictionary_page_offset or 0) < start:
                start = chunk.dictionary_page_offset  # as the reader computes the chunk's range
            yield from _chunk_pages(
                source, g, chunk.path_in_schema, start, start + chunk.total_compressed_size
            )


def _chunk_pages(source: IO[bytes], group: int, column: str, pos: int, end: int) -> Iterator[Page]:
    buf, at, eof = b"", pos, False  # file bytes [at, at + len(buf)) held; eof: they reach the end
    while pos < end:
        want = BLOCK
        while True:
            if not at <= pos < at + len(buf):
                source.seek(pos)
                buf, at = source.read(want), pos
                eof = len(buf) < want
            try:
                fields, used = _struct(buf, pos - at, 0, {1, 2, 3}, COUNTED)
                break
            except _Short:
                if eof or want >= MAX_HEADER_BYTES:
                    raise PageHeaderError(
                        f"column '{column}': the page header at byte {pos} is cut off"
                    ) from None
                if pos == at:  # a header longer than a block: read more of it
                    want *= 4
                buf = b""
        uncompressed, compressed = fields.get(2, -1), fields.get(3, -1)
        if uncompressed < 0 or compressed < 0:
            raise PageHeaderError(f"column '{column}': the page header at byte {pos} states no sizes")
        values = max(0, fields.get(NUM_VALUES, 0))
        yield Page(group, column, uncompressed, compressed, values)
        pos = at + used + compressed


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
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
    ``counted`` struct fields, as NUM_VALUES), and where it ends."""
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
            inner, pos = _struct(buf, pos, depth + 1, {1})
            if 1 in inner:
                fields[NUM_VALUES] = inner[1]
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
