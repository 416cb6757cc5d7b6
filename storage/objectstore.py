"""One object-store interface with two implementations: a local directory and S3 (boto3).

Every write is all-or-nothing: a reader sees the whole object or none of it (local: write to a
temporary name, then rename; S3: one PUT, or a multipart upload completed only after its last part
and aborted on failure). Reads and writes stream in chunks, so objects of any size pass through
bounded memory. Given a `RetryPolicy`, the S3 store retries each call through a brief outage
(``storage.objectstore_retry``); a part is kept until it is stored, so a retry re-sends only it.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol
from urllib.parse import urlparse

from storage.objectstore_retry import Retrier, RetryPolicy
from storage.private_files import make_private_dir, open_private

CHUNK = 1024 * 1024  # bytes per streamed read
Observer = Callable[[bytes], None]


class ObjectStoreError(RuntimeError):
    """The store could not be reached or refused an operation."""


class ObjectNotFound(ObjectStoreError):
    pass


class ObjectChanged(ObjectStoreError):
    """The object no longer has the version (ETag) the caller asked for."""


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its key (relative to the store's root), size, version tag and mtime."""

    key: str
    size: int
    etag: str  # S3: the ETag without quotes; local: mtime and size
    modified: float  # epoch seconds


class ObjectStore(Protocol):
    url: str

    def put_stream(self, key: str, stream: IO[bytes]) -> int:
        """Store everything read from ``stream`` under ``key``; returns the byte count."""

    def put_chunks(self, key: str, chunks: Iterable[bytes]) -> int: ...

    def open(self, key: str) -> IO[bytes]:
        """A readable binary stream of the object (close it when done)."""

    def open_from(self, key: str, start: int) -> IO[bytes]:
        """``open`` from byte ``start`` on (less than the size): a chunk of a large input is read
        without reading what comes before it."""

    def size(self, key: str) -> int: ...

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def list(self, prefix: str) -> Iterator[str]: ...

    def list_info(self, prefix: str) -> Iterator[ObjectInfo]:
        """Like ``list``, with each object's size, ETag and modification time."""

    def stat(self, key: str) -> ObjectInfo: ...

    def open_version(self, key: str, etag: str) -> IO[bytes]:
        """``open``, or ObjectChanged if the object's ETag is no longer ``etag``."""

    def copy(self, source: str, target: str) -> None:
        """Server-side copy inside the store (multipart for large S3 objects)."""

    def compose(self, sources: Sequence[str], target: str, observe: Observer | None = None) -> int:
        """Store the objects ``sources`` end to end under ``target`` (all-or-nothing, as every
        write); returns the byte count. ``observe`` sees every byte in order (a digest), so given
        one the bytes stream through this process; without, S3 joins them server-side."""


def check_key(key: str) -> str:
    """Keys are made by Freight, never by users; refuse anything that could climb out of the root."""
    parts = key.split("/")
    if not key or key.startswith("/") or "\x00" in key or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid object key {key!r}")
    return key


