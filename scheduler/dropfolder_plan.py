"""S3 drop folders, the decisions: which inbox objects are new, what batch each file asks for, where
its results go, when to retry a bucket, and what its manifest says.

Pure functions over frozen dataclasses; ``workers/dropfolders.py`` does the listing, copying and
database work. Keys here are relative to the folder (``inbox/a.jsonl``) unless named ``full``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from scheduler import json_text

INBOX = "inbox/"
OUTBOX = "outbox/"
ARCHIVE = "archive/"
FAILED = "failed/"
SIDECAR_SUFFIX = ".jsonl.freight.json"
MAX_SIDECAR_BYTES = 64 * 1024
SIDECAR_FIELDS = ("model", "completion_window", "window", "metadata")
SOURCE_KEY = "source_object"  # batch metadata naming the object: s3://bucket/key
ETAG_KEY = "source_etag"
BOM = "\ufeff"


@dataclass(frozen=True)
class Listed:
    """One object of the inbox listing."""

    key: str
    size: int
    etag: str
    modified: float


@dataclass(frozen=True)
class InboxFile:
    """A request file to turn into a batch: ``inbox/NAME.jsonl``, ``.jsonl.gz`` or ``.parquet``."""

    key: str
    name: str
    etag: str
    size: int
    gzip: bool
    sidecar: str | None  # inbox/NAME.jsonl.freight.json when there is one


def parse_folder_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix/`` -> ("bucket", "some/prefix")."""
    parsed = urlparse(url.strip())
    if parsed.scheme != "s3" or not parsed.netloc or parsed.query or parsed.fragment:
        raise ValueError(f"a drop folder is s3://bucket/prefix, got {url!r}")
    prefix = parsed.path.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"the prefix of {url!r} has an empty, '.' or '..' segment")
    return parsed.netloc, prefix


def folder_url(bucket: str, prefix: str) -> str:
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


def full_key(prefix: str, key: str) -> str:
    """The S3 key of a folder-relative key."""
    return f"{prefix}/{key}" if prefix else key


def object_url(bucket: str, prefix: str, key: str) -> str:
    return f"s3://{bucket}/{full_key(prefix, key)}"


def inbox_name(key: str) -> tuple[str, bool] | None:
    """``inbox/a.jsonl`` -> ("a", False); ``inbox/a.jsonl.gz`` -> ("a", True); anything else
    (sidecars, other files, sub-folders, names Freight could not write back) -> None."""
    if not key.startswith(INBOX):
        return None
    base = key[len(INBOX) :]
    if "/" in base or "\x00" in base:
        return None
    for suffix, gz in ((".jsonl.gz", True), (".jsonl", False), (".parquet", False)):
        if base.endswith(suffix):
            name = base[: -len(suffix)]
            return (name, gz) if name and name not in (".", "..") else None
    return None


def sidecar_key(name: str) -> str:
    return f"{INBOX}{name}{SIDECAR_SUFFIX}"


def plan_scan(listing: Iterable[Listed], known: Set[tuple[str, str]]) -> list[InboxFile]:
    """The request files of an inbox listing that are not yet known as (key, ETag), oldest first.

    A re-upload under the same key with new content has a new ETag, so it is new; the same
    version seen again (still in the inbox while its batch runs) is not."""
    objects = list(listing)
    keys = {o.key for o in objects}
    new: list[tuple[float, str, InboxFile]] = []
    for o in objects:
        parsed = inbox_name(o.key)
        if parsed is None or (o.key, o.etag) in known:
            continue
        name, gz = parsed
        side = sidecar_key(name)
        new.append(
            (o.modified, o.key, InboxFile(o.key, name, o.etag, o.size, gz, side if side in keys else None))
        )
    return [f for _, _, f in sorted(new, key=lambda t: (t[0], t[1]))]


@dataclass(frozen=True)
class ResultKeys:
    output: str
    errors: str
    manifest: str


def is_parquet_key(key: str) -> bool:
    """An inbox file in Parquet (stored as it is; the folder's model becomes a batch default)."""
    return key.endswith(".parquet")


def result_keys(name: str, fmt: str = "jsonl") -> ResultKeys:
    return ResultKeys(
        output=f"{OUTBOX}{name}.output.{fmt}",
        errors=f"{OUTBOX}{name}.errors.{fmt}",
        manifest=f"{OUTBOX}{name}.manifest.json",
    )


def moved_key(key: str, failed: bool) -> str:
    """Where an inbox object goes once its batch is final: ``archive/``, or ``failed/`` for a file
    that was refused or failed validation."""
    base = key[len(INBOX) :] if key.startswith(INBOX) else key.rsplit("/", 1)[-1]
    return (FAILED if failed else ARCHIVE) + base


def backoff_seconds(failures: int, base: float, cap: float) -> float:
    """Pause before the next try after ``failures`` consecutive failures: base, 2x, 4x, ... cap."""
    if failures <= 0:
        return 0.0
    return float(min(cap, base * 2 ** min(failures - 1, 30)))


# -- what batch a file asks for ------------------------------------------------------------------


class SidecarError(ValueError):
    """The sidecar ``NAME.jsonl.freight.json`` cannot be used; the file is refused."""


@dataclass(frozen=True)
class Sidecar:
    model: str | None = None
    window: str | None = None
    metadata: tuple[tuple[str, str], ...] = ()


