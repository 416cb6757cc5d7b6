"""The S3 store through a real outage: a SeaweedFS of this module's own, stopped and started again
while a write is in flight. A write retries with jittered exponential backoff and succeeds once the
store is back; a write that outlives its deadline fails; neither ever publishes a partial object."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from storage.objectstore import CHUNK, PART_SIZE, ObjectStoreError
from storage.objectstore_retry import Retrier, RetryPolicy
from tests.conftest import Weed


def _bucket(weed: Weed) -> str:
    return weed.handle.create_bucket(f"o-{uuid.uuid4().hex[:10]}")


def _visible(weed: Weed, bucket: str, key: str) -> bool:
    client = weed.client()
    try:
        client.head_object(Bucket=bucket, Key=f"freight/{key}")
    except client.exceptions.ClientError:
        return False
    return True


def test_pauses_grow_exponentially_with_full_jitter() -> None:
    policy = RetryPolicy(attempts=10, deadline_seconds=60, base_seconds=0.25, cap_seconds=4)
    rng = random.Random(7)
    for retry in range(10):
        bound = min(4, 0.25 * 2**retry)
        pauses = [policy.pause(retry, rng) for _ in range(200)]
        assert all(0 <= p <= bound for p in pauses)
        assert max(pauses) > 0.8 * bound and min(pauses) < 0.2 * bound  # spread over the whole range


@pytest.mark.reliability
def test_a_multipart_write_rides_out_a_store_restart(weed: Weed, reliability) -> None:
    """The store goes away after the first part and comes back ~2 s later (plus its start-up):
    the write retries, completes, and the object is whole; it was never visible before that."""
    bucket = _bucket(weed)
    store = weed.store(bucket, RetryPolicy(attempts=60, deadline_seconds=120, cap_seconds=2))
    blocks = 3 * PART_SIZE // CHUNK  # three parts
    outage: dict[str, float] = {}
    restarted = threading.Event()
    seen_before_complete: list[bool] = []

    def restart_later() -> None:
        time.sleep(2)  # the outage itself; start-up adds its own seconds
        weed.start()
        outage["back"] = time.monotonic()
        restarted.set()

    def chunks() -> Iterator[bytes]:
        for i in range(blocks):
            if i == PART_SIZE // CHUNK:  # part 1 is read: the store goes away
                outage["down"] = time.monotonic()
                weed.stop()
                threading.Thread(target=restart_later, daemon=True).start()
            if i == blocks - 1:  # the last part: the store is back, the upload not completed
                assert restarted.wait(120)
                seen_before_complete.append(_visible(weed, bucket, "results/out.jsonl"))
            yield bytes([i % 251]) * CHUNK

    started = time.monotonic()
    try:
        written = store.put_chunks("results/out.jsonl", chunks())
    finally:
        if not restarted.wait(120):
            weed.start()
    elapsed = time.monotonic() - started
    retries = store.retrier.retries  # type: ignore[union-attr]
    outage_s = outage["back"] - outage["down"]
    reliability.record(
        "object_store_outage_storage", lost=0 if written == blocks * CHUNK else 1, duplicated=0,
        server_errors=0, outage_s=round(outage_s, 1), retries=retries, write_s=round(elapsed, 1),
        partial_files_published=sum(seen_before_complete),
    )  # fmt: skip
    assert written == blocks * CHUNK
    assert seen_before_complete == [False]  # the parts stored so far were not an object
    assert retries >= 1 and elapsed >= outage_s
    with store.open("results/out.jsonl") as stream:
        for i in range(blocks):
            assert stream.read(CHUNK) == bytes([i % 251]) * CHUNK
        assert stream.read(1) == b""


def test_a_write_that_outlives_its_deadline_fails_and_publishes_nothing(weed: Weed) -> None:
    bucket = _bucket(weed)
    store = weed.store(bucket, RetryPolicy(attempts=100, deadline_seconds=3, cap_seconds=1))
    store.put_chunks("out/file", [b"old version\n"])
    weed.stop()
    try:
        started = time.monotonic()
        with pytest.raises(ObjectStoreError):
            store.put_chunks("out/file", [b"new version, never whole\n"])
        elapsed = time.monotonic() - started
    finally:
        weed.start()
    assert store.retrier.retries >= 2  # type: ignore[union-attr]
    assert elapsed < 3 + 2 + 1  # the deadline, one connect timeout, one pause
    with store.open("out/file") as stream:
        assert stream.read() == b"old version\n"  # the previous version stays whole


def test_a_refusal_is_not_retried(weed: Weed) -> None:
    retrier = Retrier(RetryPolicy(attempts=10, deadline_seconds=30))
    store = weed.store(f"missing-{uuid.uuid4().hex[:8]}", retrier)
    started = time.monotonic()
    with pytest.raises(ObjectStoreError, match=r"NoSuchBucket|AccessDenied"):  # 4xx: final
        store.put_chunks("x", [b"data"])
    assert retrier.retries == 0 and time.monotonic() - started < 5
