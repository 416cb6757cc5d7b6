"""``compose``: objects joined end to end under a new key, on local disk and S3 (a real SeaweedFS),
streamed (small parts, or a digest asked for) or, on S3, copied by the store itself."""

from __future__ import annotations

import hashlib
import io
import uuid

import pytest

from storage.objectstore import MIN_PART_SIZE, PART_SIZE, LocalObjectStore, ObjectNotFound, S3ObjectStore


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalObjectStore(tmp_path / "objects")
    s3 = request.getfixturevalue("s3_service")
    bucket = f"c-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(bucket)
    return S3ObjectStore(bucket, "freight/prefix", client=s3.client())


def put_all(store, parts: list[bytes]) -> list[str]:
    keys = [f"uploads/t/u/part{i}" for i in range(len(parts))]
    for key, data in zip(keys, parts, strict=True):
        store.put_stream(key, io.BytesIO(data))
    return keys


def read(store, key: str) -> bytes:
    with store.open(key) as stream:
        return stream.read()


@pytest.mark.parametrize("digest", [False, True])
def test_small_parts_join_in_the_order_given(store, digest):
    parts = [b"first\n", b"second\n", b"", b"third"]
    keys = put_all(store, parts)
    md5 = hashlib.md5()
    order = [keys[2], keys[1], keys[0], keys[3]]
    size = store.compose(order, "files/t/joined", md5.update if digest else None)
    assert size == 18 and read(store, "files/t/joined") == b"second\nfirst\nthird"
    if digest:
        assert md5.hexdigest() == hashlib.md5(b"second\nfirst\nthird").hexdigest()
    assert all(store.exists(k) for k in keys)  # the sources stay: their owner deletes them


@pytest.mark.parametrize("digest", [False, True])
def test_large_parts_join_whole(store, digest):
    """On S3 without a digest these are UploadPartCopy parts (each but the last >= 5 MiB)."""
    parts = [b"a" * MIN_PART_SIZE, b"b" * (MIN_PART_SIZE + 7), b"tail"]
    keys = put_all(store, parts)
    md5 = hashlib.md5()
    size = store.compose([keys[1], keys[0], keys[2]], "files/t/big", md5.update if digest else None)
    expected = parts[1] + parts[0] + parts[2]
    assert size == len(expected)
    assert hashlib.md5(read(store, "files/t/big")).digest() == hashlib.md5(expected).digest()
    if digest:
        assert md5.digest() == hashlib.md5(expected).digest()
    if isinstance(store, S3ObjectStore):  # a multipart object's ETag ends in its part count
        parts_made = 3 if not digest else -(-len(expected) // PART_SIZE)  # the sources, or 8 MiB parts
        assert store.stat("files/t/big").etag.endswith(f"-{parts_made}")


def test_a_missing_source_publishes_nothing(store):
    keys = put_all(store, [b"x" * MIN_PART_SIZE, b"y"])
    with pytest.raises(ObjectNotFound):
        store.compose([keys[0], "uploads/t/u/gone", keys[1]], "files/t/never")
    assert not store.exists("files/t/never")
