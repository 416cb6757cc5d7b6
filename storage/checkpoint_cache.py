"""Checkpoints kept in S3 are downloaded once per machine into a local cache and loaded from there.

A download goes to a temporary folder beside its final place and is renamed into place whole, so
a half-downloaded checkpoint is never loaded; a file lock makes the engine workers of one machine
download each checkpoint once between them.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from storage.objectstore import s3_client


class CheckpointError(Exception):
    """A checkpoint that cannot be found or fetched; the message names the source."""


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> ("bucket", "a/b/"): the prefix always ends with "/" (or is empty)."""
    rest = uri.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise CheckpointError(f"{uri!r} names no bucket (expected s3://bucket/prefix)")
    prefix = prefix.strip("/")
    return bucket, prefix + "/" if prefix else ""


def cache_path(cache_root: Path, uri: str) -> Path:
    bucket, prefix = split_s3(uri)
    digest = hashlib.sha256(uri.encode()).hexdigest()[:12]
    leaf = (prefix.rstrip("/").rsplit("/", 1)[-1] or bucket)[:64]
    return cache_root / f"{leaf}-{digest}"


def local_checkpoint(source: str, cache_root: Path, client_factory: Callable[[], Any] | None = None) -> Path:
    """The local directory of a checkpoint: the source itself, or its S3 download in the cache."""
    if not source.startswith("s3://"):
        path = Path(source)
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{source}: not a checkpoint directory (no config.json)")
        return path
    target = cache_path(cache_root, source)
    if (target / "config.json").is_file():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    with (cache_root / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be downloading the same checkpoint
        if (target / "config.json").is_file():
            return target
        _download(source, target, (client_factory or s3_client)())
    return target


def staged_path(staging: Path, relative: str) -> Path | None:
    """Where the object named ``relative`` (its key less the prefix) goes under ``staging``, or
    None if that name could land anywhere else. Keys are untrusted names: ``prefix//etc/cron.d/x``
    leaves ``/etc/cron.d/x``, which ``staging / relative`` takes as an absolute path. So every
    segment must be a plain name (no empty, ``.`` or ``..`` segment, no NUL), and the resolved
    path (symlinks followed) must still be inside the resolved staging folder."""
    segments = relative.split("/")
    if any(s in ("", ".", "..") or "\0" in s for s in segments):
        return None
    root = staging.resolve()
    dest = root.joinpath(*segments).resolve()
    return dest if dest.is_relative_to(root) and dest != root else None


def _download(source: str, target: Path, client: Any) -> None:
    bucket, prefix = split_s3(source)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        count = 0
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                relative = obj["Key"][len(prefix) :]
                if not relative or relative.endswith("/"):
                    continue  # the prefix itself or a folder marker: nothing to write
                dest = staged_path(staging, relative)
                if dest is None:
                    raise CheckpointError(
                        f"{source}: refusing object {obj['Key']!r}: its name is not a plain relative path"
                    )
                dest.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, obj["Key"], str(dest))
                count += 1
        if not (staging / "config.json").is_file():
            raise CheckpointError(
                f"{source}: no config.json under that prefix ({count} objects): not a checkpoint"
            )
        staging.rename(target)
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{source}: download failed: {exc}") from exc


def publish(local: Path, object_store_url: str, store: Any) -> str:
    """Where workers on any machine can load a checkpoint made here: with an S3 object store, a copy
    under its ``checkpoints/`` prefix (returns that s3:// URI); with a local one, the directory."""
    if not object_store_url.startswith("s3://"):
        return str(local)
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        with file.open("rb") as f:
            store.put_stream(f"checkpoints/{local.name}/{file.relative_to(local).as_posix()}", f)
    return f"{object_store_url.rstrip('/')}/checkpoints/{local.name}"
