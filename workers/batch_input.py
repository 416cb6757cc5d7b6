"""A batch's input file as a stream of request lines, whatever its format.

JSONL is streamed line by line from the object store. Parquet (told by its ``PAR1`` magic, not its
name) needs random access to its footer, so it is first copied to a local temporary file in the
spill directory (streamed: disk, not memory), then read a record batch at a time and turned into
the same OpenAI batch lines (``storage.request_tables``); a row that cannot become a line arrives
as a ``RowError`` naming its row and column.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

from storage.objectstore import CHUNK, ObjectStore, iter_lines
from storage.parquet_limits import DecodeLimits
from storage.request_tables import ParquetChunk, RowError, first_rows, is_parquet, request_lines


@dataclass
class RequestSource:
    lines: Iterable[bytes | RowError]
    parquet: bool
    columns: tuple[str, ...] = ()  # the Parquet file's columns (error messages name them)


def head_bytes(store: ObjectStore, key: str, n: int = 4) -> bytes:
    with store.open(key) as stream:
        return stream.read(n)


@contextmanager
def local_copy(store: ObjectStore, key: str, spill_dir: str) -> Iterator[str]:
    """A Parquet input copied to a local temporary file (Parquet needs random access to its
    footer), streamed: disk, not memory; deleted on exit."""
    with tempfile.NamedTemporaryFile(dir=spill_dir, suffix=".parquet") as local:
        with store.open(key) as stream:
            shutil.copyfileobj(stream, local, CHUNK)
        local.flush()
        yield local.name


def _columns(path: str) -> tuple[str, ...]:
    try:
        import pyarrow.parquet as pq

        return tuple(pq.read_schema(path).names)
    except Exception:
        return ()  # request_lines reports the unreadable file as the first row's error


@contextmanager
def open_requests(
    store: ObjectStore,
    key: str,
    endpoint: str,
    defaults: Mapping[str, Any],
    spill_dir: str,
    limits: DecodeLimits,
) -> Iterator[RequestSource]:
    """The file's lines: JSONL as stored, Parquet rows as lines decoded within ``limits``."""
    if not is_parquet(head_bytes(store, key)):
        with store.open(key) as stream:
            yield RequestSource(iter_lines(stream), False)
        return
    with local_copy(store, key, spill_dir) as path:
        yield RequestSource(request_lines(path, endpoint, defaults, limits), True, _columns(path))


@contextmanager
def open_chunk(
    store: ObjectStore,
    key: str,
    endpoint: str,
    defaults: Mapping[str, Any],
    spill_dir: str,
    limits: DecodeLimits,
    start: int,
    stop: int,
) -> Iterator[tuple[RequestSource, ParquetChunk | None]]:
    """One chunk's lines: of a JSONL file, those that start in bytes ``[start, stop)``; of a
    Parquet file, the rows of row groups ``[start, stop)`` (numbered as in the whole file, from
    the returned ParquetChunk's ``first_row + 1``)."""
    if not is_parquet(head_bytes(store, key)):
        with store.open_from(key, max(start - 1, 0)) as stream:
            yield RequestSource(range_lines(stream, start, stop), False), None
        return
    with local_copy(store, key, spill_dir) as path:
        chunk = ParquetChunk(start, stop, first_rows(path, [(start, stop)])[0])
        lines = request_lines(path, endpoint, defaults, limits, chunk)
        yield RequestSource(lines, True, _columns(path)), chunk


class _Prefixed:
    """A stream with bytes already read put back in front of it."""

    def __init__(self, head: bytes, stream: IO[bytes]) -> None:
        self.head = head
        self.stream = stream

    def read(self, n: int = -1) -> bytes:
        if self.head:
            head, self.head = self.head, b""
            return head
        return self.stream.read(n)


def range_lines(stream: IO[bytes], start: int, stop: int) -> Iterator[bytes]:
    """The lines (as ``iter_lines`` makes them) that start at a byte in ``[start, stop)``, from
    ``stream`` positioned at ``start - 1`` (at 0 when start is 0): a line starts at byte 0 and
    after each newline, so the line under way at ``start`` belongs to the chunk before, and the
    last line may run past ``stop``. Chunks cut anywhere thus hold every line once."""
    pos = start
    if start > 0:
        pos = start - 1
        while True:  # skip to the first line start at or after ``start``
            piece = stream.read(CHUNK)
            if not piece:
                return
            newline = piece.find(b"\n")
            if newline >= 0:
                pos += newline + 1
                stream = _Prefixed(piece[newline + 1 :], stream)  # type: ignore[assignment]
                break
            pos += len(piece)
    for line in iter_lines(stream):
        if pos >= stop:
            return
        yield line
        pos += len(line) + 1
