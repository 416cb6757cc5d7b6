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
from typing import Any

from storage.objectstore import CHUNK, ObjectStore, iter_lines
from storage.parquet_limits import DecodeLimits
from storage.request_tables import RowError, is_parquet, request_lines


@dataclass
class RequestSource:
    lines: Iterable[bytes | RowError]
    parquet: bool
    columns: tuple[str, ...] = ()  # the Parquet file's columns (error messages name them)


def head_bytes(store: ObjectStore, key: str, n: int = 4) -> bytes:
    with store.open(key) as stream:
        return stream.read(n)


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
    with tempfile.NamedTemporaryFile(dir=spill_dir, suffix=".parquet") as local:
        with store.open(key) as stream:
            shutil.copyfileobj(stream, local, CHUNK)
        local.flush()
        columns: tuple[str, ...] = ()
        try:
            import pyarrow.parquet as pq

            columns = tuple(pq.read_schema(local.name).names)
        except Exception:
            pass  # request_lines reports the unreadable file as the first row's error
        yield RequestSource(request_lines(local.name, endpoint, defaults, limits), True, columns)
