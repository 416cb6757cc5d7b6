"""Per-tenant quotas: bytes of files kept, batches not yet final, requests queued in them.

Queued requests count what the lines ask for, not lines: a chat line's ``n`` sequences, an
embeddings line's inputs, a score or rerank line's pairs (``scheduler.request_work``, summed per
unit by validation), so one line of ``n=128`` counts 128 and a tenant cannot queue 128 times the
work of another under the same limit.

A tenant that could store, open or queue without bound could fill the disk or hold the engines
for everyone. Each limit is the tenant's own column when set, else the ``FREIGHT_QUOTA_*``
default; 0 is unlimited. A check reads the use inside the caller's transaction after locking the
tenant's row, so two uploads or creates of one tenant cannot both pass on the same figure. A
refusal is a ``quota_exceeded`` error naming the limit and the current use.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from storage.errors import ServiceError
from storage.models import Batch, FileConversion, StoredFile, Tenant, Upload, UploadPart, WorkUnit
from storage.object_ledger import charged_bytes
from storage.settings import Settings
from storage.status import BatchStatus, UnitStatus, UploadStatus

OPEN_STATUSES = (
    BatchStatus.VALIDATING.value,
    BatchStatus.IN_PROGRESS.value,
    BatchStatus.FINALIZING.value,
    BatchStatus.CANCELLING.value,
)


@dataclass(frozen=True)
class Quota:
    stored_bytes: int  # 0: unlimited
    open_batches: int
    queued_requests: int


def quota_of(s: Session, settings: Settings, tenant_id: str, *, lock: bool = True) -> Quota:
    """The tenant's limits; ``lock`` takes its row for the rest of the transaction."""
    tenant = s.get(Tenant, tenant_id, with_for_update=lock)

    def pick(own: int | None, default: int) -> int:
        return default if own is None else own

    if tenant is None:
        return Quota(settings.quota_stored_bytes, settings.quota_open_batches, settings.quota_queued_requests)
    return Quota(
        pick(tenant.quota_stored_bytes, settings.quota_stored_bytes),
        pick(tenant.quota_open_batches, settings.quota_open_batches),
        pick(tenant.quota_queued_requests, settings.quota_queued_requests),
    )


def stored_bytes(s: Session, tenant_id: str) -> int:
    """Bytes of the tenant's files not deleted (inputs and results alike), of their conversions
    to the other format kept for downloads, and of the parts of its uploads as they arrive, until
    the upload's file replaces them or they are deleted."""
    total = s.scalar(
        select(func.sum(StoredFile.bytes)).where(
            StoredFile.tenant_id == tenant_id, StoredFile.deleted_at.is_(None)
        )
    )
    converted = s.scalar(
        select(func.sum(FileConversion.bytes))
        .join(StoredFile, StoredFile.id == FileConversion.file_id)
        .where(FileConversion.tenant_id == tenant_id, StoredFile.deleted_at.is_(None))
    )
    parts = s.scalar(
        select(func.sum(UploadPart.bytes))
        .join(Upload, Upload.id == UploadPart.upload_id)
        .where(
            Upload.tenant_id == tenant_id,
            Upload.status != UploadStatus.COMPLETED,
            Upload.purged_at.is_(None),
        )
    )
    # and what its batches produced beyond their files: shards, images, audio, unit results
    return int(total or 0) + int(converted or 0) + int(parts or 0) + charged_bytes(s, tenant_id)


def open_batches(s: Session, tenant_id: str) -> int:
    return int(
        s.scalar(select(func.count()).where(Batch.tenant_id == tenant_id, Batch.status.in_(OPEN_STATUSES)))
        or 0
    )


def queued_requests(s: Session, tenant_id: str, *, excluding: str | None = None) -> int:
    """Requests of the tenant's open batches not yet finished, each counted as the outputs it
    asks for (see the module): the ``sequences`` of their units not finished (a unit without
    them recorded: its requests). A ``validating`` batch counts the units of its early slices
    (``workers.head_start``), the rest once its validation ends."""
    asked = case((WorkUnit.sequences > 0, WorkUnit.sequences), else_=WorkUnit.n_requests)
    query = (
        select(func.sum(asked))
        .join(Batch, Batch.id == WorkUnit.batch_id)
        .where(
            Batch.tenant_id == tenant_id,
            Batch.status.in_(OPEN_STATUSES),
            WorkUnit.status.not_in(UnitStatus.FINISHED),
        )
    )
    if excluding is not None:
        query = query.where(Batch.id != excluding)
    return int(s.scalar(query) or 0)


