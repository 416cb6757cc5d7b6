"""A batch's results while it runs (``GET /v1/batches/{id}/results``), and result lines in input
order (``?order=input``, there and on a batch's output and error files' content).

What is read while a batch runs is what finalization will copy, and nothing else: the result
objects of the units recorded ``done`` (``workers.finalize`` copies exactly those, by the keys the
unit row names: the attempt that recorded it). A lost attempt (its worker killed, its claim
redelivered) may have left objects under its own attempt's keys, but no unit row names them, so
they are never read; the lines of a unit that never ran (a cancel, the window's end, a unit given
up) are made at finalization and are in the final error file only. A line read here is therefore
byte for byte the line the final file holds, and each unit is read once per cursor.

The cursor says which units a client has read (every ``seq`` up to a watermark, and the ones read
past it as a bitmap), so the next request returns only units recorded since, whatever order they
were recorded in. Opaque to clients: zlib-compressed, URL-safe base64 after ``r1.``.
"""

from __future__ import annotations

import base64
import binascii
import struct
import tempfile
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

from sqlalchemy import or_, select

from api.services.batches import owned
from storage.errors import ServiceError
from storage.models import Batch, UnitStatus, WorkUnit
from storage.objectstore import CHUNK, iter_lines
from storage.result_order import in_input_order
from storage.result_tables import write_results
from storage.runtime import Runtime
from storage.status import BatchStatus

KINDS = {"output": ("output_key",), "errors": ("error_key",), "all": ("output_key", "error_key")}
FORMATS = ("jsonl", "parquet")
MIMETYPES = {"jsonl": "application/jsonl", "parquet": "application/vnd.apache.parquet"}
CURSOR_HEADER = "x-freight-next-cursor"
COMPLETE_HEADER = "x-freight-results-complete"
_CURSOR_PREFIX = "r1."
_CURSOR_MAX_BYTES = 64 * 1024  # decompressed: a watermark and 524,280 units' bits
_NO_MORE_UNITS = (BatchStatus.FINALIZING, *BatchStatus.FINAL)  # no unit of these is recorded any more


