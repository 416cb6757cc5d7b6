"""Files, the tenant's side after upload: read, list, stream content back (JSONL or converted to
Parquet), delete. Uploads stream into the object store through ``workers.intake``."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy import or_, select

from api.services import results
from api.services.paging import Page, page
from storage.errors import ServiceError
from storage.models import Batch, StoredFile
from storage.objectstore import CHUNK, iter_lines
from storage.request_tables import RowError, decode_limits, is_parquet, request_lines, write_requests
from storage.result_tables import write_results
from storage.retention import delete_file_objects, live, purge_batches_of_file
from storage.runtime import Runtime
from storage.status import BatchStatus

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
) -> Content:
    """A file's bytes as stored, or converted to the other format (``jsonl`` | ``parquet``);
    ``order="input"``: a batch's output or error file in its input's line order
    (``api.services.results``), made for each download.

    A conversion is made once, streaming through a local temporary file, and kept in the object
    store beside the file (``derived/<file id>.<format>``), so a second download is a plain read:
    results as typed Parquet (``storage.result_tables``), a JSONL input as Parquet request columns,
    a Parquet input as OpenAI JSONL (``storage.request_tables``)."""
    fmt = fmt or "jsonl"
    if fmt not in FORMATS:
        raise ServiceError(
            "invalid_request", f"format must be one of {', '.join(FORMATS)}, not {fmt[:50]!r}", param="format"
        )
    record = get(rt, tenant_id, file_id)
    if results.input_order(order):
        ordered = results.file_in_input_order(rt, tenant_id, record.id, record.object_key, fmt)
        return Content(ordered.size, ordered.chunks, ordered.filename, ordered.mimetype)
    with rt.store.open(record.object_key) as stream:
        stored = "parquet" if is_parquet(stream.read(4)) else "jsonl"
    key, size = (record.object_key, record.bytes) if fmt == stored else _converted(rt, record, fmt)
    stream = rt.store.open(key)

    def chunks() -> Iterator[bytes]:
        with stream:
            while chunk := stream.read(CHUNK):
                yield chunk

    return Content(size, chunks(), f"{record.id}.{fmt}", MIMETYPES[fmt])


def _converted(rt: Runtime, record: StoredFile, fmt: str) -> tuple[str, int]:
    key = f"derived/{record.id}.{fmt}"
    if rt.store.exists(key):
        return key, rt.store.size(key)
    spill = rt.settings.data_dir / "tmp"
    spill.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=spill) as tmp:
        target = os.path.join(tmp, f"out.{fmt}")
        if fmt == "parquet":
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
            size = rt.store.put_stream(key, converted)
    return key, size


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
