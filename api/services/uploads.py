"""OpenAI's Uploads API: a file of up to ``FREIGHT_MAX_UPLOAD_BYTES`` (8 GiB) sent in parts.

``create`` declares the file (its bytes, name, purpose and MIME type); each part (at most 64 MiB)
streams from the request into an object of its own under the upload's prefix, never held whole in
memory (``api.multipart``); ``complete`` joins the parts named, in the order named, into the file's
object (on S3 server-side with UploadPartCopy, unless an md5 is to be checked, when the bytes
stream through this process once and are hashed on the way) and adds the file's row as
``/v1/files`` does, so the file validates into a batch like any other. Parts, not only files,
count against the tenant's stored-bytes quota as they arrive. An upload not completed an hour
after its creation expires; the periodic cleanup marks it and deletes its parts
(``storage.retention``), as completion and cancellation do at once.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from typing import IO, Any

from sqlalchemy import select
from werkzeug.http import parse_options_header

from storage.errors import ServiceError
from storage.idempotency import note_created
from storage.models import StoredFile, Upload, UploadPart, new_id
from storage.objectstore import CHUNK
from storage.quotas import bytes_left, check_stored, exceeded, quota_of, stored_bytes
from storage.retention import expiry, purge_upload_parts, upload_parts_prefix
from storage.runtime import Runtime
from storage.status import UploadStatus
from storage.tracing import current_traceparent
from workers import intake

MAX_PART_BYTES = 64 * 1024 * 1024  # OpenAI's largest part
UPLOAD_SECONDS = 3600  # an upload not completed expires an hour after its creation, as OpenAI's
# what OpenAI accepts for a .jsonl batch file, and Parquet's types (as /v1/files takes Parquet)
MIME_TYPES = frozenset(
    {
        "text/jsonl",
        "application/jsonl",
        "application/jsonlines",
        "application/x-jsonlines",
        "application/x-ndjson",
        "application/json",
        "text/plain",
        "application/vnd.apache.parquet",
        "application/x-parquet",
        "application/octet-stream",
    }
)
MD5_HEX = re.compile(r"^[0-9a-fA-F]{32}$")


def _not_found(upload_id: str) -> ServiceError:
    return ServiceError("not_found", f"No such Upload object: {upload_id[:64]}", param="upload_id")


def _check_int(payload: dict[str, Any], name: str) -> int:
    value = payload.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ServiceError("invalid_request", f"'{name}' must be an integer", param=name)
    return value


def create(rt: Runtime, tenant_id: str, payload: Any) -> Upload:
    if not isinstance(payload, dict):
        raise ServiceError("invalid_request", "the request body must be a JSON object")
    size = _check_int(payload, "bytes")
    if size < 1:
        raise ServiceError("invalid_request", "'bytes' must be at least 1", param="bytes")
    limit = rt.settings.max_upload_bytes
    if size > limit:
        raise ServiceError(
            "invalid_request",
            f"'bytes' is larger than the {limit} byte limit of an upload",
            param="bytes",
            code="file_too_large",
        )
    filename = payload.get("filename")
    if not isinstance(filename, str) or not filename.strip():
        raise ServiceError("invalid_request", "'filename' must be a non-empty string", param="filename")
    purpose = payload.get("purpose")
    if purpose not in intake.PURPOSES:
        raise ServiceError(
            "invalid_request", f"purpose must be one of {', '.join(intake.PURPOSES)}", param="purpose"
        )
    mime_type = payload.get("mime_type")
    media = parse_options_header(mime_type)[0].lower() if isinstance(mime_type, str) else ""
    if media not in MIME_TYPES:
        raise ServiceError(
            "invalid_request",
            f"mime_type must be one of {', '.join(sorted(MIME_TYPES))} for purpose batch",
            param="mime_type",
        )
    expires_after = intake.check_expires_after(payload.get("expires_after"), "expires_after")
    with rt.db.read() as s:
        left = bytes_left(s, rt.settings, tenant_id)  # refuses a tenant with nothing left
        if left is not None and size > left:
            limit_q = quota_of(s, rt.settings, tenant_id, lock=False).stored_bytes
            raise exceeded("stored file bytes", limit_q, stored_bytes(s, tenant_id), " bytes", "bytes")
    now = int(time.time())
    upload = Upload(
        id=new_id("upload_"),
        tenant_id=tenant_id,
        filename=intake.clean_filename(filename),
        purpose=purpose,
        mime_type=media,
        bytes=size,
        status=UploadStatus.PENDING,
        created_at=now,
        expires_at=now + UPLOAD_SECONDS,
        file_expires_after=expires_after,
    )
    with rt.db.write() as s:
        s.add(upload)
        note_created(s, "upload", upload.id)  # a retry after a crash answers this upload
    return upload


def get(rt: Runtime, tenant_id: str, upload_id: str) -> tuple[Upload, StoredFile | None]:
    """An upload of the tenant's, and its file once completed."""
    with rt.db.read() as s:
        upload = s.get(Upload, upload_id)
        if upload is None or upload.tenant_id != tenant_id:
            raise _not_found(upload_id)
        record = s.get(StoredFile, upload.file_id) if upload.file_id else None
    return upload, record


