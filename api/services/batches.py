"""Batches: create (then validate asynchronously), read, list, cancel."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from api.errors import ServiceError
from api.services.paging import Page, page
from scheduler.lifecycle import stop_batch
from scheduler.metering import SlaTier
from storage.models import Batch, StoredFile, UnitStatus, WorkUnit, new_id
from storage.status import BatchStatus
from workers.celery_app import BROKER_ERRORS
from workers.protocol import ENDPOINTS
from workers.runtime import Runtime

MAX_METADATA_PAIRS = 16


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


@dataclass(frozen=True)
class BatchRequest:
    """A checked create request; ``add`` turns it into a row inside the caller's transaction."""

    input_file_id: str
    endpoint: str
    window: str
    tier: SlaTier
    metadata: dict[str, str] | None
    priority: int


def create(rt: Runtime, tenant_id: str, payload: Any) -> Batch:
    request = check_request(rt, payload)
    with rt.db.write() as s:
        batch = add(s, tenant_id, request, int(time.time()))
    try:
        rt.queue.validate(batch.id)  # after the commit that made the row
    except BROKER_ERRORS:
        # no task will ever validate it: take the row back, so the client's retry (a 503) is the
        # only copy of the job, rather than leaving a batch stuck in ``validating``
        with rt.db.write() as s:
            s.execute(delete(Batch).where(Batch.id == batch.id, Batch.status == BatchStatus.VALIDATING))
        raise
    return batch


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
    if endpoint not in ENDPOINTS:
        raise ServiceError(
            "invalid_request",
            f"endpoint must be one of {', '.join(ENDPOINTS)}",
            param="endpoint",
            code="invalid_endpoint",
        )
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
    return BatchRequest(input_file_id, endpoint, window, tier, metadata, priority)


def add(s: Session, tenant_id: str, request: BatchRequest, now: int) -> Batch:
    """The new ``validating`` batch, added in the caller's transaction; the caller enqueues its
    validation after the commit."""
    source = s.get(StoredFile, request.input_file_id)
    if source is None or source.tenant_id != tenant_id or source.deleted_at is not None:
        raise ServiceError(
            "not_found", f"No such File object: {request.input_file_id}", param="input_file_id"
        )
    if source.purpose != "batch":
        raise ServiceError(
            "invalid_request",
            "input_file_id must be a file uploaded with purpose=batch",
            param="input_file_id",
        )
    batch = Batch(
        id=new_id("batch_"),
        tenant_id=tenant_id,
        endpoint=request.endpoint,
        input_file_id=request.input_file_id,
        completion_window=request.window,
        status=BatchStatus.VALIDATING.value,
        metadata_=request.metadata,
        priority=request.priority,
        created_at=now,
        expires_at=now + request.tier.seconds,
        price_multiplier=request.tier.price_multiplier,
    )
    s.add(batch)
    return batch


def get(rt: Runtime, tenant_id: str, batch_id: str) -> Batch:
    with rt.db.read() as s:
        return _owned(s, tenant_id, batch_id)


def get_with_progress(rt: Runtime, tenant_id: str, batch_id: str) -> tuple[Batch, tuple[int, int]]:
    """The batch and its running units' (completed, failed) so far (see ``running_counts``)."""
    with rt.db.read() as s:
        batch = _owned(s, tenant_id, batch_id)
        return batch, running_counts(s, [batch]).get(batch.id, (0, 0))


def _owned(s: Session, tenant_id: str, batch_id: str) -> Batch:
    batch = s.get(Batch, batch_id)
    if batch is None or batch.tenant_id != tenant_id:
        raise ServiceError("not_found", f"No such Batch object: {batch_id}", param="batch_id")
    return batch


def list_batches(
    rt: Runtime, tenant_id: str, after: str | None, limit: int
) -> tuple[Page, dict[str, tuple[int, int]]]:
    """A page of the tenant's batches and their running units' counts, in one read transaction
    (clients poll this: every transaction it saves is CPU the engines keep)."""
    with rt.db.read() as s:
        result = page(s, Batch, tenant_id, after, limit)
        return result, running_counts(s, result.rows)


def running_counts(s: Session, batches: Iterable[Batch]) -> dict[str, tuple[int, int]]:
    """(completed, failed) so far in each batch's running units, from their heartbeats.

    ``Batch.request_completed`` counts finished units only; adding these makes request_counts
    move within a unit (a unit of a few hundred long requests can run for minutes)."""
    ids = [b.id for b in batches if b.status in (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING)]
    if not ids:
        return {}
    rows = s.execute(
        select(WorkUnit.batch_id, func.sum(WorkUnit.completed), func.sum(WorkUnit.failed))
        .where(WorkUnit.batch_id.in_(ids), WorkUnit.status == UnitStatus.RUNNING)
        .group_by(WorkUnit.batch_id)
    ).all()
    return {batch_id: (int(done or 0), int(failed or 0)) for batch_id, done, failed in rows}


def cancel(rt: Runtime, tenant_id: str, batch_id: str) -> Batch:
    now = int(time.time())
    with rt.db.write() as s:
        batch = s.get(Batch, batch_id, with_for_update=True)
        if batch is None or batch.tenant_id != tenant_id:
            raise ServiceError("not_found", f"No such Batch object: {batch_id}", param="batch_id")
        if batch.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            return batch
        if batch.status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
            raise ServiceError(
                "conflict",
                f"Cannot cancel a batch with status {batch.status}.",
                param="batch_id",
                code="batch_not_cancellable",
            )
        stop_batch(s, batch, BatchStatus.CANCELLING, now)
    rt.queue.finalize(batch_id)  # a no-op while units still run; the dispatcher retries
    return batch
