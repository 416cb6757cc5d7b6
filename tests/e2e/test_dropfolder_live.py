"""S3 drop folders end to end: a real S3 (its own SeaweedFS, with authentication, so the folder's
own credentials are what gets in), the whole stack with a vLLM engine, files dropped with boto3.

A file dropped in the inbox becomes an ordinary batch within seconds; its output, errors and
manifest come back to the outbox and the input moves to archive/ (failed/ for a bad file); gzip
works; the S3 server stopped and restarted mid-run loses nothing and duplicates nothing."""

from __future__ import annotations

import gzip
import io
import json
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import select

from infra import daemons as services
from infra.processes import FREIGHT, REPO
from storage.db import Database
from storage.models import DropObject
from tests.e2e.conftest import LiveStack, wait_final
from tests.factories import OMIT, chat_line, jsonl, parquet_bytes

pytestmark = pytest.mark.stack

CHAT = "/v1/chat/completions"
PREFIX = "jobs"


class Weed:
    """A SeaweedFS server that the test can stop and start again on the same port and data."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.port = services.free_port()
        self.handle = services.start_seaweedfs(run_dir, self.port, auth=True)

    def stop(self) -> None:
        self.handle.stop()

    def start(self) -> None:
        # The old server's connections linger in TIME_WAIT on the port for a minute. weed binds
        # with SO_REUSEADDR (as Go listeners do), so it can listen at once; the start-up check
        # binds without it and would wait that minute out: check the way weed binds.
        with mock.patch.object(services, "_ensure_port_free", _free_for_reuse):
            self.handle = services.start_seaweedfs(self.run_dir, self.port, auth=True)

    def client(self):
        return self.handle.client()


def _free_for_reuse(port: int, what: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((services.HOST, port))  # raises if something is listening there


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Weed]:
    server = Weed(tmp_path_factory.mktemp("weed"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def drops(live: LiveStack, weed: Weed) -> Iterator[tuple[LiveStack, str]]:
    """A drop folder of tenant alpha on the shared live stack (whose FREIGHT_DROPFOLDER_MAX_BACKOFF_
    SECONDS is these tests' 4 s); every folder the tests added is removed after them, so the
    stack's later tests do not poll an S3 server that is gone."""
    bucket = weed.handle.create_bucket(f"drop-{uuid.uuid4().hex[:8]}")
    add_folder(live, weed, f"s3://{bucket}/{PREFIX}")
    try:
        yield live, bucket
    finally:
        listed = _freight(live, "dropfolder", "list", "--json")
        for folder in json.loads(listed.stdout)["data"]:
            _freight(live, "dropfolder", "remove", str(folder["id"]))
        logs = "".join(p.read_text(errors="replace") for p in live.stack.run_dir.glob("*.log"))
        assert weed.handle.secret_key not in logs  # secrets never logged


def _freight(live: LiveStack, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FREIGHT, *argv], cwd=REPO, env=live.stack.env, capture_output=True, text=True,
                          check=True)  # fmt: skip


def add_folder(live: LiveStack, weed: Weed, url: str, *options: str) -> None:
    """``freight dropfolder add`` as an operator runs it, with the folder's own S3 credentials."""
    added = subprocess.run(
        [*FREIGHT, "dropfolder", "add", url, "--tenant", "alpha", "--model", "demo", "--window", "1h",
         "--endpoint-url", weed.handle.endpoint_url, "--region", "us-east-1",
         "--access-key-id", weed.handle.access_key, *options],
        cwd=REPO, env={**live.stack.env, "FREIGHT_DROPFOLDER_SECRET_ACCESS_KEY": weed.handle.secret_key},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert weed.handle.secret_key not in added.stdout + added.stderr


def line(custom_id: str, content: str, **body: Any) -> dict:
    """A chat line without a model unless given (the folder's default fills it)."""
    return chat_line(custom_id, content, **{"model": OMIT, **body})


def put(weed: Weed, bucket: str, key: str, data: bytes, prefix: str = PREFIX) -> str:
    return weed.client().put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=data)["ETag"].strip('"')


def read(weed: Weed, bucket: str, key: str, prefix: str = PREFIX) -> bytes:
    return weed.client().get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()


def keys(weed: Weed, bucket: str, folder: str, prefix: str = PREFIX) -> set[str]:
    listed = weed.client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{folder}/").get("Contents", [])
    return {o["Key"].removeprefix(f"{prefix}/") for o in listed}


def wait_for(check: Callable[[], Any], what: str, timeout: float = 240) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"{what}: not after {timeout}s")


def batches_of(live: LiveStack, bucket: str, key: str, prefix: str = PREFIX) -> list:
    source = f"s3://{bucket}/{prefix}/{key}"
    every = live.client().batches.list(limit=100).data
    return [b for b in every if (b.metadata or {}).get("source_object") == source]


def manifest(weed: Weed, bucket: str, name: str, timeout: float = 240, prefix: str = PREFIX) -> dict:
    key = f"outbox/{name}.manifest.json"
    wait_for(lambda: key in keys(weed, bucket, "outbox", prefix), f"manifest {key}", timeout)
    return json.loads(read(weed, bucket, key, prefix))


