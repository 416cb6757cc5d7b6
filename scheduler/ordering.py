"""Ordering a batch file's requests by prompt, so requests sharing a prefix run next to each other.

Why: vLLM's prefix cache only helps when requests with a common prompt prefix reach the engine
close together. Sorting lines by their prompt's token ids is a depth-first walk of the prefix tree,
which puts every shared prefix in one contiguous stretch. Files can hold millions of lines, so the
sort is an external merge sort whose memory is bounded by the caller, not by the file.

Pure logic: the only I/O is anonymous temporary spill files, deleted however iteration ends.
"""

from __future__ import annotations

import heapq
import struct
import sys
import tempfile
import zlib
from array import array
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

KEY_TOKEN_BYTES = 4
"""Bytes per token id in a prompt key: big-endian uint32, so byte order is token order."""

ADAPTER_MARKER = 1 << 31  # a LoRA adapter's marker token (``adapter_key``): no token id is this large
ADAPTER_MARKER_BYTE = ADAPTER_MARKER >> 24  # its first byte, and the least first byte of any marker

_ARRAY_CODE = next(code for code in "IL" if array(code).itemsize == KEY_TOKEN_BYTES)
_SWAP = sys.byteorder == "little"

Record = tuple[bytes, int, bytes]
"""``(key, line_number, payload)``: the line number makes equal keys sort stably and deterministically."""

RECORD_OVERHEAD = 160
"""Approximate bytes of Python objects around one buffered record (tuple, two bytes objects, an int)."""

_HEADER = struct.Struct(">IqI")  # key length, line number, payload length
_READ_BUFFER = 64 * 1024
_DEFAULT_FAN_IN = 64


def prompt_key(token_ids: Sequence[int], max_tokens: int) -> bytes:
    """The first ``max_tokens`` token ids as big-endian uint32s: bytes order == token-sequence order.

    A sequence sorts before its extensions (a shorter bytes prefix sorts first), and ids of any
    size up to 2**32 - 1 compare numerically because every id takes the same four bytes.
    Raises ``OverflowError`` for an id outside uint32.
    """
    if max_tokens <= 0:
        return b""
    ids = array(_ARRAY_CODE, token_ids[:max_tokens])
    if _SWAP:
        ids.byteswap()
    return ids.tobytes()


def adapter_key(adapter: str, key: bytes) -> bytes:
    """The prompt key of a line a LoRA adapter serves: its prompt's key after a marker token of
    the adapter (a value no token id takes: 2**31 and above, the adapter's CRC-32 below that).

    Why: vLLM's prefix cache is per adapter (a KV block's hash includes the adapter), so a prefix
    two adapters' lines share is computed once per adapter whatever their order. Sorted with the
    marker first, an adapter's lines run together, each group in prompt order (its shared prefixes
    next to each other, as before); lines of the base keep their plain keys and sort first; and
    ``common_prefix_tokens`` finds nothing shared between two adapters' lines, which is what the
    cache will do."""
    marker = ADAPTER_MARKER | (zlib.crc32(adapter.encode()) & (ADAPTER_MARKER - 1))
    return marker.to_bytes(KEY_TOKEN_BYTES, "big") + key


def common_prefix_tokens(a: bytes, b: bytes) -> int:
    """How many leading tokens two prompt keys share (how much prefix cache one leaves for the other);
    the marker of an adapter's keys (``adapter_key``) is no token of the prompt and is not counted."""
    shared = _common_prefix(a, b)
    return shared - 1 if shared and a[0] >= ADAPTER_MARKER_BYTE else shared


def _common_prefix(a: bytes, b: bytes) -> int:
    hi = min(len(a), len(b)) // KEY_TOKEN_BYTES
    if a[: hi * KEY_TOKEN_BYTES] == b[: hi * KEY_TOKEN_BYTES]:
        return hi
    lo = 0  # invariant: the first lo tokens are equal, the first hi are not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        end = mid * KEY_TOKEN_BYTES
        if a[:end] == b[:end]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class SortStats:
    """Filled in by ``sort_records`` as it runs, so callers and tests can see whether it spilled."""

    records: int = 0
    runs_spilled: int = 0  # sorted runs written from the memory buffer
    runs_merged: int = 0  # intermediate merges, done when too many runs would be open at once


