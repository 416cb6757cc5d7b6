"""S3 drop folders: turn files dropped in ``<prefix>/inbox/`` into ordinary batches, and deliver
each final batch's results to ``<prefix>/outbox/`` and its input to ``archive/`` (or ``failed/``).

* ``poll`` (the ``freight.scan_dropfolders`` beat task) sends a scan task per folder that is due
  and a delivery task per drop object whose batch is final and not yet delivered. The folders of
  a disabled tenant (``freight tenant disable``) are not scanned until it is enabled again.
* ``scan_folder`` lists the inbox under a per-folder lease and ingests every new (key, ETag): the
  object is copied into Freight's store (gunzipped, lines without ``body.model`` given the
  folder's model) at a key fixed by its version, then one transaction adds the file row, the
  batch and the drop-object row, the last by insert-or-nothing on the unique (bucket, key, ETag).
  Two scanners racing, or a rescan after a crash at any point, make one batch: the loser's
  transaction rolls back, and its copy was the same bytes at the same key. A batch whose
  validation message was lost (a scanner that died after the commit) is sent again by the tick,
  as every ``validating`` batch is (``workers.dispatcher.resend_lost_validations``).
* ``deliver`` (``workers/dropfolder_delivery.py``) writes the outbox files and the manifest, then
  moves the input, under a per-object lease; every step may be redone, and the object is marked
  delivered last. ``workers/dropfolder_input.py`` streams an object into Freight's store.

A bucket that cannot be reached fails the scan or delivery; it is logged and retried after a
pause that doubles up to ``FREIGHT_DROPFOLDER_MAX_BACKOFF_SECONDS``. Nothing is lost: the inbox
object stays where it is until its results are out. Secrets never reach a log line.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import ColumnElement, exists, or_, select
from sqlalchemy.orm import Session

from scheduler.dropfolder_plan import (
    INBOX,
    MAX_SIDECAR_BYTES,
    InboxFile,
    Listed,
    SidecarError,
    backoff_seconds,
    file_request,
    folder_url,
    full_key,
    inbox_name,
    is_parquet_key,
    parse_sidecar,
    plan_scan,
    refusal,
)
from scheduler.leases import renewal_due
from storage.errors import ServiceError
from storage.leases import DELIVERY_LEASE, SCAN_LEASE, LeaseKeeper
from storage.models import Batch, DropFolder, DropObject, StoredFile, Tenant
from storage.objectstore import (
    ObjectChanged,
    ObjectNotFound,
    ObjectStore,
    ObjectStoreError,
    S3ObjectStore,
    s3_client,
)
from storage.quotas import check_incoming
from storage.request_tables import DEFAULT_PREFIX
from storage.runtime import Runtime
from storage.secret_box import SecretBox
from storage.status import BatchStatus
from workers import intake
from workers.dropfolder_input import InvalidInput, request_stream

log = logging.getLogger(__name__)

DELIVERIES_PER_POLL = 100
KNOWN_CHUNK = 500  # keys per IN (...) when looking up known versions


@dataclass(frozen=True)
class FolderConfig:
    id: str
    tenant_id: str
    bucket: str
    prefix: str
    endpoint: str
    model: str | None
    window: str
    s3_endpoint_url: str | None
    region: str | None
    access_key_id: str | None = field(repr=False)
    secret_access_key: str | None = field(repr=False)
    scan_failures: int = 0
    output_format: str = "jsonl"

    @classmethod
    def of(cls, row: DropFolder, box: SecretBox) -> FolderConfig:
        """The folder's settings, its secret opened (the row holds it sealed once a key is set)."""
        return cls(
            row.id,
            row.tenant_id,
            row.bucket,
            row.prefix,
            row.endpoint,
            row.model,
            row.completion_window,
            row.s3_endpoint_url,
            row.region,
            row.access_key_id,
            box.open(row.secret_access_key),
            row.scan_failures,
            row.output_format or "jsonl",
        )

    @property
    def url(self) -> str:
        return folder_url(self.bucket, self.prefix)


# -- S3 access: one client per distinct connection, shared by the threads of a worker ----------

_clients: dict[tuple[str | None, ...], Any] = {}
_clients_lock = threading.Lock()