def get_part(rt: Runtime, tenant_id: str, part_id: str) -> UploadPart:
    """A part of an upload of the tenant's."""
    with rt.db.read() as s:
        part = s.get(UploadPart, part_id)
        upload = s.get(Upload, part.upload_id) if part is not None else None
    if part is None or upload is None or upload.tenant_id != tenant_id:
        raise ServiceError("not_found", f"No such upload part: {part_id[:100]}", param="part_id")
    return part


def _check_pending(upload: Upload, now: float) -> None:
    """Refuse anything but a pending upload before its expiry, naming its state."""
    status = (
        UploadStatus.EXPIRED if upload.status == UploadStatus.PENDING and now >= upload.expires_at else None
    )
    status = status or upload.status
    if status != UploadStatus.PENDING:
        raise ServiceError(
            "invalid_request",
            f"upload {upload.id} is {status}: it takes no more parts and cannot be completed",
            param="upload_id",
            code=f"upload_{status}",
        )


class _PartLimit:
    """Reads a part, refusing it past the part limit or what the tenant's quota left."""

    def __init__(self, stream: IO[bytes], limit: int, quota_left: int | None) -> None:
        self.stream = stream
        self.limit = limit
        self.quota_left = quota_left
        self.total = 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(CHUNK if size is None or size < 0 else min(size, CHUNK))
        self.total += len(data)
        if self.total > self.limit:
            raise ServiceError(
                "too_large",
                f"a part is at most {self.limit} bytes ({self.limit // (1024 * 1024)} MiB)",
                param="data",
                code="part_too_large",
            )
        if self.quota_left is not None and self.total > self.quota_left:
            raise _QuotaPassed()
        return data


class _QuotaPassed(Exception):
    pass


def add_part(rt: Runtime, tenant_id: str, upload_id: str, stream: IO[bytes] | None) -> UploadPart:
    """Stream one part into its own object and record it; the part's bytes count against the
    tenant's quota from then on. At most ``bytes`` + one part's worth may be stored in parts (a part
    sent again after a lost answer still fits)."""
    upload, _ = get(rt, tenant_id, upload_id)
    _check_pending(upload, time.time())
    if stream is None:
        raise ServiceError("invalid_request", "multipart field 'data' is required", param="data")
    with rt.db.read() as s:
        quota_left = bytes_left(s, rt.settings, tenant_id)
        held = _parts_bytes(s, upload_id)
    room = upload.bytes + MAX_PART_BYTES - held
    if room <= 0:
        raise ServiceError(
            "invalid_request",
            f"upload {upload_id} already holds {held} bytes of parts for a file of {upload.bytes}",
            param="data",
            code="upload_parts_exceed_bytes",
        )
    part_id = new_id("part_")
    key = upload_parts_prefix(tenant_id, upload_id) + part_id
    limited = _PartLimit(stream, min(MAX_PART_BYTES, room), quota_left)
    try:
        size = rt.store.put_stream(key, limited)  # type: ignore[arg-type]
    except _QuotaPassed as exc:
        rt.store.delete(key)
        raise _quota_error(rt, tenant_id) from exc
    except ServiceError:
        rt.store.delete(key)
        raise
    if size == 0:
        rt.store.delete(key)
        raise ServiceError("invalid_request", "the part is empty", param="data")
    part = UploadPart(
        id=part_id, upload_id=upload_id, bytes=size, object_key=key, created_at=int(time.time())
    )
    try:
        with rt.db.write() as s:
            locked = s.get(Upload, upload_id, with_for_update=True)
            assert locked is not None  # uploads are never deleted but with their tenant
            _check_pending(locked, time.time())  # completed, cancelled or expired meanwhile
            check_stored(s, rt.settings, tenant_id, size)
            s.add(part)
            note_created(s, "upload.part", part.id)
    except ServiceError:
        rt.store.delete(key)
        raise
    return part


def _parts_bytes(s: Any, upload_id: str) -> int:
    return sum(s.scalars(select(UploadPart.bytes).where(UploadPart.upload_id == upload_id)))


def _quota_error(rt: Runtime, tenant_id: str) -> ServiceError:
    with rt.db.read() as s:
        limit = quota_of(s, rt.settings, tenant_id, lock=False).stored_bytes
        return exceeded("stored file bytes", limit, stored_bytes(s, tenant_id), " bytes", "data")


