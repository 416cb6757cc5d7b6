"""Intake: a file and a create request become a batch waiting for validation.

The one way in, whatever the entry point (the Batch API, the console's upload form, an S3 drop
folder): store the file, check the request, add the batch in one transaction, commit, then send
its validation. The batch row is made only by a transaction that commits before the send, so a
task never refers to a row that might roll back.

When the broker is down the send fails, and nothing would ever validate the batch. Every entry
point gets the same answer: the batch (and a file row made in the same call) is withdrawn and the
broker's error propagates, so the caller's retry is the only copy of the job. The API answers 503
with Retry-After, the console shows the error, a drop folder's scan fails and retries with
backoff, re-reading the inbox object it could not hand over. A process that dies between the
commit and the send leaves a ``validating`` batch that the dispatcher's tick sends again once its
validation lease has lapsed.
"""

from __future__ import annotations

import logging
import os
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import IO, Any

from sqlalchemy import delete
from sqlalchemy.orm import Session

from scheduler.sla import SlaTier
from storage import budgets
from storage.broker import BROKER_ERRORS
from storage.errors import ServiceError
from storage.idempotency import note_created
from storage.models import Batch, DropObject, StoredFile, new_id
from storage.objectstore import CHUNK, ObjectStoreError
from storage.quotas import bytes_left, check_new_batch, check_stored, exceeded, quota_of, stored_bytes
from storage.registry import EMBED, GENERATE, TASKS, TRANSCRIBE, entries, lookup
from storage.retention import MEDIA_PURPOSES, expiry, live
from storage.runtime import Runtime
from storage.settings import Settings
from storage.status import BatchStatus
from storage.tracing import BATCH_ID, TENANT, current_traceparent, links_to, span
from workers.request_bodies import (
    EMBEDDINGS,
    ENDPOINTS,
    UNSUPPORTED_ENDPOINTS,
    endpoint_mismatch,
    serves,
)

PURPOSES = ("batch",)  # a batch's input (and the Uploads API's only purpose); or MEDIA_PURPOSES
MAX_FILENAME = 255
BIDI_CONTROLS = frozenset("\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
MAX_METADATA_PAIRS = 16
# OpenAI's bounds of expires_after.seconds: an hour to 30 days
MIN_EXPIRES_AFTER = 3600
MAX_EXPIRES_AFTER = 30 * 86400

log = logging.getLogger(__name__)


def storable(text: str) -> bool:
    """Whether a JSON string can go into a database column: PostgreSQL refuses NUL, and no
    database takes an unpaired surrogate (valid JSON, ``"\\ud800"``, but not UTF-8)."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise ServiceError(
            "invalid_request", "metadata must be an object of string keys and values", param="metadata"
        )
    if len(metadata) > MAX_METADATA_PAIRS:
        raise ServiceError(
            "invalid_request", f"metadata may hold at most {MAX_METADATA_PAIRS} pairs", param="metadata"
        )
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > 64 or len(value) > 512 or not storable(key + value):
            raise ServiceError(
                "invalid_request",
                "metadata keys are strings of at most 64 characters, values strings of at most 512,"
                " without NUL characters or unpaired surrogates",
                param=f"metadata.{str(key)[:64]}",
            )
    return metadata


def check_expires_after(value: Any, param: str) -> int | None:
    """OpenAI's ``{"anchor": "created_at", "seconds": N}`` -> N (None when not given)."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"anchor", "seconds"}:
        raise ServiceError(
            "invalid_request", f'{param} must be {{"anchor": "created_at", "seconds": N}}', param=param
        )
    if value.get("anchor") != "created_at":
        raise ServiceError("invalid_request", f"{param}.anchor must be 'created_at'", param=f"{param}.anchor")
    seconds = value.get("seconds")
    if isinstance(seconds, str) and seconds.strip().isdigit():  # a form field is text
        seconds = int(seconds)
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int)
        or not (MIN_EXPIRES_AFTER <= seconds <= MAX_EXPIRES_AFTER)
    ):
        raise ServiceError(
            "invalid_request",
            f"{param}.seconds must be an integer from {MIN_EXPIRES_AFTER} to {MAX_EXPIRES_AFTER}",
            param=f"{param}.seconds",
        )
    return seconds


