"""The ledger of what a tenant's batches store beyond their file rows, counted in its stored bytes.

A file row (an upload, a drop folder's copy, a batch's output and error files) carries its size,
and a converted copy its ``file_conversions`` row; ``storage.quotas.stored_bytes`` sums those.
The objects a batch produces on the way were counted nowhere: its Parquet shards, the images and
audio its lines name (kept once per batch), its unit results. A tenant with an 8 KiB quota stored
60 MiB that way. Each such object is charged here by its key with its size (``charge_bytes``,
idempotent: an object written again is charged once, at its latest size) and released when it is
deleted (``release_bytes``) or when the batch's data is purged (``release_batch``), so the sum is
what the store holds for the tenant.

Validation's sorted runs (``batches/<id>/validation/``) are scratch, deleted by the merge that
reads them, and are not charged.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from storage.models import Batch, ChargedObject
from storage.runtime import Runtime


def charge_bytes(
    s: Session,
    tenant_id: str,
    object_key: str,
    n: int,
    *,
    batch_id: str | None = None,
    now: int | None = None,
) -> None:
    """Count the object at ``object_key`` (``n`` bytes) in the tenant's stored bytes, in the
    caller's transaction; an object charged before is charged again at ``n``, not twice."""
    if s.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
    values = {
        "object_key": object_key,
        "tenant_id": tenant_id,
        "batch_id": batch_id,
        "bytes": n,
        "charged_at": int(time.time()) if now is None else now,
    }
    statement = insert(ChargedObject).values(**values)
    s.execute(
        statement.on_conflict_do_update(
            index_elements=["object_key"], set_={"bytes": n, "charged_at": values["charged_at"]}
        )
    )


def release_bytes(s: Session, object_key: str) -> None:
    """The object at ``object_key`` is deleted: no longer counted."""
    s.execute(delete(ChargedObject).where(ChargedObject.object_key == object_key))


def release_batch(s: Session, batch_id: str) -> int:
    """The batch's data is purged: none of its objects is counted any more; the bytes released."""
    released = s.scalar(select(func.sum(ChargedObject.bytes)).where(ChargedObject.batch_id == batch_id))
    s.execute(delete(ChargedObject).where(ChargedObject.batch_id == batch_id))
    return int(released or 0)


def charged_bytes(s: Session, tenant_id: str) -> int:
    """The bytes charged to the tenant here (its file rows are counted by ``storage.quotas``)."""
    return int(
        s.scalar(select(func.sum(ChargedObject.bytes)).where(ChargedObject.tenant_id == tenant_id)) or 0
    )


def charge_listed(rt: Runtime, batch_id: str, prefixes: Iterable[str]) -> int:
    """Charge every object the store lists under ``prefixes`` to the batch's tenant (after
    validation wrote its shards, images and audio); the bytes charged. Listing what is there,
    rather than each writer charging as it goes, counts an object whatever wrote it."""
    listed = [(info.key, info.size) for prefix in prefixes for info in rt.store.list_info(prefix)]
    with rt.db.write() as s:
        tenant_id = s.scalar(select(Batch.tenant_id).where(Batch.id == batch_id))
        if tenant_id is None:
            return 0
        now = int(time.time())
        for key, size in listed:
            charge_bytes(s, tenant_id, key, size, batch_id=batch_id, now=now)
    return sum(size for _, size in listed)
