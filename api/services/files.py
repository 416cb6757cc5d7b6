"""Files, the tenant's side after upload: read, list, stream content back (as stored, or converted
to the other format by the control worker: ``workers.conversions``), delete. Uploads stream into
the object store through ``workers.intake``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy import or_, select

from api.services import results
from api.services.paging import Page, page
from storage.errors import ServiceError
from storage.models import Batch, StoredFile
from storage.objectstore import CHUNK
from storage.request_tables import is_parquet
from storage.retention import delete_file_objects, live, purge_batches_of_file
from storage.runtime import Runtime
from storage.status import BatchStatus
from workers import conversions

FORMATS = ("jsonl", "parquet")
MIMETYPES = {"jsonl": "application/jsonl", "parquet": "application/vnd.apache.parquet"}


def get(rt: Runtime, tenant_id: str, file_id: str) -> StoredFile:
    with rt.db.read() as s:
        record = s.get(StoredFile, file_id)
    if record is None or record.tenant_id != tenant_id or not live(record, time.time()):
        raise ServiceError("not_found", f"No such File object: {file_id}", param="file_id")
    return record


def list_files(rt: Runtime, tenant_id: str, purpose: str | None, after: str | None, limit: int) -> Page:
    now = int(time.time())
    filters = [
        StoredFile.deleted_at.is_(None),
        or_(StoredFile.expires_at.is_(None), StoredFile.expires_at > now),
    ]
    if purpose:
        filters.append(StoredFile.purpose == purpose)
    with rt.db.read() as s:
        return page(s, StoredFile, tenant_id, after, limit, *filters)


@dataclass(frozen=True)
class Content:
    size: int | None  # None: streamed as it is made (a file in input order)
    chunks: Iterator[bytes]
    filename: str
    mimetype: str


def content(rt: Runtime, tenant_id: str, file_id: str) -> tuple[StoredFile, Iterator[bytes]]:
    """A file's bytes as stored."""
    record = get(rt, tenant_id, file_id)
    stream = rt.store.open(record.object_key)

    def chunks() -> Iterator[bytes]:
        with stream:
            while chunk := stream.read(CHUNK):
                yield chunk

    return record, chunks()


def download(
    rt: Runtime, tenant_id: str, file_id: str, fmt: str | None = None, order: str | None = None
) -> Content | conversions.Preparing:
    """A file's bytes as stored, or converted to the other format (``jsonl`` | ``parquet``);
    ``order="input"``: a batch's output or error file in its input's line order
    (``api.services.results``), made for each download as JSONL, and as Parquet converted once.

    A conversion is made by the control worker (``workers.conversions``), never here: until it is
    made this answers ``Preparing`` (the view's 202 with ``Retry-After``), then the converted
    object is streamed from the store; a conversion refused (a Parquet bomb) is its 400 again,
    remembered, without decoding the file."""
    fmt = fmt or "jsonl"
    if fmt not in FORMATS:
        raise ServiceError(
            "invalid_request", f"format must be one of {', '.join(FORMATS)}, not {fmt[:50]!r}", param="format"
        )
    record = get(rt, tenant_id, file_id)
    name = f"{record.id}.{fmt}"
    if results.input_order(order):
        if fmt == "jsonl":  # streamed as it is sorted, for each download
            ordered = results.file_in_input_order(rt, tenant_id, record.id, record.object_key, fmt)
            return Content(ordered.size, ordered.chunks, ordered.filename, ordered.mimetype)
        results.input_order_units(rt, tenant_id, record.id)  # its 400s at once, not from the task
        stored, kind, name = "jsonl", conversions.INPUT_ORDER_PARQUET, f"{record.id}.input-order.{fmt}"
    else:
        with rt.store.open(record.object_key) as stream:
            stored = "parquet" if is_parquet(stream.read(4)) else "jsonl"
        kind = fmt
    if kind == stored:
        key, size = record.object_key, record.bytes
    else:
        made = conversions.request(rt, record, kind, int(time.time()))
        if isinstance(made, conversions.Preparing):
            return conversions.Preparing(record.id, fmt, made.retry_after)
        key, size = made.object_key, made.size
    stream = rt.store.open(key)

    def chunks() -> Iterator[bytes]:
        with stream:
            while chunk := stream.read(CHUNK):
                yield chunk

    return Content(size, chunks(), name, MIMETYPES[fmt])


def delete(rt: Runtime, tenant_id: str, file_id: str) -> StoredFile:
    with rt.db.write() as s:
        record = s.get(StoredFile, file_id, with_for_update=True)
        if record is None or record.tenant_id != tenant_id or not live(record, time.time()):
            raise ServiceError("not_found", f"No such File object: {file_id}", param="file_id")
        in_use = s.scalar(
            select(Batch.id).where(
                Batch.input_file_id == file_id,
                Batch.status.in_(
                    [
                        BatchStatus.VALIDATING,
                        BatchStatus.IN_PROGRESS,
                        BatchStatus.FINALIZING,
                        BatchStatus.CANCELLING,
                    ]
                ),
            )
        )
        if in_use:
            raise ServiceError(
                "conflict",
                f"file {file_id} is the input of batch {in_use}, which is still running",
                param="file_id",
            )
        record.deleted_at = int(time.time())
    delete_file_objects(rt, record)
    # the batches that read it keep its prompts in their shards and results: those go too
    purge_batches_of_file(rt, record.id, record.deleted_at)
    return record
