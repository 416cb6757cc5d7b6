"""What a drop folder stores for an inbox object: the object's bytes, gunzipped for ``.jsonl.gz``,
with the folder's model given to lines that name none. Streams in bounded memory (a chunk and one
line); a broken gzip is the file's fault (``InvalidInput``), a failed read is the store's
(``ObjectStoreError`` passes through).
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator
from typing import IO

from scheduler.dropfolder_plan import fill_model
from storage.objectstore import CHUNK, ChunkReader


class InvalidInput(Exception):
    """The object cannot be a batch's input; ``code`` and ``message`` go to its manifest."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def request_stream(raw: IO[bytes], gz: bool, model: str | None, max_line_bytes: int) -> IO[bytes]:
    """The bytes Freight stores for an inbox object: gunzipped, lines without ``body.model``
    given ``model``. Streams; holds at most a chunk and one line of up to ``max_line_bytes``."""
    stream: IO[bytes] = _Gunzip(raw) if gz else raw  # type: ignore[assignment]
    if model is None:
        return stream
    return io.BufferedReader(ChunkReader(with_model(stream, model, max_line_bytes)), CHUNK)


def with_model(stream: IO[bytes], model: str, max_line_bytes: int) -> Iterator[bytes]:
    head: list[bytes] = []
    size = 0
    first = True
    passing = False  # inside a line too long to rewrite: pass it on as it is (validation refuses it)
    while chunk := stream.read(CHUNK):
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            piece = chunk[start:end]
            if passing:
                yield piece + b"\n"
                passing = False
            else:
                yield fill_model(b"".join([*head, piece]), model, first) + b"\n"
                head, size = [], 0
            first = False
            start = end + 1
        rest = chunk[start:]
        if rest and passing:
            yield rest
        elif rest:
            head.append(rest)
            size += len(rest)
            if size > max_line_bytes:
                yield b"".join(head)
                head, size, passing = [], 0, True
    if head:
        yield fill_model(b"".join(head), model, first) + b"\n"


class _Gunzip(io.RawIOBase):
    """gzip decompression whose format errors say the file is bad (network errors of the source
    are ObjectStoreError, which pass through untouched)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._gz = gzip.GzipFile(fileobj=raw, mode="rb")

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        try:
            return self._gz.read(size)
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise InvalidInput("invalid_gzip", f"the file is not valid gzip: {exc}") from exc

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)