def _record_size(key: bytes, payload: bytes) -> int:
    return len(key) + len(payload) + RECORD_OVERHEAD


def _write_run(records: Iterable[Record], spill_dir: str | None) -> IO[bytes]:
    run = tempfile.TemporaryFile(dir=spill_dir, buffering=_READ_BUFFER)  # noqa: SIM115 - closed by caller
    try:
        dump_records(records, run)
        run.flush()
        run.seek(0)
    except BaseException:
        run.close()
        raise
    return run


def dump_records(records: Iterable[Record], out: IO[bytes]) -> None:
    """Sorted records written as one run (the spill format), for a run kept past the sort: a
    chunk of a file validated apart hands its run to the merge this way."""
    pack, write = _HEADER.pack, out.write
    for key, line, payload in records:
        write(pack(len(key), line, len(payload)))
        write(key)
        write(payload)


def load_records(run: IO[bytes]) -> Iterator[Record]:
    """The records of a run ``dump_records`` wrote, streamed."""
    return _read_run(run)


def _read_run(run: IO[bytes]) -> Iterator[Record]:
    """Stream one run back, one record at a time (the file object buffers the reads)."""
    read, size, unpack = run.read, _HEADER.size, _HEADER.unpack
    while header := read(size):
        key_len, line, payload_len = unpack(header)
        yield read(key_len), line, read(payload_len)


def sort_records(
    records: Iterable[Record],
    *,
    memory_bytes: int,
    spill_dir: str | Path | None = None,
    stats: SortStats | None = None,
    max_open_runs: int = _DEFAULT_FAN_IN,
) -> Generator[Record, None, None]:
    """Yield ``(key, line_number, payload)`` records sorted by ``(key, line_number)``, in bounded memory.

    Records are buffered until their estimated size exceeds ``memory_bytes``; each full buffer is
    sorted and spilled to an anonymous temporary file in ``spill_dir`` as a run. The output merges
    the runs (one record of each in memory) with the last buffer. At most ``max_open_runs`` runs
    per level are kept: when a level fills up its runs are merged into one run a level up, so any
    file size works within the open-file limit at O(log) passes over the data.

    Spill files are closed (and so gone) when the generator finishes, raises or is closed early.
    """
    if stats is None:
        stats = SortStats()
    fan_in = max(2, max_open_runs)
    spill = None if spill_dir is None else str(spill_dir)
    levels: list[list[IO[bytes]]] = []
    try:
        buffer: list[Record] = []
        used = 0
        for record in records:
            buffer.append(record)
            stats.records += 1
            used += _record_size(record[0], record[2])
            if used > memory_bytes:
                buffer.sort()
                _add_run(levels, 0, _write_run(buffer, spill), fan_in, spill, stats)
                stats.runs_spilled += 1
                buffer = []
                used = 0
        buffer.sort()
        runs = [run for level in levels for run in level]
        if not runs:
            yield from buffer
            return
        yield from heapq.merge(*(_read_run(run) for run in runs), buffer)
    finally:
        for level in levels:
            for run in level:
                run.close()


def _add_run(
    levels: list[list[IO[bytes]]],
    level: int,
    run: IO[bytes],
    fan_in: int,
    spill_dir: str | None,
    stats: SortStats,
) -> None:
    """Put a run on a level; a full level is merged into one run on the next (LSM-style cascading)."""
    while True:
        if level == len(levels):
            levels.append([])
        levels[level].append(run)
        if len(levels[level]) < fan_in:
            return
        full, levels[level] = levels[level], []
        try:
            run = _write_run(heapq.merge(*(_read_run(r) for r in full)), spill_dir)
        finally:
            for r in full:
                r.close()
        stats.runs_merged += 1
        level += 1
