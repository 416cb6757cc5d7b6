"""The object store's versioned operations the drop folders use (listing with ETags, reading a given
version, server-side copy), on local disk and on S3 (a real SeaweedFS)."""

from __future__ import annotations

import io
import uuid

import pytest

from infra.daemons import free_port
from storage.objectstore import (
    LocalObjectStore,
    ObjectChanged,
    ObjectNotFound,
    ObjectStoreError,
    S3ObjectStore,
)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalObjectStore(tmp_path / "objects")
    s3 = request.getfixturevalue("s3_service")
    bucket = s3.create_bucket(f"v-{uuid.uuid4().hex[:10]}")
    return S3ObjectStore(
        bucket, "drop/prefix", s3.endpoint_url, region="us-east-1", access_key_id="k", secret_access_key="s"
    )


def test_list_info_stat_and_versions(store):
    store.put_stream("inbox/a.jsonl", io.BytesIO(b"one\n"))
    store.put_stream("inbox/b.jsonl", io.BytesIO(b"two lines\n"))
    store.put_stream("outbox/c.json", io.BytesIO(b"{}"))
    listed = {i.key: i for i in store.list_info("inbox/")}
    assert set(listed) == {"inbox/a.jsonl", "inbox/b.jsonl"}
    assert listed["inbox/b.jsonl"].size == 10 and listed["inbox/a.jsonl"].modified > 0
    a = store.stat("inbox/a.jsonl")
    assert a == listed["inbox/a.jsonl"] or (a.etag, a.size) == (listed["inbox/a.jsonl"].etag, 4)
    with store.open_version("inbox/a.jsonl", a.etag) as stream:
        assert stream.read() == b"one\n"
    store.put_stream("inbox/a.jsonl", io.BytesIO(b"new content\n"))
    assert store.stat("inbox/a.jsonl").etag != a.etag
    with pytest.raises(ObjectChanged):
        store.open_version("inbox/a.jsonl", a.etag)
    with pytest.raises(ObjectNotFound):
        store.stat("inbox/missing.jsonl")
    with pytest.raises(ObjectNotFound):
        store.open_version("inbox/missing.jsonl", "x")


def test_copy_within_the_store(store):
    store.put_stream("inbox/a.jsonl", io.BytesIO(b"payload\n"))
    store.copy("inbox/a.jsonl", "archive/a.jsonl")
    with store.open("archive/a.jsonl") as stream:
        assert stream.read() == b"payload\n"
    assert store.exists("inbox/a.jsonl")
    with pytest.raises(ObjectNotFound):
        store.copy("inbox/missing.jsonl", "archive/missing.jsonl")


def test_an_unreachable_s3_fails_as_an_object_store_error() -> None:
    store = S3ObjectStore(
        "b", "p", f"http://127.0.0.1:{free_port()}", region="us-east-1", access_key_id="k",
        secret_access_key="s", max_attempts=1, connect_timeout=1,
    )  # fmt: skip
    for call in (
        lambda: list(store.list_info("inbox/")),
        lambda: store.stat("inbox/a.jsonl"),
        lambda: store.open_version("inbox/a.jsonl", "e"),
        lambda: store.copy("inbox/a.jsonl", "archive/a.jsonl"),
        lambda: store.delete("inbox/a.jsonl"),
    ):
        with pytest.raises(ObjectStoreError):
            call()