def folder_store(folder: FolderConfig) -> ObjectStore:
    conn = (folder.s3_endpoint_url, folder.region, folder.access_key_id, folder.secret_access_key)
    with _clients_lock:
        client = _clients.get(conn)
        if client is None:
            # few retries and a short connect timeout: an unreachable bucket fails fast and is
            # retried by the drop folder's own backoff, not inside one task
            client = _clients[conn] = s3_client(
                folder.s3_endpoint_url,
                region=folder.region,
                access_key_id=folder.access_key_id,
                secret_access_key=folder.secret_access_key,
                max_attempts=3,
                connect_timeout=5,
            )
    return S3ObjectStore(folder.bucket, folder.prefix, client=client)


# -- poll: what is due --------------------------------------------------------------------------


@dataclass
class PollReport:
    scans: list[str] = field(default_factory=list)
    deliveries: list[int] = field(default_factory=list)


def poll(rt: Runtime, now: float) -> PollReport:
    report = PollReport()
    lease = rt.settings.lease_seconds
    with rt.db.read() as s:
        report.scans = list(
            s.scalars(
                select(DropFolder.id).where(
                    DropFolder.removed_at.is_(None),
                    _tenant_enabled(),
                    or_(DropFolder.next_scan_at.is_(None), DropFolder.next_scan_at <= now),
                    SCAN_LEASE.free(now, lease),
                )
            ).all()
        )
        report.deliveries = list(
            s.scalars(
                select(DropObject.id)
                .outerjoin(Batch, Batch.id == DropObject.batch_id)
                .where(*_deliverable(now, lease))
                .order_by(DropObject.id)
                .limit(DELIVERIES_PER_POLL)
            ).all()
        )
    expires = max(2 * rt.settings.dropfolder_poll_seconds, 10.0)  # a stale copy is dropped
    for folder_id in report.scans:
        rt.queue.scan_dropfolder(folder_id, expires)
    for object_id in report.deliveries:
        rt.queue.deliver_dropfolder_object(object_id, expires)
    return report


def _tenant_enabled() -> ColumnElement[bool]:
    """The folder's tenant is not disabled (``freight tenant disable``): a disabled tenant's
    folders are not scanned, nor a scan sent before the disabling run, until it is enabled again."""
    return ~exists().where(Tenant.id == DropFolder.tenant_id, Tenant.disabled_at.is_not(None))


def _deliverable(now: float, lease_seconds: float) -> list[Any]:
    """Conditions (with Batch outer-joined) for a drop object whose results are due to go out."""
    return [
        DropObject.delivered_at.is_(None),
        or_(DropObject.batch_id.is_(None), Batch.status.in_(BatchStatus.FINAL)),
        or_(DropObject.next_delivery_at.is_(None), DropObject.next_delivery_at <= now),
        DELIVERY_LEASE.free(now, lease_seconds),
    ]


# -- scan: new inbox files become batches -------------------------------------------------------


@dataclass
class ScanReport:
    created: list[str] = field(default_factory=list)  # batch ids
    refused: list[str] = field(default_factory=list)  # inbox keys refused before a batch
    failed: str | None = None  # why the scan stopped (the bucket could not be reached, ...)
    skipped: list[str] = field(default_factory=list)  # inbox keys that could not be read this time


def scan_folder(rt: Runtime, folder_id: str, now: float) -> ScanReport:
    report = ScanReport()
    claimed = _claim_scan(rt, folder_id, now)
    if claimed is None:
        return report  # removed, backing off, or another scanner holds it
    folder, lease = claimed
    try:
        store = folder_store(folder)
        listing = [Listed(o.key, o.size, o.etag, o.modified) for o in store.list_info(INBOX)]
        for inbox_file in plan_scan(listing, _known_versions(rt, folder, listing)):
            try:
                created = ingest(rt, folder, store, inbox_file)
            except ObjectStoreError as exc:
                # one object the store will not hand over (access denied, ...) must not hold up
                # the rest of the folder: it is tried again next scan, and logged each time
                log.warning(
                    "drop folder %s: %s could not be read, tried again next scan: %s",
                    folder.url,
                    inbox_file.key,
                    describe_error(exc),
                )
                report.skipped.append(inbox_file.key)
                continue
            if created == "refused":
                report.refused.append(inbox_file.key)
            elif created:
                report.created.append(created)
            lease = renew_lease(rt, SCAN_LEASE, folder.id, lease)
    except Exception as exc:
        report.failed = _scan_failed(rt, folder, lease, exc, time.time())
        return report
    _release_scan(rt, folder.id, lease, time.time())
    if report.created or report.refused:
        log.info(
            "drop folder %s: %d new batch(es) %s, %d file(s) refused",
            folder.url,
            len(report.created),
            report.created,
            len(report.refused),
        )
    return report