@dataclass(frozen=True)
class BatchRequest:
    """A checked create request; ``add`` turns it into a row inside the caller's transaction."""

    input_file_id: str
    endpoint: str
    window: str
    tier: SlaTier
    metadata: dict[str, str] | None
    priority: int
    output_expires_after: int | None = None  # seconds; None: FREIGHT_FILE_RETENTION_SECONDS
    resumed_from: str | None = None  # a resume of that batch (checked by api.services.resume)


def check_request(rt: Runtime, payload: Any) -> BatchRequest:
    if not isinstance(payload, dict):
        raise ServiceError("invalid_request", "the request body must be a JSON object")
    input_file_id = payload.get("input_file_id")
    endpoint = payload.get("endpoint")
    window = payload.get("completion_window", rt.settings.default_window)
    if not isinstance(input_file_id, str) or not input_file_id:
        raise ServiceError("invalid_request", "input_file_id is required", param="input_file_id")
    if not storable(input_file_id):
        raise ServiceError(
            "not_found", f"No such File object: {input_file_id[:100]!r}", param="input_file_id"
        )
    endpoint = check_endpoint(endpoint)
    unserved = endpoint_unserved(rt, endpoint)
    if unserved is not None:
        raise ServiceError("invalid_request", unserved, param="endpoint", code="endpoint_not_served")
    tier = rt.settings.tier(window) if isinstance(window, str) else None
    if tier is None:
        offered = ", ".join(t.window for t in rt.settings.sla_tiers)
        raise ServiceError(
            "invalid_request", f"completion_window must be one of {offered}", param="completion_window"
        )
    metadata = check_metadata(payload.get("metadata"))
    priority = payload.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or not -100 <= priority <= 100:
        raise ServiceError(
            "invalid_request", "priority must be an integer from -100 to 100", param="priority"
        )
    output_expires_after = check_expires_after(payload.get("output_expires_after"), "output_expires_after")
    return BatchRequest(input_file_id, endpoint, window, tier, metadata, priority, output_expires_after)


def check_endpoint(endpoint: Any) -> str:
    """``endpoint`` if Freight runs it; else refused: one vLLM's run-batch takes but Freight does
    not yet (audio: ``UNSUPPORTED_ENDPOINTS``, with the reason), or any other."""
    if isinstance(endpoint, str) and endpoint in UNSUPPORTED_ENDPOINTS:
        raise ServiceError(
            "invalid_request",
            f"endpoint {endpoint} is not supported yet: {UNSUPPORTED_ENDPOINTS[endpoint]}; "
            f"endpoint must be one of {', '.join(ENDPOINTS)}",
            param="endpoint",
            code="unsupported_endpoint",
        )
    if endpoint not in ENDPOINTS:
        raise ServiceError(
            "invalid_request",
            f"endpoint must be one of {', '.join(ENDPOINTS)}",
            param="endpoint",
            code="invalid_endpoint",
        )
    return str(endpoint)