@dataclass(frozen=True)
class Cursor:
    """The units a client has read: every ``seq`` up to ``through``, and the ones in ``beyond``."""

    through: int = -1
    beyond: frozenset[int] = frozenset()

    def covers(self, seq: int) -> bool:
        return seq <= self.through or seq in self.beyond

    def plus(self, read: Iterable[int], every: Sequence[int]) -> Cursor:
        """This cursor with the units ``read`` added; ``every``: all the batch's unit seqs in
        order, so the watermark moves over every unit read up to the first one not read."""
        done = set(self.beyond).union(read)
        through = self.through
        for seq in every:
            if seq <= through:
                continue
            if seq not in done:
                break
            through = seq
        return Cursor(through, frozenset(s for s in done if s > through))

    def encode(self) -> str:
        bits = bytearray((max(self.beyond) - self.through - 1) // 8 + 1 if self.beyond else 0)
        for seq in self.beyond:
            i = seq - self.through - 1
            bits[i >> 3] |= 1 << (i & 7)
        packed = zlib.compress(struct.pack(">q", self.through) + bytes(bits), 9)
        return _CURSOR_PREFIX + base64.urlsafe_b64encode(packed).rstrip(b"=").decode()

    @classmethod
    def decode(cls, text: str | None) -> Cursor:
        if not text:
            return cls()
        try:
            if not text.startswith(_CURSOR_PREFIX):
                raise ValueError("not a cursor")
            body = text[len(_CURSOR_PREFIX) :]
            packed = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
            inflate = zlib.decompressobj()
            raw = inflate.decompress(packed, _CURSOR_MAX_BYTES)
            if not inflate.eof or inflate.unconsumed_tail:
                raise ValueError("cursor too large")
            (through,) = struct.unpack(">q", raw[:8])
            if through < -1:
                raise ValueError("negative watermark")
        except (ValueError, binascii.Error, zlib.error, struct.error, UnicodeEncodeError):
            raise ServiceError(
                "invalid_request",
                f"after must be a cursor that a results response gave (its {CURSOR_HEADER} header)",
                param="after",
            ) from None
        bits = raw[8:]
        beyond = frozenset(
            through + 1 + (i << 3) + b
            for i, byte in enumerate(bits)
            if byte
            for b in range(8)
            if byte >> b & 1
        )
        return cls(through, beyond)


@dataclass(frozen=True)
class Results:
    chunks: Iterator[bytes]
    mimetype: str
    filename: str
    size: int | None  # None: streamed as it is read
    next_cursor: str | None = None
    complete: bool = False  # no unit of the batch will be recorded after these


def partial(
    rt: Runtime,
    tenant_id: str,
    batch_id: str,
    *,
    kind: str | None = None,
    after: str | None = None,
    fmt: str | None = None,
    order: str | None = None,
) -> Results:
    """The result lines of the batch's units recorded and not covered by the cursor ``after``
    (``kind``: output, errors or all; all: a unit's output lines, then its error lines), unit by
    unit in seq order or in input order, as JSONL or Parquet; with the cursor that covers them."""
    kind = kind or "output"
    if kind not in KINDS:
        raise ServiceError("invalid_request", f"kind must be one of {', '.join(KINDS)}", param="kind")
    fmt = _format(fmt)
    by_input = input_order(order)
    read = Cursor.decode(after)
    with rt.db.read() as s:
        batch = owned(s, tenant_id, batch_id)
        status, purged = batch.status, batch.purged_at
        units = s.execute(
            select(WorkUnit.seq, WorkUnit.status, *_UNIT_COLUMNS)
            .where(WorkUnit.batch_id == batch_id)
            .order_by(WorkUnit.seq)
        ).all()
    new = [u for u in units if u.status == UnitStatus.DONE and not read.covers(u.seq)]
    if new and purged is not None:
        raise ServiceError(
            "not_found",
            f"the unit results of batch {batch_id} were deleted after it ended; download its output file",
            param="batch_id",
            code="results_deleted",
        )
    keys = [key for u in new for column in KINDS[kind] if (key := getattr(u, column))]
    cursor = read.plus((u.seq for u in new), [u.seq for u in units]).encode()
    done = status in _NO_MORE_UNITS
    name = f"{batch_id}.{kind}.partial.{fmt}"
    if not by_input and fmt == "jsonl":
        return Results(_chunks(rt, keys), MIMETYPES[fmt], name, None, cursor, done)
    lines: Iterable[bytes] = _lines(rt, keys)
    if by_input:
        lines = _primed(in_input_order(rt.store, new, lines, _spill(rt)))
    return _as(rt, lines, fmt, name, cursor, done)


_UNIT_COLUMNS = (
    WorkUnit.shard_key,
    WorkUnit.row_start,
    WorkUnit.n_requests,
    WorkUnit.output_key,
    WorkUnit.error_key,
)


def file_in_input_order(rt: Runtime, tenant_id: str, file_id: str, object_key: str, fmt: str) -> Results:
    """A batch's output or error file (already checked to be the tenant's) in input line order."""
    units = input_order_units(rt, tenant_id, file_id)
    stream = rt.store.open(object_key)

    def lines() -> Iterator[bytes]:
        with stream:
            yield from iter_lines(stream)

    ordered = _primed(in_input_order(rt.store, units, lines(), _spill(rt)))
    return _as(rt, ordered, fmt, f"{file_id}.input-order.{fmt}")


def input_order_units(rt: Runtime, tenant_id: str, file_id: str) -> list[Any]:
    """The units of the batch whose output or error file ``file_id`` is (the tenant's), in seq
    order; a 400 ``input_order_unavailable`` if it is no batch's result file or the batch's request
    store is gone."""
    with rt.db.read() as s:
        batch = s.scalar(
            select(Batch).where(
                Batch.tenant_id == tenant_id,
                or_(Batch.output_file_id == file_id, Batch.error_file_id == file_id),
            )
        )
        if batch is None:
            raise ServiceError(
                "invalid_request",
                "order=input is for a batch's output and error files",
                param="order",
                code="input_order_unavailable",
            )
        if batch.purged_at is not None:
            raise ServiceError(
                "invalid_request",
                f"the request store of batch {batch.id} was deleted after it ended "
                "(FREIGHT_BATCH_DATA_RETENTION_SECONDS), so its input order is no longer known",
                param="order",
                code="input_order_unavailable",
            )
        return list(
            s.execute(
                select(*_UNIT_COLUMNS).where(WorkUnit.batch_id == batch.id).order_by(WorkUnit.seq)
            ).all()
        )


def _format(fmt: str | None) -> str:
    fmt = fmt or "jsonl"
    if fmt not in FORMATS:
        raise ServiceError("invalid_request", f"format must be one of {', '.join(FORMATS)}", param="format")
    return fmt


def input_order(order: str | None) -> bool:
    if order in (None, ""):
        return False
    if order != "input":
        raise ServiceError(
            "invalid_request", "order must be input (or left out: the stored order)", param="order"
        )
    return True


def _spill(rt: Runtime) -> str:
    path = rt.settings.data_dir / "tmp"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def _chunks(rt: Runtime, keys: Iterable[str]) -> Iterator[bytes]:
    for key in keys:
        with rt.store.open(key) as stream:
            while chunk := stream.read(CHUNK):
                yield chunk


def _lines(rt: Runtime, keys: Iterable[str]) -> Iterator[bytes]:
    for key in keys:
        with rt.store.open(key) as stream:
            yield from iter_lines(stream)


def _primed(lines: Iterator[bytes]) -> Iterator[bytes]:
    """Start ``lines`` now (an input-order sort reads everything before its first line), so that
    its errors are the request's error answer, not a response cut off after its headers."""
    first = next(lines, None)

    def rest() -> Iterator[bytes]:
        try:
            if first is not None:
                yield first
                yield from lines
        finally:
            close = getattr(lines, "close", None)
            if close is not None:
                close()

    return rest()


def _as(rt: Runtime, lines: Iterable[bytes], fmt: str, name: str, cursor: str | None = None,
        done: bool = False) -> Results:  # fmt: skip
    """``lines`` as the response body: JSONL as they come (each with its newline), Parquet
    written first to an unnamed local file (the format's footer comes last), then streamed."""
    if fmt == "jsonl":
        return Results((line if line.endswith(b"\n") else line + b"\n" for line in lines), MIMETYPES[fmt], name,
                       None, cursor, done)  # fmt: skip
    local: IO[Any] = tempfile.TemporaryFile(dir=_spill(rt))  # noqa: SIM115 - closed by the stream
    try:
        write_results(lines, local)
        size = local.tell()
        local.seek(0)
    except BaseException:
        local.close()
        raise

    def chunks() -> Iterator[bytes]:
        with local:
            while chunk := local.read(CHUNK):
                yield chunk

    return Results(chunks(), MIMETYPES[fmt], name, size, cursor, done)
