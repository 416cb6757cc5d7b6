"""Drop-folder delivery: once an inbox file's batch is final (or the file was refused), write
``outbox/NAME.output.jsonl``, ``outbox/NAME.errors.jsonl`` and ``outbox/NAME.manifest.json``, then
move the input (and its sidecar) to ``archive/`` or ``failed/``.

One deliverer at a time holds the object's lease; every step may be redone (same keys, same
bytes; a moved input is simply gone), and the object is marked delivered last, so a crash or an
unreachable bucket means the whole delivery is tried again later, with backoff.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from scheduler.cost import cost_summary
from scheduler.dropfolder_plan import (
    BatchFacts,
    Delivery,
    backoff_seconds,
    build_manifest,
    folder_url,
    full_key,
    manifest_bytes,
    moved_key,
    sidecar_key,
)
from storage.leases import DELIVERY_LEASE
from storage.models import Batch, DropFolder, DropObject, StoredFile
from storage.objectstore import ObjectNotFound, ObjectStore, ObjectStoreError, iter_lines
from storage.result_tables import write_results
from storage.runtime import Runtime
from storage.status import BatchStatus
from workers.dropfolders import FolderConfig, describe_error, folder_store, renew_lease

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Job:
    lease: float
    folder: FolderConfig
    delivery: Delivery
    output_key: str | None  # Freight's own store
    errors_key: str | None


def deliver(rt: Runtime, object_id: int, now: float) -> bool:
    """Deliver one final drop object's results; True once delivered by this call."""
    job = _claim_delivery(rt, object_id, now)
    if job is None:
        return False
    d = job.delivery
    lease = job.lease
    try:
        store = folder_store(job.folder)
        keys = d.results
        if d.writes_results:
            for source, target in ((job.output_key, keys.output), (job.errors_key, keys.errors)):
                if d.output_format == "parquet":
                    put_parquet_results(rt, store, source, target)
                elif source is None:
                    store.put_chunks(target, [])  # every batch that ran has both files
                else:
                    with rt.store.open(source) as stream:
                        store.put_stream(target, stream)  # multipart above 8 MiB
                lease = renew_lease(rt, DELIVERY_LEASE, object_id, lease)
        store.put_chunks(keys.manifest, [manifest_bytes(build_manifest(d))])
        move_input(store, d.key, d.etag, d.archive)
        side = sidecar_key(d.name)
        if _etag(store, d.key) is None and (side_etag := _etag(store, side)) is not None:
            move_input(store, side, side_etag, moved_key(side, d.failed))  # unless a new upload uses it
    except Exception as exc:
        _delivery_failed(rt, object_id, lease, exc, time.time())
        return False
    with rt.db.write() as s:
        DELIVERY_LEASE.release(
            s,
            object_id,
            lease,
            delivered_at=time.time(),
            last_error=None,
            archived_key=full_key(d.prefix, d.archive),
        )
    log.info(
        "drop folder %s: %s delivered (%s)",
        folder_url(d.bucket, d.prefix),
        d.key,
        d.batch.status if d.batch else "refused",
    )
    return True


def put_parquet_results(rt: Runtime, store: ObjectStore, source: str | None, target: str) -> None:
    """A result file as typed Parquet (``storage.result_tables``), through a local temporary file."""
    spill = rt.settings.data_dir / "tmp"
    spill.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=spill, suffix=".parquet") as local:
        if source is None:
            write_results([], local.name)
        else:
            with rt.store.open(source) as stream:
                write_results(iter_lines(stream), local.name)
        with open(local.name, "rb") as converted:
            store.put_stream(target, converted)


def move_input(store: ObjectStore, key: str, etag: str, target: str) -> bool:
    """Move the inbox object out if it is still the version that was processed. Redoing it is
    harmless: a version already moved (or deleted by its owner) is gone, and a new upload under the
    same key is a new file, left for the next scan."""
    if _etag(store, key) != etag:
        return False
    try:
        store.copy(key, target)
    except ObjectNotFound:
        return False
    if _etag(store, key) == etag:
        store.delete(key)
    return True


def _etag(store: ObjectStore, key: str) -> str | None:
    """The object's ETag, None if there is none (any other failure raises)."""
    try:
        return store.stat(key).etag
    except ObjectNotFound:
        return None


class _NotFinal(Exception):
    """The object's batch is still running: give the lease back."""


def _claim_delivery(rt: Runtime, object_id: int, now: float) -> _Job | None:
    """Take the object's delivery lease (compare-and-set) if its results are due to go out."""
    try:
        with rt.db.write() as s:
            claimed = DELIVERY_LEASE.take(
                s,
                object_id,
                now,
                DropObject.delivered_at.is_(None),
                or_(DropObject.next_delivery_at.is_(None), DropObject.next_delivery_at <= now),
                now=now,
                lease_seconds=rt.settings.lease_seconds,
            )
            if not claimed:
                return None
            obj = s.get(DropObject, object_id)
            assert obj is not None
            folder = s.get(DropFolder, obj.folder_id)
            assert folder is not None
            batch = s.get(Batch, obj.batch_id) if obj.batch_id else None
            if batch is not None and batch.status not in BatchStatus.FINAL:
                raise _NotFinal
            output_key = errors_key = None
            if batch is not None:
                output_key = _object_key(s, batch.output_file_id)
                errors_key = _object_key(s, batch.error_file_id)
            prefix_len = len(folder.prefix) + 1 if folder.prefix else 0
            delivery = Delivery(
                bucket=obj.bucket,
                prefix=folder.prefix,
                key=obj.key[prefix_len:],
                etag=obj.etag,
                size=obj.size,
                batch=None if batch is None else batch_facts(batch),
                refused=tuple(obj.errors or ()),
                output_format=folder.output_format or "jsonl",
            )
            return _Job(now, FolderConfig.of(folder, rt.secrets), delivery, output_key, errors_key)
    except _NotFinal:
        return None


def batch_facts(b: Batch) -> BatchFacts:
    errors = (b.errors or {}).get("data") or []
    return BatchFacts(
        id=b.id,
        status=b.status,
        endpoint=b.endpoint,
        model=b.model,
        completion_window=b.completion_window,
        created_at=b.created_at,
        expires_at=b.expires_at,
        finished_at=b.finished_at,
        sla_met=b.sla_met,
        total=b.request_total,
        completed=b.request_completed,
        failed=b.request_failed,
        input_tokens=b.prompt_tokens,
        cached_tokens=b.cached_tokens,
        output_tokens=b.completion_tokens,
        cost=cost_summary(b),
        errors=tuple(errors),
    )


def _object_key(s: Session, file_id: str | None) -> str | None:
    if file_id is None:
        return None
    stored = s.get(StoredFile, file_id)
    return None if stored is None else stored.object_key


def _delivery_failed(rt: Runtime, object_id: int, lease: float, exc: Exception, now: float) -> None:
    with rt.db.read() as s:
        attempts = (s.scalar(select(DropObject.delivery_attempts).where(DropObject.id == object_id)) or 0) + 1
    pause = backoff_seconds(
        attempts, rt.settings.dropfolder_poll_seconds, rt.settings.dropfolder_max_backoff_seconds
    )
    message = describe_error(exc)
    log.warning(
        "drop object %s: delivery failed (%s); attempt %d, retrying in %.0fs",
        object_id,
        message,
        attempts,
        pause,
        exc_info=not isinstance(exc, ObjectStoreError | OSError),
    )
    with rt.db.write() as s:
        DELIVERY_LEASE.release(
            s,
            object_id,
            lease,
            next_delivery_at=now + pause,
            delivery_attempts=attempts,
            last_error=message,
        )
