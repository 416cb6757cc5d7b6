"""S3 drop folders, the operator's side: add, list and remove them (the ``freight dropfolder``
commands). Scanning and delivery are ``workers/dropfolders.py``.

Per-folder credentials are optional overrides of boto3's chain; they are stored in the database
and never shown: a listing says ``***`` where a folder has its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import func, select

from scheduler.dropfolder_plan import folder_url, parse_folder_url
from storage.errors import ServiceError
from storage.models import DropFolder, DropObject, Tenant
from storage.registry import served_names
from storage.runtime import Runtime
from workers.intake import endpoint_unserved, model_unfit
from workers.request_bodies import ENDPOINTS

HIDDEN = "***"
BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,254}")


@dataclass(frozen=True)
class FolderView:
    """A drop folder as the CLI shows it: no secret in it."""

    id: str
    url: str
    tenant: str
    endpoint: str
    model: str | None
    window: str
    s3_endpoint_url: str | None
    region: str | None
    credentials: str  # "***" when the folder has its own keys, else "boto3 chain"
    last_scan_at: float | None
    scan_failures: int
    last_error: str | None
    pending: int  # files taken in whose results are not yet delivered


OUTPUT_FORMATS = ("jsonl", "parquet")  # of the outbox's output and error files


def add(
    rt: Runtime,
    url: str,
    tenant: str,
    endpoint: str,
    *,
    now: int,
    model: str | None = None,
    window: str | None = None,
    s3_endpoint_url: str | None = None,
    region: str | None = None,
    access_key_id: str | None = None,
    secret_access_key: str | None = None,
    output_format: str = "jsonl",
) -> FolderView:
    bucket, prefix = _parse_url(url, "url")
    if endpoint not in ENDPOINTS:
        raise ServiceError(
            "invalid_request", f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint"
        )
    window = window or rt.settings.default_window
    if rt.settings.tier(window) is None:
        offered = ", ".join(t.window for t in rt.settings.sla_tiers)
        raise ServiceError("invalid_request", f"window must be one of {offered}", param="window")
    served_models = served_names(rt.db, rt.settings)
    if model is not None and model not in served_models:
        served = ", ".join(sorted(served_models)) or "none (register one with `freight models add`)"
        raise ServiceError(
            "invalid_request", f"model {model!r} is not served here; served: {served}", param="model"
        )
    # a folder's files run on its model, or on the models their lines name: one of the right task
    if model is not None and (unfit := model_unfit(rt, model, endpoint)) is not None:
        raise ServiceError("invalid_request", unfit, param="model")
    if (unserved := endpoint_unserved(rt, endpoint)) is not None:
        raise ServiceError("invalid_request", unserved, param="endpoint")
    if output_format not in OUTPUT_FORMATS:
        raise ServiceError(
            "invalid_request",
            f"output format must be one of {', '.join(OUTPUT_FORMATS)}",
            param="output_format",
        )
    if bool(access_key_id) != bool(secret_access_key):
        raise ServiceError(
            "invalid_request",
            "give both --access-key-id and --secret-access-key, or neither",
            param="access_key_id",
        )
    with rt.db.write() as s:
        owner = s.scalar(select(Tenant).where(Tenant.name == tenant))
        if owner is None:
            raise ServiceError("not_found", f"no tenant named {tenant!r}", param="tenant")
        clash = s.scalar(
            select(DropFolder.id).where(
                DropFolder.bucket == bucket, DropFolder.prefix == prefix, DropFolder.removed_at.is_(None)
            )
        )
        if clash:
            raise ServiceError(
                "conflict", f"{folder_url(bucket, prefix)} is already drop folder {clash}", param="url"
            )
        folder = DropFolder(
            tenant_id=owner.id,
            bucket=bucket,
            prefix=prefix,
            endpoint=endpoint,
            model=model,
            completion_window=window,
            output_format=output_format,
            s3_endpoint_url=s3_endpoint_url or None,
            region=region or None,
            access_key_id=access_key_id or None,
            secret_access_key=rt.secrets.seal(secret_access_key or None),  # sealed with a secrets key
            created_at=now,
            scan_failures=0,
        )
        s.add(folder)
        s.flush()
        return _view(folder, owner.name, 0)


def list_folders(rt: Runtime) -> list[FolderView]:
    with rt.db.read() as s:
        pending = dict(
            s.execute(
                select(DropObject.folder_id, func.count())
                .where(DropObject.delivered_at.is_(None))
                .group_by(DropObject.folder_id)
            ).all()
        )
        rows = s.execute(
            select(DropFolder, Tenant.name)
            .join(Tenant, Tenant.id == DropFolder.tenant_id)
            .where(DropFolder.removed_at.is_(None))
            .order_by(DropFolder.created_at, DropFolder.id)
        ).all()
        return [_view(folder, name, pending.get(folder.id, 0)) for folder, name in rows]


def remove(rt: Runtime, ref: str, now: int) -> str:
    """Stop watching a folder (by id or URL); returns its id. Files already taken in still get
    their results delivered."""
    with rt.db.write() as s:
        query = select(DropFolder).where(DropFolder.removed_at.is_(None))
        if ref.startswith("s3://"):
            bucket, prefix = _parse_url(ref, "folder")
            query = query.where(DropFolder.bucket == bucket, DropFolder.prefix == prefix)
        else:
            query = query.where(DropFolder.id == ref)
        folder = s.scalar(query.with_for_update())
        if folder is None:
            raise ServiceError("not_found", f"no drop folder {ref!r}", param="folder")
        folder.removed_at = now
        return folder.id


def _parse_url(url: str, param: str) -> tuple[str, str]:
    """``parse_folder_url``, also refusing what urlparse would quietly drop or keep (control
    characters, a NUL no database stores) and bucket names S3 cannot have."""
    if any(ord(c) < 32 or ord(c) == 127 for c in url):
        raise ServiceError("invalid_request", "a drop folder URL cannot hold control characters", param=param)
    try:
        bucket, prefix = parse_folder_url(url)
    except ValueError as exc:
        raise ServiceError("invalid_request", str(exc), param=param) from exc
    if not BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ServiceError("invalid_request", f"{bucket[:80]!r} is not an S3 bucket name", param=param)
    return bucket, prefix


def _view(f: DropFolder, tenant: str, pending: int) -> FolderView:
    return FolderView(
        id=f.id,
        url=folder_url(f.bucket, f.prefix),
        tenant=tenant,
        endpoint=f.endpoint,
        model=f.model,
        window=f.completion_window,
        s3_endpoint_url=f.s3_endpoint_url,
        region=f.region,
        credentials=HIDDEN if f.access_key_id or f.secret_access_key else "boto3 chain",
        last_scan_at=f.last_scan_at,
        scan_failures=f.scan_failures or 0,
        last_error=f.last_error,
        pending=pending,
    )