def ingest(rt: Runtime, folder: FolderConfig, store: ObjectStore, f: InboxFile) -> str | None:
    """Make one inbox file a batch (returns its id), or record why it cannot be one ("refused");
    None if another scanner recorded it first or the object changed since it was listed."""
    source = full_key(folder.prefix, f.key)
    source_url = f"s3://{folder.bucket}/{source}"
    digest = hashlib.sha256(f"{folder.bucket}\0{source}\0{f.etag}".encode()).hexdigest()[:32]
    record: StoredFile | None = None
    refused: list[dict[str, Any]] = []
    try:
        if f.size == 0:
            raise InvalidInput("empty_file", "the file is empty")
        sidecar = parse_sidecar(_read_small(store, f.sidecar)) if f.sidecar else None
        wanted = file_request(folder.model, folder.window, sidecar, source_url, f.etag)
        parquet = is_parquet_key(f.key)
        metadata = dict(wanted.metadata)
        if parquet and wanted.model:  # rows cannot be rewritten on the way: a batch-level default
            metadata[f"{DEFAULT_PREFIX}model"] = wanted.model
        request = intake.check_request(
            rt,
            {
                "input_file_id": "-",  # known once the copy is stored, below
                "endpoint": folder.endpoint,
                "completion_window": wanted.window,
                "metadata": metadata,
            },
        )
        suffix = "parquet" if parquet else "jsonl"
        with rt.db.write() as s:  # the quotas before the copy: a tenant over them stores nothing
            check_incoming(s, rt.settings, folder.tenant_id, f.size)
        with store.open_version(f.key, f.etag) as raw:
            record = intake.store_file(
                rt,
                folder.tenant_id,
                "batch",
                f"{f.name}.{suffix}",
                raw if parquet else request_stream(raw, f.gzip, wanted.model, rt.settings.max_line_bytes),
                key=f"dropfolders/{folder.id}/{digest}.{suffix}",
                limit=rt.settings.max_upload_bytes,  # streamed in bounded memory, as /v1/uploads' parts
            )
    except (ObjectChanged, ObjectNotFound):
        return None  # replaced or removed since the listing: the next scan sees what is there
    except SidecarError as exc:
        refused.append(refusal("invalid_sidecar", str(exc), "sidecar"))
    except InvalidInput as exc:
        refused.append(refusal(exc.code, exc.message))
    except ServiceError as exc:
        refused.append(refusal(exc.code or exc.kind, exc.message, exc.param))

    now = time.time()
    if record is not None:
        try:  # a quota (open batches, queued requests, checked again) refuses the file like a bad one
            return _create(rt, folder, f, source, request, record, now)
        except ServiceError as exc:
            refused.append(refusal(exc.code or exc.kind, exc.message, exc.param))
    with rt.db.write() as s:
        if not record_object(s, folder, f, source, None, refused or None, now):
            return None  # another scanner recorded this version first
    log.warning("drop folder %s: %s refused: %s", folder.url, source, refused[0]["message"])
    return "refused"


def _create(
    rt: Runtime,
    folder: FolderConfig,
    f: InboxFile,
    source: str,
    request: intake.BatchRequest,
    record: StoredFile,
    now: float,
) -> str | None:
    """The batch of an inbox file stored as ``record``, claimed with its drop object."""
    batch = intake.create_batch(
        rt,
        folder.tenant_id,
        request,
        new_file=record,
        record=lambda s, batch: record_object(s, folder, f, source, batch.id, None, now),
    )
    if batch is None:
        return None  # another scanner made this version a batch first
    return batch.id


