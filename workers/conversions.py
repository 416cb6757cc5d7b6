"""A file's content converted to the other format, made by the control worker's validation role
(``freight.convert_file``), never in an API request.

Converting in the API held whatever the writer buffered in the process that answers every tenant:
400 result lines of 800 KiB of logprobs took +926 MiB and 27 s there, and a refused Parquet bomb
was decoded again on every download (about 200 MiB written to disk, 1.3-1.8 s each time). Here:

- ``request`` (the API's side) answers from the ``file_conversions`` row: ``ready`` (the object to
  stream), ``refused`` (the error, remembered: the file is not decoded again), or ``preparing``
  (a task sent once; sent again only if it was lost, ``resend_seconds`` later). A tenant has at
  most FREIGHT_TENANT_VALIDATIONS conversions being made at once (then a 429).
- ``convert`` (the task's side) streams the file through a local temporary file into
  ``derived/<file id>.<format>`` (where ``storage.retention`` deletes it with the file), with row
  groups bounded by bytes (``storage.parquet_records.WRITE_BYTES``), and records the size, which
  ``storage.quotas.stored_bytes`` counts as the tenant's, or the refusal.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from storage.errors import ServiceError
from storage.models import Batch, FileConversion, StoredFile, Tenant, WorkUnit
from storage.objectstore import CHUNK, iter_lines
from storage.request_tables import RowError, decode_limits, request_lines, write_requests
from storage.result_order import in_input_order
from storage.result_tables import write_results
from storage.retention import live
from storage.runtime import Runtime

log = logging.getLogger(__name__)

PREPARING, READY, REFUSED = "preparing", "ready", "refused"
# the kinds of conversion (file_conversions.format): the target format, or a batch's output or
# error file as Parquet in its input's line order (``?order=input&format=parquet``)
INPUT_ORDER_PARQUET = "input.parquet"
KINDS = ("jsonl", "parquet", INPUT_ORDER_PARQUET)
RETRY_AFTER_SECONDS = 2  # the Retry-After of a "being prepared" answer
# a conversion still preparing this long after its task was sent is sent again (its worker was
# lost with the message): past the task's hard time limit (FREIGHT_VALIDATION_TIME_LIMIT_SECONDS)
RESEND_MARGIN_SECONDS = 60


@dataclass(frozen=True)
class Ready:
    object_key: str
    size: int


@dataclass(frozen=True)
class Preparing:
    """Not made yet: ask again after ``retry_after`` seconds."""

    file_id: str
    format: str
    retry_after: int = RETRY_AFTER_SECONDS


def derived_key(file_id: str, fmt: str) -> str:
    return f"derived/{file_id}.{fmt}"


def resend_seconds(rt: Runtime) -> float:
    limit = rt.settings.validation_time_limit_seconds
    return limit + max(10.0, limit / 10) + RESEND_MARGIN_SECONDS


def request(rt: Runtime, record: StoredFile, fmt: str, now: int) -> Ready | Preparing:
    """The API's side: the conversion of ``record`` (the tenant's, checked) to ``fmt`` if made,
    its refusal raised as the ServiceError it was, else Preparing (its task sent if not already)."""
    send = False
    try:
        with rt.db.write() as s:
            row = s.get(FileConversion, (record.id, fmt), with_for_update=True)
            if row is None:
                _check_in_flight(rt, s, record.tenant_id, now)
                s.add(FileConversion(file_id=record.id, format=fmt, tenant_id=record.tenant_id,
                                     status=PREPARING, sent_at=now))  # fmt: skip
                send = True
            elif row.status == READY and row.object_key:
                return Ready(row.object_key, row.bytes)
            elif row.status == REFUSED:
                raise ServiceError("invalid_request", row.error_message or "the file cannot be converted",
                                   param=row.error_param, code=row.error_code)  # fmt: skip
            elif now - row.sent_at > resend_seconds(rt):
                row.sent_at = now
                send = True
    except IntegrityError:  # another request made the row at the same moment: it sent the task
        return Preparing(record.id, fmt)
    if send:
        try:
            rt.queue.convert_file(record.id, fmt)
        except Exception:
            with rt.db.write() as s:  # not sent: the next download sends it
                row = s.get(FileConversion, (record.id, fmt), with_for_update=True)
                if row is not None and row.status == PREPARING:
                    row.sent_at = 0
            raise
    return Preparing(record.id, fmt)


def _check_in_flight(rt: Runtime, s: Session, tenant_id: str, now: int) -> None:
    """Refuse a new conversion while the tenant has FREIGHT_TENANT_VALIDATIONS of them being made
    (a 429 ``too_many_conversions``): its tasks run on the validation pool, which one tenant asking
    for every file in the other format would otherwise fill. Counted under the tenant's row lock,
    so racing downloads count each other; a conversion whose task was lost no longer counts."""
    s.get(Tenant, tenant_id, with_for_update=True)
    limit = rt.settings.tenant_validations
    waiting = s.scalar(
        select(func.count()).where(
            FileConversion.tenant_id == tenant_id,
            FileConversion.status == PREPARING,
            FileConversion.sent_at > now - resend_seconds(rt),
        )
    )
    if waiting and waiting >= limit:
        raise ServiceError(
            "rate_limited",
            f"{waiting} files of yours are being converted (at most {limit} at once): "
            "download them, then ask again",
            code="too_many_conversions",
            retry_after=RETRY_AFTER_SECONDS,
        )


def convert(rt: Runtime, file_id: str, fmt: str) -> str | None:
    """The task's side: make the conversion of ``file_id`` to ``fmt`` and record it ready, or
    record why it is refused. Safe to run twice (a redelivered message): a conversion already
    made or refused is left as it is. Returns the status recorded (None: nothing to do)."""
    with rt.db.read() as s:
        row = s.get(FileConversion, (file_id, fmt))
        record = s.get(StoredFile, file_id)
    if row is None or row.status != PREPARING:
        return None
    if record is None or not live(record, time.time()):
        _record(rt, file_id, fmt, error=ServiceError("not_found", f"No such File object: {file_id}"))
        return REFUSED
    started = time.monotonic()
    key = derived_key(file_id, fmt)
    try:
        size = _convert(rt, record, fmt, key)
    except ServiceError as refusal:
        _record(rt, file_id, fmt, error=refusal)
        log.info("conversion of %s to %s refused in %.1fs: %s", file_id, fmt, time.monotonic() - started,
                 refusal.message)  # fmt: skip
        return REFUSED
    if not _record(rt, file_id, fmt, key=key, size=size):
        rt.store.delete(key)  # the file was deleted meanwhile
        return None
    log.info("converted %s to %s: %d bytes in %.1fs", file_id, fmt, size, time.monotonic() - started)
    return READY


def fail(rt: Runtime, file_id: str, fmt: str, error: str) -> None:
    """The task's fault (its time limit, a bug): remembered as a refusal, so a file that makes the
    converter fail is not converted again on every download."""
    _record(rt, file_id, fmt, error=ServiceError("invalid_request", f"the file could not be converted: {error}",
                                                 code="conversion_failed"))  # fmt: skip


def _record(rt: Runtime, file_id: str, fmt: str, *, key: str | None = None, size: int = 0,
            error: ServiceError | None = None) -> bool:  # fmt: skip
    with rt.db.write() as s:
        row = s.get(FileConversion, (file_id, fmt), with_for_update=True)
        if row is None or row.status != PREPARING:
            return False
        row.status = REFUSED if error is not None else READY
        row.object_key, row.bytes, row.finished_at = key, size, int(time.time())
        if error is not None:
            row.error_code = error.code or "conversion_refused"
            row.error_message, row.error_param = error.message, error.param
    return True


def _convert(rt: Runtime, record: StoredFile, fmt: str, key: str) -> int:
    """``record``'s content as ``fmt`` at ``key``, through a local temporary file; its size."""
    spill = rt.settings.data_dir / "tmp"
    spill.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=spill) as tmp:
        target = os.path.join(tmp, f"out.{fmt}")
        if fmt == INPUT_ORDER_PARQUET:
            with rt.store.open(record.object_key) as stream:
                units = _units_of_result_file(rt, record)
                write_results(in_input_order(rt.store, units, iter_lines(stream), tmp), target)
        elif fmt == "parquet":
            with rt.store.open(record.object_key) as stream:
                lines = iter_lines(stream)
                if record.purpose == "batch_output":
                    write_results(lines, target)
                else:
                    write_requests(lines, target)
        else:
            source = os.path.join(tmp, "in.parquet")
            with rt.store.open(record.object_key) as stream, open(source, "wb") as local:
                shutil.copyfileobj(stream, local, CHUNK)
            with open(target, "wb") as out:
                for line in request_lines(source, None, limits=decode_limits(rt.settings)):
                    if isinstance(line, RowError):
                        raise ServiceError("invalid_request", line.message, param=line.column, code=line.code)
                    out.write(line + b"\n")
        with open(target, "rb") as converted:
            return rt.store.put_stream(key, converted)


def _units_of_result_file(rt: Runtime, record: StoredFile) -> list[Any]:
    """The work units of the batch whose output or error file ``record`` is, in seq order (where
    each line's input line number is found); refused if it is none's or the batch's request store
    is gone (the API checks both before it asks)."""
    with rt.db.read() as s:
        batch = s.scalar(
            select(Batch).where(
                Batch.tenant_id == record.tenant_id,
                or_(Batch.output_file_id == record.id, Batch.error_file_id == record.id),
            )
        )
        if batch is None or batch.purged_at is not None:
            raise ServiceError("invalid_request", "the file's input order is no longer known", param="order",
                               code="input_order_unavailable")  # fmt: skip
        return list(
            s.execute(
                select(
                    WorkUnit.shard_key,
                    WorkUnit.row_start,
                    WorkUnit.n_requests,
                    WorkUnit.output_key,
                    WorkUnit.error_key,
                )
                .where(WorkUnit.batch_id == batch.id)
                .order_by(WorkUnit.seq)
            ).all()
        )