def endpoint_unserved(rt: Runtime, endpoint: str) -> str | None:
    """Why no model of the deployment can serve ``endpoint``, or None if one can.

    Which model a line names is known only once the file is read; what can be known at create is
    whether any model serves the endpoint at all: an embedding model serves /v1/embeddings (and
    scores), a cross-encoder /v1/score and /v1/rerank, a text-generation model every other endpoint
    (``storage.registry``: a model's task; ``workers.request_bodies.TASK_ENDPOINTS``). A batch no
    model could run is refused here, before its file is read; a line naming a model of another
    task is that line's error at validation (``workers.request_bodies.endpoint_mismatch``)."""
    models = entries(rt.db, rt.settings)
    if any(serves(entry.task, endpoint) for entry in models):
        return None
    if not models:
        return f"no model of this deployment serves {endpoint}: none is registered (`freight models add`)"
    names = ", ".join(entry.name for entry in models[:20])
    task = next(t for t in TASKS if serves(t, endpoint))
    if task == TRANSCRIBE:
        return (
            f"no model of this deployment serves {endpoint}: none of its models ({names}) is a speech"
            " model (a Whisper checkpoint: `freight models add NAME --path DIR`)"
        )
    if task != GENERATE and endpoint != EMBEDDINGS:
        return (
            f"no model of this deployment serves {endpoint}: none of its models ({names}) is a"
            " cross-encoder or an embedding model (`freight models add NAME --path DIR --task score`)"
        )
    if task == EMBED:
        return (
            f"no model of this deployment serves {endpoint}: its models ({names}) generate text;"
            " an embedding model serves it (`freight models add NAME --path DIR --task embed`)"
        )
    return (
        f"no model of this deployment serves {endpoint}: its models ({names}) are embedding models"
        " or cross-encoders, which generate no text"
    )


def model_unfit(rt: Runtime, model: str, endpoint: str) -> str | None:
    """Why the served ``model`` cannot serve ``endpoint`` (its task is the other one), or None: a
    drop folder's or the console's chosen model is known before any line is read."""
    entry = lookup(rt.db, rt.settings, model)
    if entry is None or serves(entry.task, endpoint):
        return None
    return endpoint_mismatch(model, endpoint, entry.task)


def input_file(s: Session, tenant_id: str, file_id: str, now: float) -> StoredFile:
    """The tenant's live batch input ``file_id``; another tenant's file answers as an unknown one."""
    source = s.get(StoredFile, file_id)
    if source is None or source.tenant_id != tenant_id or not live(source, now):
        raise ServiceError("not_found", f"No such File object: {file_id}", param="input_file_id")
    if source.purpose != "batch":
        raise ServiceError(
            "invalid_request",
            "input_file_id must be a file uploaded with purpose=batch",
            param="input_file_id",
        )
    return source


def add(
    s: Session, tenant_id: str, request: BatchRequest, now: int, settings: Settings | None = None
) -> Batch:
    """The new ``validating`` batch, added in the caller's transaction; the caller enqueues its
    validation after the commit. With ``settings``, the tenant's quotas are checked (every entry
    point passes them; a test or benchmark building rows directly may not)."""
    source = input_file(s, tenant_id, request.input_file_id, now)
    if settings is not None:
        check_new_batch(s, settings, tenant_id)
        budgets.check_new_batch(s, tenant_id, now)  # under the row lock the quotas took
    batch_id = new_id("batch_")
    # the batch's trace (storage/tracing.py): a child of the request creating it, if any, linked to
    # its input file's upload; its context stored on the row is the parent of every later task and
    # unit span of the batch
    attributes = {BATCH_ID: batch_id, TENANT: tenant_id}
    with span("batch.create", attributes=attributes, links=links_to(source.trace_context)):
        trace_context = current_traceparent()
    batch = Batch(
        id=batch_id,
        tenant_id=tenant_id,
        endpoint=request.endpoint,
        input_file_id=request.input_file_id,
        completion_window=request.window,
        status=BatchStatus.VALIDATING.value,
        metadata_=request.metadata,
        priority=request.priority,
        output_expires_after=request.output_expires_after,
        resumed_from=request.resumed_from,
        created_at=now,
        submitted_at=time.time(),  # created_at's seconds are too coarse for a burst of creates
        expires_at=now + request.tier.seconds,
        price_multiplier=request.tier.price_multiplier,
        trace_context=trace_context,
    )
    s.add(batch)
    return batch


class QuotaOverrun(Exception):
    """The upload passed the bytes the tenant's quota left it (how many were read so far)."""