class ChunkReader(io.RawIOBase):
    """A file-like view of an iterator of byte chunks, for APIs that want ``read()``."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            try:
                self._pending = next(self._chunks)
            except StopIteration:
                return 0
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


class DerivedOperations:
    """The operations every store derives the same way from its own ``put_stream``, ``stat`` and
    ``list_info`` (a store may do them better itself, as the local one does)."""

    def put_stream(self, key: str, stream: IO[bytes]) -> int:
        raise NotImplementedError

    def stat(self, key: str) -> ObjectInfo:
        raise NotImplementedError

    def list_info(self, prefix: str) -> Iterator[ObjectInfo]:
        raise NotImplementedError

    def put_chunks(self, key: str, chunks: Iterable[bytes]) -> int:
        return self.put_stream(key, io.BufferedReader(ChunkReader(chunks), CHUNK))

    def size(self, key: str) -> int:
        return self.stat(key).size

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True

    def list(self, prefix: str) -> Iterator[str]:
        for info in self.list_info(prefix):
            yield info.key

    def open(self, key: str) -> IO[bytes]:
        raise NotImplementedError

    def compose(self, sources: Sequence[str], target: str, observe: Observer | None = None) -> int:
        return self.put_stream(target, _Joined(self, sources, observe))  # type: ignore[arg-type]


class _Joined:
    """``read()`` over several objects end to end, one open at a time, each chunk shown to
    ``observe``: a composition streamed through bounded memory."""

    def __init__(self, store: DerivedOperations, keys: Sequence[str], observe: Observer | None) -> None:
        self._store = store
        self._keys = list(keys)
        self._observe = observe
        self._current: IO[bytes] | None = None

    def read(self, size: int = -1) -> bytes:
        want = CHUNK if size is None or size < 0 else size
        while True:
            if self._current is None:
                if not self._keys:
                    return b""
                self._current = self._store.open(self._keys.pop(0))
            data = self._current.read(want)
            if data:
                if self._observe is not None:
                    self._observe(data)
                return data
            self._current.close()
            self._current = None


class LocalObjectStore(DerivedOperations):
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put_stream(self, key: str, stream: IO[bytes]) -> int:
        path = self._path(key)
        make_private_dir(path.parent)  # tenants' data: folders 0700, files 0600
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.part")
        total = 0
        try:
            with os.fdopen(open_private(tmp), "wb") as out:
                while chunk := stream.read(CHUNK):
                    out.write(chunk)
                    total += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return total

    def open(self, key: str) -> IO[bytes]:
        try:
            return open(self._path(key), "rb")
        except FileNotFoundError as exc:
            raise ObjectNotFound(key) from exc

    def open_from(self, key: str, start: int) -> IO[bytes]:
        stream = self.open(key)
        stream.seek(start)
        return stream

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError as exc:
            raise ObjectNotFound(key) from exc

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def list(self, prefix: str) -> Iterator[str]:
        # walk only the folder the prefix names, not the whole store
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        folder = self.root / check_key(head) if head else self.root
        if not folder.is_dir():
            return
        for path in sorted(folder.rglob("*")):
            if path.is_file() and not path.name.startswith("."):
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    yield key

    def list_info(self, prefix: str) -> Iterator[ObjectInfo]:
        for key in self.list(prefix):
            try:
                yield self.stat(key)
            except ObjectNotFound:
                continue  # deleted while listing

    def stat(self, key: str) -> ObjectInfo:
        try:
            st = self._path(key).stat()
        except FileNotFoundError as exc:
            raise ObjectNotFound(key) from exc
        return ObjectInfo(key, st.st_size, f"{st.st_mtime_ns:x}-{st.st_size:x}", st.st_mtime)

    def open_version(self, key: str, etag: str) -> IO[bytes]:
        stream = self.open(key)
        st = os.fstat(stream.fileno())
        if f"{st.st_mtime_ns:x}-{st.st_size:x}" != etag:
            stream.close()
            raise ObjectChanged(f"{key} changed: it is no longer version {etag}")
        return stream

    def copy(self, source: str, target: str) -> None:
        with self.open(source) as stream:
            self.put_stream(target, stream)


# what S3 answers for a key that is not there: GET says NoSuchKey, HEAD (no body) a bare 404
NOT_FOUND_CODES = ("NoSuchKey", "404", "NotFound")


@contextlib.contextmanager
def s3_errors(what: str, missing: str | None = None) -> Iterator[None]:
    """The one translation of boto's errors into the store's: ``ObjectNotFound(missing)`` when S3
    says the key ``missing`` is not there, otherwise an ``ObjectStoreError`` saying ``what`` failed."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as exc:
        if missing is not None and exc.response.get("Error", {}).get("Code") in NOT_FOUND_CODES:
            raise ObjectNotFound(missing) from exc
        raise ObjectStoreError(f"{what} failed: {exc}") from exc
    except BotoCoreError as exc:
        raise ObjectStoreError(f"{what} failed: {exc}") from exc


