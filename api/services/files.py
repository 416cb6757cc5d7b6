"""Files: uploads stream straight into the object store; content streams back out."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import IO

from sqlalchemy import select

from api.errors import ServiceError
from api.services.paging import Page, page
from storage.models import Batch, StoredFile, new_id
from storage.objectstore import CHUNK
from storage.status import BatchStatus
from workers.runtime import Runtime

PURPOSES = ("batch",)
MAX_FILENAME = 255


class _Limited:
    """Reads at most ``limit`` bytes, then refuses: the store never holds an oversize upload."""

    def __init__(self, stream: IO[bytes], limit: int) -> None:
        self.stream = stream
        self.limit = limit
        self.total = 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(CHUNK if size is None or size < 0 else min(size, CHUNK))
        self.total += len(data)
        if self.total > self.limit:
            raise ServiceError(
                "too_large",
                f"file is larger than the {self.limit} byte limit",
                param="file",
                code="file_too_large",
            )
        return data


def clean_filename(name: str | None) -> str:
    name = os.path.basename((name or "").replace("\\", "/")).replace("\x00", "")
    return (name or "upload.jsonl")[:MAX_FILENAME]


def upload(
    rt: Runtime, tenant_id: str, purpose: str | None, filename: str | None, stream: IO[bytes]
) -> StoredFile:
    record = store_file(rt, tenant_id, purpose, filename, stream)
    with rt.db.write() as s:
        s.add(record)
    return record


def store_file(
    rt: Runtime,
    tenant_id: str,
    purpose: str | None,
    filename: str | None,
    stream: IO[bytes],
    key: str | None = None,
) -> StoredFile:
    """Stream an upload into the object store (at ``key``, by default one of its own) and return
    its row, not yet added: the caller commits it, alone or with rows that refer to it."""
    if purpose not in PURPOSES:
        raise ServiceError(
            "invalid_request", f"purpose must be one of {', '.join(PURPOSES)}", param="purpose"
        )
    file_id = new_id("file-")
    key = key or f"files/{tenant_id}/{file_id}"
    limited = _Limited(stream, rt.settings.max_file_bytes)
    size = rt.store.put_stream(key, limited)  # type: ignore[arg-type]
    if size == 0:
        rt.store.delete(key)
        raise ServiceError("invalid_request", "the uploaded file is empty", param="file")
    return StoredFile(
        id=file_id,
        tenant_id=tenant_id,
        purpose=purpose,
        filename=clean_filename(filename),
        bytes=size,
        object_key=key,
        created_at=int(time.time()),
    )


def get(rt: Runtime, tenant_id: str, file_id: str) -> StoredFile:
    with rt.db.read() as s:
        record = s.get(StoredFile, file_id)
    if record is None or record.tenant_id != tenant_id or record.deleted_at is not None:
        raise ServiceError("not_found", f"No such File object: {file_id}", param="file_id")
    return record


def list_files(rt: Runtime, tenant_id: str, purpose: str | None, after: str | None, limit: int) -> Page:
    filters = [StoredFile.deleted_at.is_(None)]
    if purpose:
        filters.append(StoredFile.purpose == purpose)
    with rt.db.read() as s:
        return page(s, StoredFile, tenant_id, after, limit, *filters)


def content(rt: Runtime, tenant_id: str, file_id: str) -> tuple[StoredFile, Iterator[bytes]]:
    record = get(rt, tenant_id, file_id)
    stream = rt.store.open(record.object_key)

    def chunks() -> Iterator[bytes]:
        with stream:
            while chunk := stream.read(CHUNK):
                yield chunk

    return record, chunks()


def delete(rt: Runtime, tenant_id: str, file_id: str) -> StoredFile:
    with rt.db.write() as s:
        record = s.get(StoredFile, file_id, with_for_update=True)
        if record is None or record.tenant_id != tenant_id or record.deleted_at is not None:
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
    rt.store.delete(record.object_key)
    return record