def parse_sidecar(raw: bytes) -> Sidecar:
    if len(raw) > MAX_SIDECAR_BYTES:
        raise SidecarError(f"the sidecar is larger than {MAX_SIDECAR_BYTES} bytes")
    try:
        data = json_text.loads(raw.decode("utf-8-sig"))
    except ValueError as exc:  # UnicodeDecodeError too; depth and digit limits included
        raise SidecarError(f"the sidecar is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SidecarError("the sidecar must be a JSON object")
    unknown = sorted(set(data) - set(SIDECAR_FIELDS))
    if unknown:
        raise SidecarError(
            f"unknown sidecar field(s) {', '.join(unknown)}; allowed: model, completion_window, metadata"
        )
    model = data.get("model")
    window = data.get("completion_window", data.get("window"))
    metadata = data.get("metadata") or {}
    if model is not None and (not isinstance(model, str) or not model):
        raise SidecarError("sidecar model must be a non-empty string")
    if window is not None and not isinstance(window, str):
        raise SidecarError("sidecar completion_window must be a string like 24h")
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SidecarError("sidecar metadata must be an object of string keys and values")
    if SOURCE_KEY in metadata or ETAG_KEY in metadata:
        raise SidecarError(f"sidecar metadata may not set {SOURCE_KEY} or {ETAG_KEY}: Freight sets them")
    return Sidecar(model, window, tuple(metadata.items()))


@dataclass(frozen=True)
class FileRequest:
    """The batch a file becomes: its model for lines without one, window and metadata."""

    model: str | None
    window: str
    metadata: tuple[tuple[str, str], ...]


def file_request(
    folder_model: str | None, folder_window: str, sidecar: Sidecar | None, source_url: str, etag: str
) -> FileRequest:
    """The sidecar overrides the folder; the metadata always names the source object."""
    side = sidecar or Sidecar()
    metadata = (*side.metadata, (SOURCE_KEY, source_url), (ETAG_KEY, etag))
    return FileRequest(side.model or folder_model, side.window or folder_window, metadata)


def fill_model(line: bytes, model: str, first: bool = False) -> bytes:
    """A request line with ``body.model`` set to ``model`` if it has none; any other line as it
    is (its own model wins, and a malformed line is left for validation to report)."""
    try:
        text = line.decode("utf-8")
        obj = json_text.loads(text[1:] if first and text.startswith(BOM) else text)
    except ValueError:  # UnicodeDecodeError, malformed, past the depth or digit limits
        return line
    body = obj.get("body") if isinstance(obj, dict) else None
    if not isinstance(body, dict) or "model" in body:
        return line
    body["model"] = model
    try:
        return json_text.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    except ValueError:
        return line


# -- the manifest -------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchFacts:
    """What the manifest reports of a final batch."""

    id: str
    status: str
    endpoint: str
    model: str | None
    completion_window: str
    created_at: int
    expires_at: int
    finished_at: int | None
    sla_met: bool | None
    total: int
    completed: int
    failed: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    cost: Mapping[str, Any] | None = None  # the API's x_freight.cost
    errors: tuple[Mapping[str, Any], ...] = ()  # validation errors of a failed batch


@dataclass(frozen=True)
class Delivery:
    """Everything needed to deliver one inbox file's results."""

    bucket: str
    prefix: str
    key: str  # folder-relative inbox key
    etag: str
    size: int
    batch: BatchFacts | None  # None: the file was refused before a batch was made
    refused: tuple[Mapping[str, Any], ...] = field(default=())  # why
    output_format: str = "jsonl"  # of the output and error files: jsonl | parquet

    @property
    def name(self) -> str:
        parsed = inbox_name(self.key)
        return parsed[0] if parsed else self.key.rsplit("/", 1)[-1]

    @property
    def failed(self) -> bool:
        return self.batch is None or self.batch.status == "failed"

    @property
    def results(self) -> ResultKeys:
        return result_keys(self.name, self.output_format)

    @property
    def archive(self) -> str:
        return moved_key(self.key, self.failed)

    @property
    def writes_results(self) -> bool:
        """Output and error files go out for every batch that ran (empty ones included)."""
        return not self.failed


def build_manifest(d: Delivery) -> dict[str, Any]:
    b = d.batch
    keys = d.results

    def url(key: str) -> str:
        return object_url(d.bucket, d.prefix, key)

    manifest: dict[str, Any] = {
        "object": "freight.dropfolder.manifest",
        "source": {
            "url": url(d.key),
            "bucket": d.bucket,
            "key": full_key(d.prefix, d.key),
            "etag": d.etag,
            "bytes": d.size,
        },
        "status": "failed" if b is None else b.status,
        "batch_id": None if b is None else b.id,
        "endpoint": None if b is None else b.endpoint,
        "model": None if b is None else b.model,
        "completion_window": None if b is None else b.completion_window,
        "created_at": None if b is None else b.created_at,
        "finished_at": None if b is None else b.finished_at,
        "deadline": None if b is None else b.expires_at,
        "sla_met": None if b is None else b.sla_met,
        "request_counts": {
            "total": 0 if b is None else b.total,
            "completed": 0 if b is None else b.completed,
            "failed": 0 if b is None else b.failed,
        },
        "usage": {
            "input_tokens": 0 if b is None else b.input_tokens,
            "cached_tokens": 0 if b is None else b.cached_tokens,
            "output_tokens": 0 if b is None else b.output_tokens,
            "total_tokens": 0 if b is None else b.input_tokens + b.output_tokens,
        },
        "cost": None if b is None or b.cost is None else dict(b.cost),
        "results": {
            "output": url(keys.output) if d.writes_results else None,
            "errors": url(keys.errors) if d.writes_results else None,
            "input": url(d.archive),
        },
        "errors": [dict(e) for e in (d.refused if b is None else b.errors)],
    }
    return manifest


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, ensure_ascii=False) + "\n").encode()


def refusal(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """A reason a file was refused, in the shape of a batch's validation errors."""
    return {"code": code, "message": message, "param": param, "line": None}