class S3ObjectStore(DerivedOperations):
    """``s3://bucket/prefix``; endpoint and credentials from boto3's chain unless given."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        client=None,
        *,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        max_attempts: int = 8,
        connect_timeout: float = 60,
        retry: RetryPolicy | Retrier | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.retrier = Retrier(retry) if isinstance(retry, RetryPolicy) else retry
        self._client = client or s3_client(
            endpoint_url,
            region=region,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            # with a policy, the retrier alone retries: its deadline bounds the whole call
            max_attempts=1 if self.retrier else max_attempts,
            connect_timeout=connect_timeout,
        )

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn):
        return self.retrier.call(what, fn) if self.retrier else fn()

    def put_stream(self, key: str, stream: IO[bytes]) -> int:
        target = self._key(key)
        with s3_errors(f"upload of {key} to {self.url}"), PartBuffer() as part:
            if part.fill(stream) < PART_SIZE:  # small: one PUT, atomic by itself
                first = part.getvalue()
                self._call(
                    f"put {key}", lambda: self._client.put_object(Bucket=self.bucket, Key=target, Body=first)
                )
                return len(first)
            return self._multipart(key, target, part, stream)

    def _multipart(self, key: str, target: str, part: PartBuffer, stream: IO[bytes]) -> int:
        """Upload part by part; the object appears under its key only when the upload completes,
        so no reader ever sees a partial object, and a failed upload is aborted (never published).
        ``part`` holds the first part; each next one is read into it once the last is stored."""
        upload_id = self._call(
            f"start upload of {key}",
            lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=target)["UploadId"],
        )
        parts: list[dict] = []
        total = 0
        try:
            while part.length:
                number = len(parts) + 1
                etag = self._call(
                    f"part {number} of {key}",
                    lambda n=number: self._client.upload_part(
                        Bucket=self.bucket, Key=target, UploadId=upload_id, PartNumber=n, Body=part.rewound()
                    )["ETag"],
                )
                parts.append({"ETag": etag, "PartNumber": number})
                total += part.length
                part.fill(stream)
            self._call(
                f"complete upload of {key}",
                lambda: self._client.complete_multipart_upload(
                    Bucket=self.bucket, Key=target, UploadId=upload_id, MultipartUpload={"Parts": parts}
                ),
            )
        except BaseException:
            with contextlib.suppress(Exception):  # else the store's lifecycle rules reap it
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=target, UploadId=upload_id)
            raise
        return total

    def open(self, key: str) -> IO[bytes]:
        return self._get(key)

    def open_from(self, key: str, start: int) -> IO[bytes]:
        return self._get(key, f"bytes={start}-") if start else self._get(key)

    def _get(self, key: str, byte_range: str = "") -> IO[bytes]:
        ranged = {"Range": byte_range} if byte_range else {}
        with s3_errors(f"get of {key} in {self.url}", missing=key):
            target = self._key(key)
            response = self._call(
                f"get {key}", lambda: self._client.get_object(Bucket=self.bucket, Key=target, **ranged)
            )
        return response["Body"]

    def delete(self, key: str) -> None:
        with s3_errors(f"delete of {key} in {self.url}"):
            target = self._key(key)
            self._call(f"delete {key}", lambda: self._client.delete_object(Bucket=self.bucket, Key=target))

    def list_info(self, prefix: str) -> Iterator[ObjectInfo]:
        if prefix:
            check_key(prefix.rstrip("/"))
        base = self.prefix + "/" if self.prefix else ""
        strip = len(base)
        with s3_errors(f"listing {self.url}/{prefix}"):
            request = {"Bucket": self.bucket, "Prefix": base + prefix}
            while True:
                page = self._call(f"list {prefix}", lambda r=dict(request): self._client.list_objects_v2(**r))
                for item in page.get("Contents", []):
                    yield ObjectInfo(
                        item["Key"][strip:],
                        int(item["Size"]),
                        item["ETag"].strip('"'),
                        item["LastModified"].timestamp(),
                    )
                if not page.get("IsTruncated"):
                    break
                request["ContinuationToken"] = page["NextContinuationToken"]

    def stat(self, key: str) -> ObjectInfo:
        with s3_errors(f"head of {key} in {self.url}", missing=key):
            target = self._key(key)
            head = self._call(f"head {key}", lambda: self._client.head_object(Bucket=self.bucket, Key=target))
        return ObjectInfo(
            key, int(head["ContentLength"]), head["ETag"].strip('"'), head["LastModified"].timestamp()
        )

    def open_version(self, key: str, etag: str) -> IO[bytes]:
        with s3_errors(f"get of {key} in {self.url}", missing=key):
            target = self._key(key)
            response = self._call(
                f"get {key}", lambda: self._client.get_object(Bucket=self.bucket, Key=target)
            )
        if response["ETag"].strip('"') != etag:
            response["Body"].close()
            raise ObjectChanged(f"{key} changed: it is no longer version {etag}")
        return _GuardedReader(response["Body"], f"{self.url}/{key}")  # type: ignore[return-value]

    def copy(self, source: str, target: str) -> None:
        src = {"Bucket": self.bucket, "Key": self._key(source)}
        with s3_errors(f"copy of {source} to {target} in {self.url}", missing=source):
            dest = self._key(target)
            if self.stat(source).size < COPY_PART_LIMIT:
                self._call(
                    f"copy {source}",
                    lambda: self._client.copy_object(CopySource=src, Bucket=self.bucket, Key=dest),
                )
            else:  # CopyObject stops at 5 GiB: the managed copy does it part by part
                self._call(f"copy {source}", lambda: self._client.copy(src, self.bucket, dest))

    def compose(self, sources: Sequence[str], target: str, observe: Observer | None = None) -> int:
        sizes = [self.stat(key).size for key in sources] if observe is None else []
        # UploadPartCopy: every part but the last at least S3's minimum, at most 10,000 parts
        if not sizes or len(sizes) > MAX_PARTS or min(sizes[:-1], default=MIN_PART_SIZE) < MIN_PART_SIZE:
            return super().compose(sources, target, observe)
        return self._join_server_side(sources, target, sum(sizes))

    def _join_server_side(self, sources: Sequence[str], target: str, total: int) -> int:
        """A multipart upload whose parts are copies of the sources, made by the store itself: no
        byte passes through this process. Aborted on failure, so nothing is published half-made."""
        dest = self._key(target)
        with s3_errors(f"composition of {target} in {self.url}"):
            upload_id = self._call(
                f"start composition of {target}",
                lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=dest)["UploadId"],
            )
            try:
                parts = []
                for number, key in enumerate(sources, start=1):
                    source = {"Bucket": self.bucket, "Key": self._key(key)}
                    etag = self._call(
                        f"part {number} of {target}",
                        lambda n=number, src=source: self._client.upload_part_copy(
                            Bucket=self.bucket, Key=dest, UploadId=upload_id, PartNumber=n, CopySource=src
                        )["CopyPartResult"]["ETag"],
                    )
                    parts.append({"ETag": etag, "PartNumber": number})
                self._call(
                    f"complete composition of {target}",
                    lambda: self._client.complete_multipart_upload(
                        Bucket=self.bucket, Key=dest, UploadId=upload_id, MultipartUpload={"Parts": parts}
                    ),
                )
            except BaseException:
                with contextlib.suppress(Exception):
                    self._client.abort_multipart_upload(Bucket=self.bucket, Key=dest, UploadId=upload_id)
                raise
        return total


COPY_PART_LIMIT = 5 * 1024**3  # the largest object one CopyObject call may copy
MIN_PART_SIZE = 5 * 1024 * 1024  # S3's smallest part of a multipart upload but the last
MAX_PARTS = 10_000  # S3's most parts of one multipart upload
PART_SIZE = 8 * 1024 * 1024  # bytes per multipart part (S3's minimum is 5 MiB); one held at a time


class PartBuffer(io.RawIOBase):
    """One multipart part, in an anonymous memory mapping of ``size`` bytes, read as a file.

    Why not bytes: a part read as chunks and joined, then handed to boto3, was held two or three
    times over, in malloc arenas that each server thread keeps (a 2 GiB upload in 64 MiB parts grew
    the API by ~107 MB on S3 against ~14 MB on the local store). Here the stream's chunks are copied
    into the mapping in place, boto3 reads it as a seekable file (its SHA-256, checksum and send
    read it in small blocks and seek back: no whole copy), the next part reuses it, and closing
    it unmaps the pages, so they go back to the system at once.
    """

    def __init__(self, size: int = PART_SIZE) -> None:
        super().__init__()
        self._map = mmap.mmap(-1, size)
        self._view = memoryview(self._map)
        self.length = 0  # bytes of the current part
        self._pos = 0

    def fill(self, stream: IO[bytes]) -> int:
        """The next part: up to ``size`` bytes, fewer only at the end of the stream (raw reads may
        return short); returns its length, 0 at the end."""
        self.length = self._pos = 0
        while self.length < len(self._view):
            data = stream.read(min(len(self._view) - self.length, CHUNK))
            if not data:
                break
            self._view[self.length : self.length + len(data)] = data
            self.length += len(data)
        return self.length

    def getvalue(self) -> bytes:
        return bytes(self._view[: self.length])

    def rewound(self) -> PartBuffer:
        """The part from its start: each attempt of a call (a retry too) sends it whole."""
        self._pos = 0
        return self

    def __len__(self) -> int:  # botocore's Content-Length
        return self.length

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.length}[whence]
        self._pos = max(0, min(self.length, base + offset))
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = self.length if size is None or size < 0 else min(self.length, self._pos + size)
        data = bytes(self._view[self._pos : end])
        self._pos = max(self._pos, end)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._view.release()
            self._map.close()
        super().close()


def s3_client(
    endpoint_url: str | None = None,
    *,
    region: str | None = None,
    access_key_id: str | None = None,
    secret_access_key: str | None = None,
    max_attempts: int = 8,
    connect_timeout: float = 60,
    read_timeout: float = 60,
):
    """A boto3 S3 client: endpoint, region and credentials from boto3's chain unless given.

    Each client gets its own boto3 session: creating clients from the shared default session is
    not thread-safe, and the control worker runs tasks in threads."""
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(
        aws_access_key_id=access_key_id or None,
        aws_secret_access_key=secret_access_key or None,
        region_name=region or None,
    )
    return session.client(
        "s3",
        endpoint_url=endpoint_url or None,
        config=Config(
            retries={"max_attempts": max_attempts, "mode": "standard"},
            s3={"addressing_style": "path"},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        ),
    )


class _GuardedReader(io.RawIOBase):
    """A streaming S3 body whose network errors surface as ObjectStoreError (not OSError)."""

    def __init__(self, body, where: str) -> None:
        self._body = body
        self._where = where

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        from botocore.exceptions import BotoCoreError
        from urllib3.exceptions import HTTPError

        try:
            return self._body.read(None if size is None or size < 0 else size)
        except (BotoCoreError, HTTPError, OSError) as exc:
            raise ObjectStoreError(f"reading {self._where} failed: {exc}") from exc

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._body.close()
        super().close()


def open_object_store(url: str, s3_endpoint_url: str = "", retry: RetryPolicy | None = None) -> ObjectStore:
    """Freight's own store; ``retry`` (S3 only) carries its calls through a brief outage."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return LocalObjectStore(Path(parsed.path))
    if parsed.scheme == "s3":
        return S3ObjectStore(parsed.netloc, parsed.path, endpoint_url=s3_endpoint_url or None, retry=retry)
    raise ValueError(f"object store URL must be file:///path or s3://bucket/prefix, got {url!r}")


def iter_lines(stream: IO[bytes]) -> Iterator[bytes]:
    """Lines of a binary stream (without the ``\n``), holding at most one chunk plus one line."""
    head: list[bytes] = []  # pieces of a line that spans chunks
    while chunk := stream.read(CHUNK):
        parts = chunk.split(b"\n")
        if len(parts) == 1:
            head.append(chunk)
            continue
        head.append(parts[0])
        yield b"".join(head)
        yield from parts[1:-1]
        head = [parts[-1]] if parts[-1] else []
    if head:
        yield b"".join(head)
