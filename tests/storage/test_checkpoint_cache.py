"""Checkpoints in S3 (a real SeaweedFS) are downloaded once into the local cache, whole or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.checkpoint_cache import (
    CheckpointError,
    cache_path,
    local_checkpoint,
    publish,
    split_s3,
    staged_path,
)
from storage.objectstore import S3ObjectStore
from tests.conftest import DEMO_MODEL


class CountingClient:
    """A real boto3 client that counts the objects it downloads."""

    def __init__(self, client) -> None:
        self.client = client
        self.downloads = 0

    def get_paginator(self, name: str):
        return self.client.get_paginator(name)

    def download_file(self, bucket: str, key: str, dest: str) -> None:
        self.downloads += 1
        self.client.download_file(bucket, key, dest)


@pytest.fixture
def s3(s3_service):
    bucket = s3_service.create_bucket("checkpoints")
    client = s3_service.client()
    for file in DEMO_MODEL.iterdir():
        if file.is_file():
            client.upload_file(str(file), bucket, f"llama/demo/{file.name}")
    client.put_object(Bucket=bucket, Key="empty/readme.txt", Body=b"no config here")
    return CountingClient(client)


def test_split_s3_uri() -> None:
    assert split_s3("s3://b/a/b/") == ("b", "a/b/")
    assert split_s3("s3://b") == ("b", "")
    with pytest.raises(CheckpointError, match="names no bucket"):
        split_s3("s3:///x")


def test_an_s3_checkpoint_is_downloaded_once(s3: CountingClient, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    local = local_checkpoint("s3://checkpoints/llama/demo", cache, lambda: s3)
    assert local == cache_path(cache, "s3://checkpoints/llama/demo") and local.parent == cache
    files = sorted(p.name for p in DEMO_MODEL.iterdir() if p.is_file())
    assert sorted(p.name for p in local.iterdir()) == files
    assert (local / "model.safetensors").read_bytes() == (DEMO_MODEL / "model.safetensors").read_bytes()
    assert s3.downloads == len(files)
    assert local_checkpoint("s3://checkpoints/llama/demo", cache, lambda: s3) == local
    assert s3.downloads == len(files)  # cached: nothing fetched again


def test_a_prefix_without_a_checkpoint_leaves_nothing_behind(s3: CountingClient, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(CheckpointError, match=r"no config.json under that prefix \(1 objects\)"):
        local_checkpoint("s3://checkpoints/empty", cache, lambda: s3)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_a_local_directory_is_used_in_place(tmp_path: Path) -> None:
    assert local_checkpoint(str(DEMO_MODEL), tmp_path) == DEMO_MODEL
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        local_checkpoint(str(tmp_path), tmp_path)


def test_a_checkpoint_made_here_is_published_to_the_s3_object_store(
    s3: CountingClient, tmp_path: Path
) -> None:
    store = S3ObjectStore("checkpoints", "freight", client=s3.client)
    uri = publish(DEMO_MODEL, "s3://checkpoints/freight", store)
    assert uri == f"s3://checkpoints/freight/checkpoints/{DEMO_MODEL.name}"
    local = local_checkpoint(uri, tmp_path / "cache", lambda: s3)  # what a worker elsewhere does
    assert (local / "model.safetensors").read_bytes() == (DEMO_MODEL / "model.safetensors").read_bytes()
    assert publish(DEMO_MODEL, "file:///var/objects", store) == str(DEMO_MODEL)  # local store: in place


@pytest.mark.parametrize(
    "relative",
    ["/etc/cron.d/x", "a//b", "../x", "a/../../x", "./x", "a/./b", "a/", "x\0y", "..", "."],
)
def test_names_that_are_not_plain_relative_paths_are_refused(relative: str, tmp_path: Path) -> None:
    assert staged_path(tmp_path, relative) is None


def test_plain_names_stay_inside_and_symlinks_out_are_refused(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    (staging / "sub").mkdir(parents=True)
    assert staged_path(staging, "config.json") == staging.resolve() / "config.json"
    assert (
        staged_path(staging, "sub/dir/model.safetensors") == staging.resolve() / "sub/dir/model.safetensors"
    )
    (tmp_path / "elsewhere").mkdir()
    (staging / "link").symlink_to(tmp_path / "elsewhere")
    assert staged_path(staging, "link/x") is None  # resolved, it is outside


class KeepsEmptySegments(CountingClient):
    """The real SeaweedFS behind a listing as AWS S3 gives it: S3 keeps an empty segment (`a//b`)
    in a key, SeaweedFS collapses it to `a/b` when it stores the object. So the hostile key is
    listed as S3 would list it, and its bytes are SeaweedFS's, under the collapsed key."""

    def __init__(self, client, hostile: str) -> None:
        super().__init__(client)
        self.hostile = hostile

    def get_paginator(self, name: str):
        real, hostile = self.client.get_paginator(name), self.hostile

        class Paginator:
            def paginate(self, **kwargs):
                for page in real.paginate(**kwargs):
                    contents = [
                        {**o, "Key": hostile} if o["Key"] == hostile.replace("//", "/") else o
                        for o in page.get("Contents", [])
                    ]
                    yield {**page, "Contents": contents}

        return Paginator()


def test_an_s3_key_climbing_out_of_the_cache_is_refused_and_nothing_lands_outside(
    s3: CountingClient, tmp_path: Path
) -> None:
    """`prefix//<absolute path>`: the key less the prefix is an absolute path, which
    `staging / relative` would have taken as the place to write (issue #19, section 6)."""
    target = tmp_path / "outside" / "cron-job"
    target.parent.mkdir()
    bucket, prefix = "checkpoints", "hostile/demo/"
    for file in DEMO_MODEL.iterdir():
        if file.is_file():
            s3.client.upload_file(str(file), bucket, f"{prefix}{file.name}")
    evil = f"{prefix}{target}"  # hostile/demo//tmp/.../outside/cron-job
    s3.client.put_object(Bucket=bucket, Key=evil, Body=b"* * * * * root sh -c 'owned'\n")
    listed = [o["Key"] for o in s3.client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]
    assert evil not in listed and evil.replace("//", "/") in listed  # SeaweedFS collapsed it
    with pytest.raises(Exception, match="InvalidRequest"):  # and refuses dot segments outright
        s3.client.put_object(Bucket=bucket, Key=f"{prefix}../../x", Body=b"")

    cache = tmp_path / "cache"
    with pytest.raises(CheckpointError, match="refusing object"):
        local_checkpoint(f"s3://{bucket}/hostile/demo", cache, lambda: KeepsEmptySegments(s3.client, evil))
    assert not target.exists()
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []  # no half checkpoint