def test_a_dropped_file_comes_back_with_results_and_a_manifest(drops, weed):
    live, bucket = drops
    lines = [line(f"q-{i}", f"Question {i}: what is in the document?") for i in range(6)]
    lines.append(line("own-model", "Say hi", model="demo"))  # a line's own model is kept
    lines.append(line("too-long", "word " * 5000))  # longer than the context: this request alone fails
    dropped = time.monotonic()
    etag = put(weed, bucket, "inbox/first.jsonl", jsonl(lines))

    [batch] = wait_for(lambda: batches_of(live, bucket, "inbox/first.jsonl"), "a batch from the file", 30)
    latency = time.monotonic() - dropped
    assert latency < 10, f"picked up after {latency:.1f}s"
    assert batch.metadata == {
        "source_object": f"s3://{bucket}/{PREFIX}/inbox/first.jsonl",
        "source_etag": etag,
    }
    assert batch.completion_window == "1h"  # the folder's window

    m = manifest(weed, bucket, "first")
    batch = wait_final(live.client(), batch.id)
    assert batch.status == m["status"] == "completed"
    output = [json.loads(x) for x in read(weed, bucket, "outbox/first.output.jsonl").splitlines()]
    errors = [json.loads(x) for x in read(weed, bucket, "outbox/first.errors.jsonl").splitlines()]
    assert sorted(x["custom_id"] for x in output) == sorted([f"q-{i}" for i in range(6)] + ["own-model"])
    assert [x["custom_id"] for x in errors] == ["too-long"]
    assert all(x["response"]["body"]["model"] == "demo" for x in output)

    assert m["batch_id"] == batch.id and m["model"] == "demo"
    assert m["request_counts"] == {"total": 8, "completed": 7, "failed": 1}
    assert m["usage"]["input_tokens"] == batch.usage.input_tokens > 0
    assert m["usage"]["cached_tokens"] == batch.usage.input_tokens_details.cached_tokens
    assert m["usage"]["output_tokens"] == batch.usage.output_tokens > 0
    assert m["cost"] == batch.model_extra["x_freight"]["cost"] and m["cost"]["total"] > 0
    assert m["deadline"] == batch.expires_at and m["sla_met"] is True
    assert m["source"]["etag"] == etag and m["errors"] == []
    assert m["results"]["input"] == f"s3://{bucket}/{PREFIX}/archive/first.jsonl"
    wait_for(lambda: "archive/first.jsonl" in keys(weed, bucket, "archive"), "the input archived", 30)
    assert read(weed, bucket, "archive/first.jsonl") == jsonl(lines)
    assert "inbox/first.jsonl" not in keys(weed, bucket, "inbox")
    assert len(batches_of(live, bucket, "inbox/first.jsonl")) == 1


def test_a_malformed_file_lands_in_failed_with_a_readable_manifest(drops, weed):
    live, bucket = drops
    bad = jsonl([line("a", "hello")]) + b'{"custom_id": "b", "method": "POST"\n' + jsonl([line("a", "again")])
    put(weed, bucket, "inbox/bad.jsonl", bad)
    m = manifest(weed, bucket, "bad")
    assert m["status"] == "failed" and m["batch_id"]
    assert {(e["code"], e["line"]) for e in m["errors"]} == {
        ("invalid_json_line", 2),
        ("duplicate_custom_id", 3),
    }
    assert all(e["message"] for e in m["errors"])
    assert m["results"] == {
        "output": None,
        "errors": None,
        "input": f"s3://{bucket}/{PREFIX}/failed/bad.jsonl",
    }
    wait_for(lambda: "failed/bad.jsonl" in keys(weed, bucket, "failed"), "the input moved to failed/", 30)
    assert not {"outbox/bad.output.jsonl", "outbox/bad.errors.jsonl"} & keys(weed, bucket, "outbox")
    [batch] = batches_of(live, bucket, "inbox/bad.jsonl")
    assert batch.status == "failed"  # an ordinary batch, visible through the API

    put(weed, bucket, "inbox/zip.jsonl.gz", b"\x1f\x8b this is not really gzip")
    m = manifest(weed, bucket, "zip")
    assert m["status"] == "failed" and m["batch_id"] is None and m["errors"][0]["code"] == "invalid_gzip"
    wait_for(lambda: "failed/zip.jsonl.gz" in keys(weed, bucket, "failed"), "the refused input moved", 30)


def test_a_gzip_file_works(drops, weed):
    live, bucket = drops
    lines = [line(f"g-{i}", f"Zipped question {i}") for i in range(5)]
    put(weed, bucket, "inbox/zipped.jsonl.gz", gzip.compress(jsonl(lines)))
    m = manifest(weed, bucket, "zipped")
    assert m["status"] == "completed" and m["request_counts"]["completed"] == 5
    output = read(weed, bucket, "outbox/zipped.output.jsonl").splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in output) == [f"g-{i}" for i in range(5)]
    wait_for(
        lambda: "archive/zipped.jsonl.gz" in keys(weed, bucket, "archive"), "the gzip input archived", 30
    )
    [batch] = batches_of(live, bucket, "inbox/zipped.jsonl.gz")
    stored = live.client().files.content(batch.input_file_id).text.splitlines()  # gunzipped, model filled
    assert [json.loads(x)["custom_id"] for x in stored] == [x["custom_id"] for x in lines]
    assert {json.loads(x)["body"]["model"] for x in stored} == {"demo"}