def exceeded(what: str, limit: int, use: int, unit: str = "", param: str | None = None) -> ServiceError:
    return ServiceError(
        "forbidden",
        f"quota exceeded: {what} is limited to {limit:,}{unit} per tenant; current use {use:,}{unit}",
        param=param,
        code="quota_exceeded",
    )


def bytes_left(s: Session, settings: Settings, tenant_id: str) -> int | None:
    """Bytes the tenant may still store (None: unlimited); refuses when none are left. Read
    without the lock, before an upload streams: the commit checks again (``check_stored``)."""
    limit = quota_of(s, settings, tenant_id, lock=False).stored_bytes
    if not limit:
        return None
    use = stored_bytes(s, tenant_id)
    if use >= limit:
        raise exceeded("stored file bytes", limit, use, " bytes", "file")
    return limit - use


def check_stored(s: Session, settings: Settings, tenant_id: str, adding: int) -> None:
    """Refuse ``adding`` bytes more (the file is not yet in the session) past the tenant's limit."""
    limit = quota_of(s, settings, tenant_id).stored_bytes
    if limit:
        use = stored_bytes(s, tenant_id)
        if use + adding > limit:
            raise exceeded("stored file bytes", limit, use, " bytes", "file")


def check_new_batch(s: Session, settings: Settings, tenant_id: str) -> None:
    """Refuse another open batch when the tenant has its limit of open batches, or of queued
    requests already, or stores more than its limit of bytes (a batch's output may take it past
    the limit: the output is kept, and new work is refused until files are deleted or expire)."""
    quota = quota_of(s, settings, tenant_id)
    if quota.stored_bytes:
        use = stored_bytes(s, tenant_id)
        if use > quota.stored_bytes:
            raise exceeded("stored file bytes", quota.stored_bytes, use, " bytes")
    if quota.open_batches:
        use = open_batches(s, tenant_id)
        if use >= quota.open_batches:
            raise exceeded("open batches", quota.open_batches, use)
    if quota.queued_requests:
        use = queued_requests(s, tenant_id)
        if use >= quota.queued_requests:
            raise exceeded("queued requests", quota.queued_requests, use)


def queued_refusal(s: Session, settings: Settings, batch: Batch, requests: int) -> str | None:
    """Why a validated batch asking for ``requests`` (its lines' sequences, inputs and pairs) may
    not join the tenant's queue (None: it may)."""
    limit = quota_of(s, settings, batch.tenant_id).queued_requests
    if not limit:
        return None
    use = queued_requests(s, batch.tenant_id, excluding=batch.id)
    if use + requests <= limit:
        return None
    return exceeded("queued requests", limit, use).message + f"; this batch has {requests:,} requests"


def check_incoming(s: Session, settings: Settings, tenant_id: str, size: int) -> None:
    """Refuse a drop folder's inbox file of ``size`` bytes before it is copied into the store:
    the bytes it would add past the tenant's limit, or a batch it could not open (``size`` is
    the object's listed size; a gzipped one's copy is bounded again as it streams)."""
    limit = quota_of(s, settings, tenant_id).stored_bytes
    if limit:
        use = stored_bytes(s, tenant_id)
        if use + size > limit:
            raise exceeded("stored file bytes", limit, use, " bytes", "file")
    check_new_batch(s, settings, tenant_id)


def stored_overrun(s: Session, settings: Settings, tenant_id: str) -> str | None:
    """Why the tenant is past its stored-bytes limit (None: it is not). Finalization asks after
    adding a batch's output and error files: they are kept, and this says why new work is refused."""
    limit = quota_of(s, settings, tenant_id, lock=False).stored_bytes
    use = stored_bytes(s, tenant_id) if limit else 0
    if not limit or use <= limit:
        return None
    return (
        exceeded("stored file bytes", limit, use, " bytes").message
        + "; the output is kept, and new uploads and batches are refused until files are deleted or expire"
    )