class _Limited:
    """Reads at most ``limit`` bytes, then refuses: the store never holds an oversize upload."""

    def __init__(self, stream: IO[bytes], limit: int, quota_left: int | None = None) -> None:
        self.stream = stream
        self.limit = limit
        self.quota_left = quota_left  # bytes the tenant's stored-bytes quota still allows
        self.total = 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(CHUNK if size is None or size < 0 else min(size, CHUNK))
        self.total += len(data)
        if self.quota_left is not None and self.total > self.quota_left and self.quota_left < self.limit:
            raise QuotaOverrun(self.total)
        if self.total > self.limit:
            raise ServiceError(
                "too_large",
                f"file is larger than the {self.limit} byte limit",
                param="file",
                code="file_too_large",
            )
        return data


def clean_filename(name: str | None) -> str:
    """The last path segment, without control or bidi-override characters (they would spoof or
    break a listing); a name is only a label, never part of an object key."""
    name = os.path.basename((name or "").replace("\\", "/"))
    name = "".join(c for c in name if unicodedata.category(c) not in ("Cc", "Cs") and c not in BIDI_CONTROLS)
    name = name.strip()
    return (name if name not in ("", ".", "..") else "upload.jsonl")[:MAX_FILENAME]


def upload(
    rt: Runtime,
    tenant_id: str,
    purpose: str | None,
    filename: str | None,
    stream: IO[bytes],
    expires_after: int | None = None,
) -> StoredFile:
    """``expires_after``: seconds from upload to expiry (checked by ``check_expires_after``)."""
    record = store_file(rt, tenant_id, purpose, filename, stream, expires_after=expires_after)
    try:
        with rt.db.write() as s:
            check_stored(s, rt.settings, tenant_id, record.bytes)
            s.add(record)
            note_created(s, "file", record.id)  # a retry after a crash answers this file
    except ServiceError:
        rt.store.delete(record.object_key)
        raise
    return record


def set_expiry(rt: Runtime, tenant_id: str, file_id: str, expires_after: int) -> StoredFile:
    """Give a stored file of the tenant's its ``expires_after`` (seconds from its creation)."""
    with rt.db.write() as s:
        record = s.get(StoredFile, file_id, with_for_update=True)
        if record is None or record.tenant_id != tenant_id or not live(record, time.time()):
            raise ServiceError("not_found", f"No such File object: {file_id}", param="file_id")
        record.expires_at = record.created_at + expires_after
    return record


def store_file(
    rt: Runtime,
    tenant_id: str,
    purpose: str | None,
    filename: str | None,
    stream: IO[bytes],
    key: str | None = None,
    expires_after: int | None = None,
    limit: int | None = None,
) -> StoredFile:
    """Stream an upload into the object store (at ``key``, by default one of its own) and return
    its row, not yet added: the caller commits it, alone or with rows that refer to it, after
    ``quotas.check_stored`` in that transaction (the stream stops once it passes what the tenant's
    quota left when it began, so a tenant at its limit cannot park a file's worth in the store).
    ``limit``: the most bytes it may hold (FREIGHT_MAX_FILE_BYTES unless given: a drop folder's
    object, already in a bucket, may be as large as an upload in parts)."""
    if purpose not in PURPOSES + MEDIA_PURPOSES:
        raise ServiceError(
            "invalid_request",
            f"purpose must be one of {', '.join(PURPOSES + MEDIA_PURPOSES)}",
            param="purpose",
        )
    file_id = new_id("file-")
    key = key or f"files/{tenant_id}/{file_id}"
    with rt.db.read() as s:
        quota_left = bytes_left(s, rt.settings, tenant_id)
    limited = _Limited(stream, limit or rt.settings.max_file_bytes, quota_left)
    try:
        size = rt.store.put_stream(key, limited)  # type: ignore[arg-type]
    except QuotaOverrun as exc:
        rt.store.delete(key)
        with rt.db.read() as s:
            limit = quota_of(s, rt.settings, tenant_id, lock=False).stored_bytes
            use = stored_bytes(s, tenant_id)
        raise exceeded("stored file bytes", limit, use, " bytes", "file") from exc
    if size == 0:
        rt.store.delete(key)
        raise ServiceError("invalid_request", "the uploaded file is empty", param="file")
    created_at = int(time.time())
    return StoredFile(
        id=file_id,
        tenant_id=tenant_id,
        purpose=purpose,
        filename=clean_filename(filename),
        bytes=size,
        object_key=key,
        created_at=created_at,
        expires_at=expiry(rt.settings, created_at, expires_after),
        trace_context=current_traceparent(),  # the upload's request: its batches link to it
    )