def record_object(
    s: Session,
    folder: FolderConfig,
    f: InboxFile,
    source: str,
    batch_id: str | None,
    errors: list[dict[str, Any]] | None,
    now: float,
) -> bool:
    """Insert-or-nothing of the object version's row; False if some transaction has it already
    (on PostgreSQL a concurrent insert waits for the other transaction to commit or roll back)."""
    if s.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
    statement = (
        insert(DropObject)
        .values(
            folder_id=folder.id,
            bucket=folder.bucket,
            key=source,
            etag=f.etag,
            size=f.size,
            batch_id=batch_id,
            errors=errors,
            created_at=now,
            delivery_attempts=0,
        )
        .on_conflict_do_nothing(index_elements=["bucket", "key", "etag"])
        .returning(DropObject.id)
    )
    return s.execute(statement).scalar() is not None  # no row: the other transaction had it


def _known_versions(rt: Runtime, folder: FolderConfig, listing: list[Listed]) -> set[tuple[str, str]]:
    """(folder-relative key, ETag) of the listed inbox files that already have a row."""
    strip = len(folder.prefix) + 1 if folder.prefix else 0
    keys = [full_key(folder.prefix, o.key) for o in listing if inbox_name(o.key)]
    known: set[tuple[str, str]] = set()
    with rt.db.read() as s:
        for i in range(0, len(keys), KNOWN_CHUNK):
            rows = s.execute(
                select(DropObject.key, DropObject.etag).where(
                    DropObject.bucket == folder.bucket, DropObject.key.in_(keys[i : i + KNOWN_CHUNK])
                )
            )
            known.update((key[strip:], etag) for key, etag in rows)
    return known


def _read_small(store: ObjectStore, key: str) -> bytes:
    info = store.stat(key)
    if info.size > MAX_SIDECAR_BYTES:
        raise SidecarError(f"the sidecar is larger than {MAX_SIDECAR_BYTES} bytes")
    with store.open_version(key, info.etag) as stream:
        return stream.read(MAX_SIDECAR_BYTES + 1)


# -- leases, backoff and small updates ----------------------------------------------------------


def _claim_scan(rt: Runtime, folder_id: str, now: float) -> tuple[FolderConfig, float] | None:
    with rt.db.write() as s:
        claimed = SCAN_LEASE.take(
            s,
            folder_id,
            now,
            DropFolder.removed_at.is_(None),
            _tenant_enabled(),
            or_(DropFolder.next_scan_at.is_(None), DropFolder.next_scan_at <= now),
            now=now,
            lease_seconds=rt.settings.lease_seconds,
        )
        if not claimed:
            return None
        return FolderConfig.of(s.get(DropFolder, folder_id), rt.secrets), now  # type: ignore[arg-type]


def renew_lease(rt: Runtime, keeper: LeaseKeeper, row_id: object, lease: float) -> float:
    """Extend a time lease this process holds (the lease value is its token); the new token."""
    renewed = time.time()
    if renewal_due(lease, renewed, rt.settings.lease_seconds):
        with rt.db.write() as s:
            keeper.renew(s, row_id, lease, renewed)
        return renewed
    return lease


def _release_scan(rt: Runtime, folder_id: str, lease: float, now: float) -> None:
    with rt.db.write() as s:
        SCAN_LEASE.release(
            s,
            folder_id,
            lease,
            next_scan_at=None,
            last_scan_at=now,
            scan_failures=0,
            last_error=None,
        )


def _scan_failed(rt: Runtime, folder: FolderConfig, lease: float, exc: Exception, now: float) -> str:
    failures = folder.scan_failures + 1
    pause = backoff_seconds(
        failures, rt.settings.dropfolder_poll_seconds, rt.settings.dropfolder_max_backoff_seconds
    )
    message = describe_error(exc)
    log.warning(
        "drop folder %s: scan failed (%s); attempt %d, retrying in %.0fs",
        folder.url,
        message,
        failures,
        pause,
        exc_info=not isinstance(exc, ObjectStoreError | OSError),
    )
    with rt.db.write() as s:
        SCAN_LEASE.release(
            s,
            folder.id,
            lease,
            next_scan_at=now + pause,
            scan_failures=failures,
            last_error=message,
        )
    return message


def describe_error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"[:1000]