def test_a_parquet_file_comes_back_as_parquet(drops, weed):
    """A folder with ``--output-format parquet``: a table dropped in its inbox runs on the folder's
    model (rows carry none) and its results come back as typed Parquet, errors included."""
    live, bucket = drops
    tables = "tables"
    add_folder(live, weed, f"s3://{bucket}/{tables}", "--output-format", "parquet")
    n = 6
    table = pa.table(
        {
            "custom_id": [f"t-{i}" for i in range(n)] + ["too-long"],
            "messages": [[{"role": "user", "content": f"Row {i}: name a colour."}] for i in range(n)]
            + [[{"role": "user", "content": "word " * 5000}]],  # longer than the context
            "max_tokens": [2 + i % 3 for i in range(n)] + [4],
            "ignore_eos": [True] * (n + 1),
        }
    )
    data = parquet_bytes(table)
    etag = put(weed, bucket, "inbox/rows.parquet", data, prefix=tables)

    m = manifest(weed, bucket, "rows", prefix=tables)
    assert m["status"] == "completed" and m["model"] == "demo" and m["source"]["etag"] == etag
    assert m["request_counts"] == {"total": n + 1, "completed": n, "failed": 1}
    assert m["results"]["output"] == f"s3://{bucket}/{tables}/outbox/rows.output.parquet"
    assert m["results"]["errors"] == f"s3://{bucket}/{tables}/outbox/rows.errors.parquet"
    [batch] = batches_of(live, bucket, "inbox/rows.parquet", prefix=tables)
    assert batch.status == "completed" and m["batch_id"] == batch.id

    output = pq.read_table(io.BytesIO(read(weed, bucket, "outbox/rows.output.parquet", tables))).to_pylist()
    assert sorted(r["custom_id"] for r in output) == [f"t-{i}" for i in range(n)]
    for row in output:
        wanted = 2 + int(row["custom_id"].split("-")[1]) % 3
        assert (row["status_code"], row["completion_tokens"], row["finish_reason"]) == (200, wanted, "length")
        assert row["prompt_tokens"] > 0 and json.loads(row["response_body"])["model"] == "demo"
    [error] = pq.read_table(io.BytesIO(read(weed, bucket, "outbox/rows.errors.parquet", tables))).to_pylist()
    assert error["custom_id"] == "too-long" and error["status_code"] != 200 and error["error_message"]
    assert not {"outbox/rows.output.jsonl", "outbox/rows.errors.jsonl"} & keys(weed, bucket, "outbox", tables)
    wait_for(
        lambda: "archive/rows.parquet" in keys(weed, bucket, "archive", tables), "the table archived", 30
    )
    assert read(weed, bucket, "archive/rows.parquet", tables) == data


def test_the_s3_server_stopped_and_restarted_mid_run_loses_nothing(drops, weed):
    live, bucket = drops
    names = ["r1", "r2", "r3"]
    for name in names[:2]:
        put(
            weed,
            bucket,
            f"inbox/{name}.jsonl",
            jsonl([line(f"{name}-{i}", f"{name} question {i}") for i in range(4)]),
        )
    wait_for(lambda: all(batches_of(live, bucket, f"inbox/{n}.jsonl") for n in names[:2]), "two batches", 30)
    put(weed, bucket, "inbox/r3.jsonl", jsonl([line("r3-0", "dropped just before the outage")]))
    weed.stop()  # mid-run: two batches running, a third file perhaps not yet taken in

    for name in names[:2]:
        [b] = batches_of(live, bucket, f"inbox/{name}.jsonl")
        assert wait_final(live.client(), b.id).status == "completed"
    database = Database(live.stack.settings.database_url)
    try:

        def failed_deliveries() -> bool:
            with database.read() as s:
                return bool(s.scalars(select(DropObject).where(DropObject.delivery_attempts > 0)).first())

        wait_for(failed_deliveries, "a delivery tried against the stopped server", 60)
        weed.start()
        put(weed, bucket, "inbox/r4.jsonl", jsonl([line("r4-0", "dropped after the restart")]))
        for name in [*names, "r4"]:
            m = manifest(weed, bucket, name)
            assert m["status"] == "completed", m
            wait_for(
                lambda n=name: f"archive/{n}.jsonl" in keys(weed, bucket, "archive"), f"{name} archived", 60
            )
            assert len(batches_of(live, bucket, f"inbox/{name}.jsonl")) == 1  # nothing processed twice
        assert keys(weed, bucket, "inbox") == set()
        with database.read() as s:
            rows = s.scalars(select(DropObject)).all()
        assert all(r.delivered_at is not None for r in rows)
        versions = [(r.key, r.etag) for r in rows]
        assert len(versions) == len(set(versions))
    finally:
        database.dispose()
