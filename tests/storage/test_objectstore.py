"""The object store interface on both implementations: local disk and S3 (a real SeaweedFS)."""

from __future__ import annotations

import io
import uuid

import pytest

from storage.objectstore import (
    CHUNK,
    LocalObjectStore,
    ObjectNotFound,
    ObjectStoreError,
    S3ObjectStore,
    check_key,
    iter_lines,
)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalObjectStore(tmp_path / "objects")
    s3 = request.getfixturevalue("s3_service")
    bucket = f"t-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(bucket)
    return S3ObjectStore(bucket, "freight/prefix", client=s3.client())


def test_put_open_size_delete(store):
    assert store.put_stream("files/t1/a", io.BytesIO(b"hello\nworld\n")) == 12
    assert store.exists("files/t1/a") and store.size("files/t1/a") == 12
    with store.open("files/t1/a") as stream:
        assert stream.read() == b"hello\nworld\n"
    store.delete("files/t1/a")
    assert not store.exists("files/t1/a")
    with pytest.raises(ObjectNotFound):
        store.open("files/t1/a")


def test_large_objects_stream_in_chunks(store):
    # 20 MiB: above boto3's multipart threshold, so S3 takes the multipart path
    chunks = (bytes([i % 251]) * CHUNK for i in range(20))
    assert store.put_chunks("big/object", chunks) == 20 * CHUNK
    total, first = 0, None
    with store.open("big/object") as stream:
        while data := stream.read(CHUNK):
            first = first if first is not None else data[0]
            total += len(data)
    assert total == 20 * CHUNK and first == 0


def test_list_by_prefix(store):
    for key in ("batches/b1/x", "batches/b1/y", "batches/b2/z"):
        store.put_chunks(key, [b"1"])
    assert sorted(store.list("batches/b1/")) == ["batches/b1/x", "batches/b1/y"]


def test_failed_write_publishes_nothing(store):
    store.put_chunks("out/file", [b"old"])

    def broken():
        yield b"partial data"
        raise OSError("disk went away")

    with pytest.raises((OSError, ObjectStoreError)):
        store.put_chunks("out/file", broken())
    with store.open("out/file") as stream:
        assert stream.read() == b"old"  # the previous version stays whole


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "a/./b", "nul\x00key", ".."])
def test_keys_cannot_escape(key):
    with pytest.raises(ValueError):
        check_key(key)


def test_iter_lines_handles_chunk_boundaries():
    data = b"a" * (CHUNK - 1) + b"\n" + b"b" * (CHUNK * 2 + 5) + b"\nc\n\nlast"
    assert [len(x) for x in iter_lines(io.BytesIO(data))] == [CHUNK - 1, CHUNK * 2 + 5, 1, 0, 4]


def test_open_from_reads_the_rest_of_an_object(store):
    store.put_stream("files/t1/r", io.BytesIO(b"0123456789"))
    for start, rest in ((0, b"0123456789"), (3, b"3456789"), (9, b"9")):
        with store.open_from("files/t1/r", start) as stream:
            assert stream.read() == rest
