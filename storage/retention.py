"""Deleting what a tenant's data left in the object store, row by row: a file's bytes (and the
conversions kept beside them), a final batch's Parquet shards and unit results, the parts of an
upload that is no longer pending.

Objects go first, the row's mark after: a pass that dies in between leaves a row that the next
pass deletes again (deleting a missing object is no error), never a marked row whose prompts
are still stored. Shared by the API's file delete and the periodic cleanup (workers/cleanup.py).
"""

from __future__ import annotations

from sqlalchemy import select, update

from storage.models import Batch, StoredFile, Upload
from storage.object_ledger import release_batch
from storage.runtime import Runtime
from storage.settings import Settings
from storage.status import BatchStatus, UploadStatus

# the purposes of files that are images or audio a batch line names by id (workers/media_files.py):
# OpenAI's of an image input; the official client's others (assistants, fine-tune, evals) mean
# nothing here and are refused at upload
MEDIA_PURPOSES = ("vision", "user_data")
# workers/conversions.py keeps conversions at derived/<id>.<kind> (input.parquet: in input order)
DERIVED_FORMATS = ("jsonl", "parquet", "input.parquet")


def live(record: StoredFile, now: float) -> bool:
    """Not deleted and not past its expiry: an expired file is gone to its tenant at once, before
    the cleanup comes by to delete it."""
    return record.deleted_at is None and (record.expires_at is None or record.expires_at > now)


def expiry(settings: Settings, created_at: int, expires_after: int | None) -> int | None:
    """When a file made at ``created_at`` expires: its own ``expires_after`` (seconds), else the
    default retention (None: kept until deleted)."""
    seconds = expires_after if expires_after is not None else settings.file_retention_seconds
    return created_at + seconds if seconds else None


def batch_data_prefixes(batch_id: str) -> tuple[str, ...]:
    """Where validation writes a batch's shards (and a chunked validation its chunks' runs, which
    its merge deletes unless it was interrupted, and the images of its lines) and engine workers
    its unit results; the output
    and error files under ``batches/<id>/`` are files of their own, with their own expiry."""
    return (
        f"batches/{batch_id}/shards/",
        f"batches/{batch_id}/units/",
        f"batches/{batch_id}/validation/",
        f"batches/{batch_id}/images/",  # the images of its chat lines (workers/images.py)
        f"batches/{batch_id}/audio/",  # the audio its lines name by file id (workers/media_files.py)
    )


def validated_prefixes(batch_id: str) -> tuple[str, ...]:
    """What validation leaves of a batch, charged to its tenant when it ends
    (``storage.object_ledger.charge_listed``): its shards, images and audio (not its sorted
    runs, scratch that the merge deletes)."""
    return tuple(p for p in batch_data_prefixes(batch_id) if not p.endswith("/validation/"))


def delete_file_objects(rt: Runtime, record: StoredFile) -> None:
    rt.store.delete(record.object_key)
    for fmt in DERIVED_FORMATS:
        rt.store.delete(f"derived/{record.id}.{fmt}")


def purge_batch_data(rt: Runtime, batch_id: str, now: int) -> int:
    """Delete a final batch's shards and unit results and mark it purged; the objects deleted.
    Its rows (batch, work units, figures) stay: reports and the console read them."""
    deleted = 0
    for prefix in batch_data_prefixes(batch_id):
        for key in list(rt.store.list(prefix)):
            rt.store.delete(key)
            deleted += 1
    with rt.db.write() as s:
        s.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.status.in_(BatchStatus.FINAL), Batch.purged_at.is_(None))
            .values(purged_at=now)
        )
        release_batch(s, batch_id)  # its objects deleted above no longer count in the tenant's bytes
    return deleted


def purge_batches_of_file(rt: Runtime, file_id: str, now: int) -> list[str]:
    """Purge the final batches that read ``file_id`` (just deleted): their shards hold its prompts."""
    with rt.db.read() as s:
        batch_ids = list(
            s.scalars(
                select(Batch.id).where(
                    Batch.input_file_id == file_id,
                    Batch.status.in_(BatchStatus.FINAL),
                    Batch.purged_at.is_(None),
                )
            )
        )
    for batch_id in batch_ids:
        purge_batch_data(rt, batch_id, now)
    return batch_ids


def upload_parts_prefix(tenant_id: str, upload_id: str) -> str:
    """Where an upload's parts are stored, one object each (``api/services/uploads.py``)."""
    return f"uploads/{tenant_id}/{upload_id}/"


def expire_uploads(rt: Runtime, now: int, limit: int) -> list[str]:
    """Pending uploads past their ``expires_at`` become ``expired`` (up to ``limit``); their ids.
    A compare-and-set: an upload completed or cancelled meanwhile keeps its state."""
    with rt.db.write() as s:
        due = list(
            s.scalars(
                select(Upload.id)
                .where(Upload.status == UploadStatus.PENDING, Upload.expires_at <= now)
                .limit(limit)
            )
        )
        if due:
            s.execute(
                update(Upload)
                .where(Upload.id.in_(due), Upload.status == UploadStatus.PENDING)
                .values(status=UploadStatus.EXPIRED, finished_at=now)
            )
    return due


def purge_upload_parts(rt: Runtime, tenant_id: str, upload_id: str, now: int) -> int:
    """Delete the part objects of an upload that is no longer pending (whatever is under its
    prefix, so a part whose row was never written goes too) and mark it purged; the objects
    deleted. A completed upload's file is an object of its own, elsewhere."""
    deleted = 0
    for key in list(rt.store.list(upload_parts_prefix(tenant_id, upload_id))):
        rt.store.delete(key)
        deleted += 1
    with rt.db.write() as s:
        s.execute(
            update(Upload)
            .where(Upload.id == upload_id, Upload.status != UploadStatus.PENDING, Upload.purged_at.is_(None))
            .values(purged_at=now)
        )
    return deleted