def _check_completion(payload: Any) -> tuple[list[str], str | None]:
    if not isinstance(payload, dict):
        raise ServiceError("invalid_request", "the request body must be a JSON object")
    part_ids = payload.get("part_ids")
    if not isinstance(part_ids, list) or not part_ids or not all(isinstance(p, str) for p in part_ids):
        raise ServiceError(
            "invalid_request", "'part_ids' must be a non-empty list of part ids", param="part_ids"
        )
    if len(set(part_ids)) != len(part_ids):
        raise ServiceError("invalid_request", "'part_ids' names a part more than once", param="part_ids")
    md5 = payload.get("md5")
    if md5 is not None and (not isinstance(md5, str) or not MD5_HEX.match(md5)):
        raise ServiceError("invalid_request", "'md5' must be 32 hexadecimal digits", param="md5")
    return part_ids, md5.lower() if md5 else None


def complete(rt: Runtime, tenant_id: str, upload_id: str, payload: Any) -> tuple[Upload, StoredFile]:
    """Join the parts named, in that order, into a new file; the upload becomes ``completed`` with
    it, in one transaction. A refusal (an unknown part, bytes other than declared, a wrong md5)
    leaves the upload pending, so the client may complete it again with the right parts."""
    upload, _ = get(rt, tenant_id, upload_id)  # another tenant's: 404 whatever the body
    part_ids, md5 = _check_completion(payload)
    _check_pending(upload, time.time())
    with rt.db.read() as s:
        parts = {p.id: p for p in s.scalars(select(UploadPart).where(UploadPart.upload_id == upload_id))}
    unknown = [p for p in part_ids if p not in parts]
    if unknown:
        raise ServiceError(
            "invalid_request",
            f"{unknown[0][:64]} is not a part of upload {upload_id}",
            param="part_ids",
            code="unknown_part",
        )
    total = sum(parts[p].bytes for p in part_ids)
    if total != upload.bytes:
        raise ServiceError(
            "invalid_request",
            f"the parts named hold {total} bytes; the upload was created for {upload.bytes}",
            param="part_ids",
            code="bytes_mismatch",
        )
    digest = hashlib.md5(usedforsecurity=False) if md5 else None
    observe: Callable[[bytes], None] | None = digest.update if digest else None
    file_id = new_id("file-")
    key = f"files/{tenant_id}/{file_id}"
    size = rt.store.compose([parts[p].object_key for p in part_ids], key, observe)
    try:
        if size != upload.bytes:  # a part's object changed underneath: nothing is made
            raise ServiceError(
                "invalid_request",
                f"the parts' objects hold {size} bytes, not {upload.bytes}",
                param="part_ids",
                code="bytes_mismatch",
            )
        if digest is not None and digest.hexdigest() != md5:
            raise ServiceError(
                "invalid_request",
                f"the md5 of the parts joined is {digest.hexdigest()}, not {md5}",
                param="md5",
                code="md5_mismatch",
            )
        now = int(time.time())
        record = StoredFile(
            id=file_id,
            tenant_id=tenant_id,
            purpose=upload.purpose,
            filename=upload.filename,
            bytes=size,
            object_key=key,
            created_at=now,
            expires_at=expiry(rt.settings, now, upload.file_expires_after),
            trace_context=current_traceparent(),  # the completing request: its batches link to it
        )
        with rt.db.write() as s:
            locked = s.get(Upload, upload_id, with_for_update=True)
            assert locked is not None
            if locked.status != UploadStatus.PENDING:  # completed or cancelled meanwhile
                _check_pending(locked, now)
            locked.status, locked.file_id, locked.finished_at = UploadStatus.COMPLETED, file_id, now
            s.flush()  # its parts stop counting against the quota; the file counts instead
            check_stored(s, rt.settings, tenant_id, size)
            s.add(record)
            note_created(s, "upload", upload_id)  # a retry after a crash answers it, completed
            upload = locked
    except BaseException:
        rt.store.delete(key)
        raise
    purge_upload_parts(rt, tenant_id, upload_id, now)  # a failure here leaves them to the cleanup
    return upload, record


def cancel(rt: Runtime, tenant_id: str, upload_id: str) -> Upload:
    """A pending upload is cancelled and its parts deleted; no part may be added after."""
    now = int(time.time())
    with rt.db.write() as s:
        upload = s.get(Upload, upload_id, with_for_update=True)
        if upload is None or upload.tenant_id != tenant_id:
            raise _not_found(upload_id)
        _check_pending(upload, now)
        upload.status, upload.finished_at = UploadStatus.CANCELLED, now
    purge_upload_parts(rt, tenant_id, upload_id, now)
    return upload