class _Refused(Exception):
    """``record`` said no: roll back everything this transaction added."""


def create(rt: Runtime, tenant_id: str, payload: Any, resumed_from: str | None = None) -> Batch:
    """The Batch API's create: a batch over a file the tenant uploaded before (``resumed_from``:
    a resume of that batch, checked by the caller, which runs only the lines it left)."""
    request = replace(check_request(rt, payload), resumed_from=resumed_from)
    batch = create_batch(rt, tenant_id, request)
    assert batch is not None  # no ``record`` callback: nothing can refuse it
    return batch


def create_batch(
    rt: Runtime,
    tenant_id: str,
    request: BatchRequest,
    *,
    new_file: StoredFile | None = None,
    record: Callable[[Session, Batch], bool] | None = None,
) -> Batch | None:
    """Add the batch (with ``new_file``, a stored file's row not yet added, when the upload came
    with the request) in one transaction, commit, and send its validation.

    ``record`` runs inside that transaction with the new batch; returning False rolls everything
    back and returns None (a drop folder's claim on the inbox object, taken by another scanner).
    On a broker error the batch is withdrawn and the error propagates (see the module's doc)."""
    try:
        with rt.db.write() as s:
            if new_file is not None:
                check_stored(s, rt.settings, tenant_id, new_file.bytes)
                s.add(new_file)
                s.flush()
                request = replace(request, input_file_id=new_file.id)
            batch = add(s, tenant_id, request, int(time.time()), rt.settings)
            s.flush()
            if record is not None and not record(s, batch):
                raise _Refused
            note_created(s, "batch", batch.id)  # a retry after a crash answers this batch
    except _Refused:
        return None
    except ServiceError:  # a quota: the file stored for this batch goes with it
        if new_file is not None:
            rt.store.delete(new_file.object_key)
        raise
    try:
        rt.queue.validate(batch.id)  # after the commit that made the row
    except BROKER_ERRORS:
        withdraw(rt, batch.id, new_file)
        raise
    return batch


def withdraw(rt: Runtime, batch_id: str, new_file: StoredFile | None) -> None:
    """Take back a batch whose validation could not be sent, while it is still ``validating``,
    with what was made alongside it: a drop folder's claim on its inbox object (so the next scan
    reads the object again) and the file row and object stored in the same call."""
    with rt.db.write() as s:
        batch = s.get(Batch, batch_id, with_for_update=True)
        if batch is None or batch.status != BatchStatus.VALIDATING:
            return  # validation ran after all (a send of ours reached the broker) or it was cancelled
        # the claim first: deleting the batch would only null its batch_id (ON DELETE SET NULL)
        s.execute(delete(DropObject).where(DropObject.batch_id == batch_id))
        s.delete(batch)
        if new_file is not None:
            s.execute(delete(StoredFile).where(StoredFile.id == new_file.id))
    if new_file is not None:
        try:
            rt.store.delete(new_file.object_key)
        except ObjectStoreError:  # the broker's error is the one to report; the object is unlisted
            log.warning("could not delete %s after withdrawing batch %s", new_file.object_key, batch_id)
