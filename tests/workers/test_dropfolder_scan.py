"""Drop-folder scanning and delivery against a real database (SQLite and PostgreSQL), a real S3
(SeaweedFS) and a real broker; no engine. Idempotency is the point: racing scans, a crash between
creating the batch and recording the object, rescans, an unreachable bucket."""

from __future__ import annotations

import gzip
import io
import json
import threading
import time
import uuid
from array import array

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select, update

from api.services import dropfolders as folders_service
from api.services.tenants import create_tenant, disable_tenant, enable_tenant
from infra.daemons import free_port
from scheduler.dropfolder_plan import InboxFile
from storage.broker import VALIDATE_QUEUE
from storage.errors import ServiceError
from storage.models import Batch, DropFolder, DropObject, StoredFile, UnitStatus, WorkUnit
from storage.objectstore import CHUNK
from storage.runtime import Runtime
from storage.settings import Settings, SettingsError
from storage.shards import read_rows
from storage.status import BatchStatus
from tests.conftest import now
from tests.factories import OMIT, chat_line, embedding_line, jsonl
from workers import dropfolder_delivery, dropfolder_input, dropfolders, registration
from workers.dispatcher import TickReport, resend_lost_validations
from workers.embeddings import embeddings_body
from workers.finalize import finalize_batch
from workers.registration import AddRequest
from workers.results import encode, success_line
from workers.validation import validate_batch

CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
SECRET = "super-secret-value-42"


def line(custom_id: str, model: str | None = None, **extra: object) -> dict:
    """A chat line without a model unless given (the folder's default fills it)."""
    return {**chat_line(custom_id, f"say {custom_id}", model=model or OMIT, max_tokens=2), **extra}


# -- streaming helpers, no fixtures --------------------------------------------------------------


def test_with_model_streams_lines_and_fills_only_missing_models() -> None:
    data = jsonl([line("a"), line("b", model="own")]) + b"not json\n" + json.dumps(line("c")).encode()
    out = b"".join(dropfolder_input.with_model(io.BytesIO(data), "demo", 1024))
    rows = out.split(b"\n")
    assert json.loads(rows[0])["body"]["model"] == "demo"
    assert json.loads(rows[1])["body"]["model"] == "own"
    assert rows[2] == b"not json"
    assert json.loads(rows[3])["body"]["model"] == "demo"  # last line without a newline
    # a line longer than the line limit passes through untouched, in pieces, and the next is filled
    long_line = json.dumps(line("x" * (3 * CHUNK))).encode()
    out = b"".join(
        dropfolder_input.with_model(io.BytesIO(long_line + b"\n" + jsonl([line("y")])), "demo", 1000)
    )
    first, second, _ = out.split(b"\n")
    assert first == long_line and json.loads(second)["body"]["model"] == "demo"


def test_request_stream_gunzips_and_reports_a_broken_gzip_as_invalid() -> None:
    data = jsonl([line("a", model="demo")])
    assert dropfolder_input.request_stream(io.BytesIO(gzip.compress(data)), True, None, 1024).read() == data
    with pytest.raises(dropfolder_input.InvalidInput) as err:
        dropfolder_input.request_stream(io.BytesIO(b"this is not gzip"), True, None, 1024).read()
    assert err.value.code == "invalid_gzip"
    with pytest.raises(dropfolder_input.InvalidInput):
        dropfolder_input.request_stream(io.BytesIO(gzip.compress(data)[:-12]), True, None, 1024).read()


def test_settings_poll_period_and_backoff_cap() -> None:
    s = Settings.from_env(
        {"FREIGHT_DROPFOLDER_POLL_SECONDS": "2", "FREIGHT_DROPFOLDER_MAX_BACKOFF_SECONDS": "60"}
    )
    assert (s.dropfolder_poll_seconds, s.dropfolder_max_backoff_seconds) == (2.0, 60.0)
    assert Settings.from_env({}).dropfolder_poll_seconds == 5.0
    with pytest.raises(SettingsError):
        Settings.from_env({"FREIGHT_DROPFOLDER_POLL_SECONDS": "0"})


# -- against the database and S3 ------------------------------------------------------------------


@pytest.fixture
def s3(s3_service):
    return s3_service


@pytest.fixture
def bucket(s3) -> str:
    return s3.create_bucket(f"drop-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def folder(runtime: Runtime, s3, bucket: str) -> str:
    create_tenant(runtime.db, "alpha", now())
    view = folders_service.add(
        runtime, f"s3://{bucket}/team/evals", "alpha", CHAT, now=now(), model="demo", window="24h",
        s3_endpoint_url=s3.endpoint_url, region="us-east-1", access_key_id="freight",
        secret_access_key=SECRET,
    )  # fmt: skip
    return view.id


def put(s3, bucket: str, key: str, data: bytes) -> str:
    return s3.client().put_object(Bucket=bucket, Key=f"team/evals/{key}", Body=data)["ETag"].strip('"')


def keys(s3, bucket: str) -> set[str]:
    listed = s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"].removeprefix("team/evals/") for o in listed}


def get(s3, bucket: str, key: str) -> bytes:
    return s3.client().get_object(Bucket=bucket, Key=f"team/evals/{key}")["Body"].read()


def counts(rt: Runtime) -> tuple[int, int, int]:
    with rt.db.read() as s:
        return (
            s.scalar(select(func.count()).select_from(Batch)) or 0,
            s.scalar(select(func.count()).select_from(DropObject)) or 0,
            s.scalar(select(func.count()).select_from(StoredFile)) or 0,
        )


def later(seconds: float = 0) -> float:
    return time.time() + seconds


def test_a_dropped_file_becomes_one_ordinary_batch(runtime, s3, bucket, folder):
    etag = put(s3, bucket, "inbox/data.jsonl", jsonl([line("a"), line("b", model="demo")]))
    put(s3, bucket, "inbox/data.jsonl.freight.json", b'{"window": "1h", "metadata": {"project": "evals"}}')
    put(s3, bucket, "inbox/notes.txt", b"ignored")

    report = dropfolders.scan_folder(runtime, folder, later())
    assert report.failed is None and len(report.created) == 1
    with runtime.db.read() as s:
        batch = s.get(Batch, report.created[0])
        stored = s.get(StoredFile, batch.input_file_id)
        obj = s.scalar(select(DropObject))
    assert batch.status == "validating" and batch.endpoint == CHAT and batch.completion_window == "1h"
    assert batch.metadata_ == {
        "project": "evals",
        "source_object": f"s3://{bucket}/team/evals/inbox/data.jsonl",
        "source_etag": etag,
    }
    assert stored.filename == "data.jsonl" and stored.purpose == "batch"
    with runtime.store.open(stored.object_key) as f:
        lines = [json.loads(x) for x in f.read().splitlines()]
    assert [x["body"]["model"] for x in lines] == ["demo", "demo"]  # the folder's model filled in
    assert (obj.key, obj.etag, obj.batch_id) == ("team/evals/inbox/data.jsonl", etag, batch.id)

    # the same version is never taken again; a re-upload with new content is a new batch
    assert dropfolders.scan_folder(runtime, folder, later()).created == []
    put(s3, bucket, "inbox/data.jsonl", jsonl([line("c")]))
    assert len(dropfolders.scan_folder(runtime, folder, later()).created) == 1
    assert counts(runtime)[:2] == (2, 2)


def test_an_unreadable_object_does_not_hold_up_the_rest(runtime, s3, bucket, folder, monkeypatch):
    from storage.objectstore import ObjectStoreError, S3ObjectStore

    put(s3, bucket, "inbox/locked.jsonl", jsonl([line("x", model="demo")]))
    put(s3, bucket, "inbox/fine.jsonl", jsonl([line("y", model="demo")]))
    opened = S3ObjectStore.open_version

    def denied(self, key, etag):
        if key.endswith("locked.jsonl"):
            raise ObjectStoreError("AccessDenied")
        return opened(self, key, etag)

    monkeypatch.setattr(S3ObjectStore, "open_version", denied)
    report = dropfolders.scan_folder(runtime, folder, later())
    assert report.failed is None and len(report.created) == 1
    assert [k.rsplit("/", 1)[-1] for k in report.skipped] == ["locked.jsonl"]
    monkeypatch.undo()  # readable again: taken on the next scan, once
    assert len(dropfolders.scan_folder(runtime, folder, later()).created) == 1
    assert dropfolders.scan_folder(runtime, folder, later()).created == []


def test_a_gzip_file_is_decompressed_into_the_store(runtime, s3, bucket, folder):
    data = jsonl(line(f"r{i}", model="demo") for i in range(50))
    put(s3, bucket, "inbox/big.jsonl.gz", gzip.compress(data))
    [batch_id] = dropfolders.scan_folder(runtime, folder, later()).created
    with runtime.db.read() as s:
        stored = s.get(StoredFile, s.get(Batch, batch_id).input_file_id)
    with runtime.store.open(stored.object_key) as f:
        assert f.read() == data
    assert stored.bytes == len(data)


def test_two_scans_racing_make_one_batch(runtime, s3, bucket, folder):
    etag = put(s3, bucket, "inbox/race.jsonl", jsonl([line("a"), line("b")]))
    with runtime.db.read() as s:
        config = dropfolders.FolderConfig.of(s.get(DropFolder, folder), runtime.secrets)
    store = dropfolders.folder_store(config)
    inbox_file = InboxFile("inbox/race.jsonl", "race", etag, store.stat("inbox/race.jsonl").size, False, None)

    # two schedulers that both got past the folder lease (say it expired) ingest the same version
    start = threading.Barrier(3)
    results: list[str | None] = []

    def ingest() -> None:
        start.wait()
        results.append(dropfolders.ingest(runtime, config, store, inbox_file))

    # ... while two whole scans race for the lease at the same moment
    def scan() -> None:
        start.wait()
        results.extend(dropfolders.scan_folder(runtime, folder, later()).created)

    threads = [
        threading.Thread(target=ingest),
        threading.Thread(target=ingest),
        threading.Thread(target=scan),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    made = [r for r in results if r]
    assert len(made) == 1, results
    assert counts(runtime) == (1, 1, 1)  # the losers' file and batch rows were rolled back
    assert dropfolders.scan_folder(runtime, folder, later()).created == []


def test_a_crash_between_creating_the_batch_and_recording_the_object(
    runtime, s3, bucket, folder, monkeypatch
):
    put(s3, bucket, "inbox/crash.jsonl", jsonl([line("a")]))

    def crash(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("injected crash after the batch row, before the object row")

    monkeypatch.setattr(dropfolders, "record_object", crash)
    report = dropfolders.scan_folder(runtime, folder, later())
    assert report.failed and "injected crash" in report.failed
    assert counts(runtime) == (0, 0, 0)  # one transaction: the batch went with the crash
    monkeypatch.undo()

    with runtime.db.read() as s:
        backoff = s.get(DropFolder, folder)
    assert backoff.scan_failures == 1 and backoff.scan_lease_at is None
    assert dropfolders.scan_folder(runtime, folder, later()).created == []  # still backing off
    assert len(dropfolders.scan_folder(runtime, folder, later(60)).created) == 1
    assert dropfolders.scan_folder(runtime, folder, later(60)).created == []
    assert counts(runtime) == (1, 1, 1)


def test_a_crash_after_the_commit_before_validation_is_sent(runtime, s3, bucket, folder, monkeypatch):
    """The scanner dies between the commit that made the batch and the send of its validation: no
    second batch is made, and the tick's resend_lost_validations (which covers every
    ``validating`` batch) sends it through the real broker once a lease has passed, once."""
    put(s3, bucket, "inbox/lost.jsonl", jsonl([line("a")]))

    def die(batch_id: str) -> None:
        raise RuntimeError("worker died before sending the validation task")

    with monkeypatch.context() as crash:
        crash.setattr(runtime.queue, "validate", die)
        assert dropfolders.scan_folder(runtime, folder, later()).failed
    assert dropfolders.scan_folder(runtime, folder, later(60)).created == []  # known: no second batch
    assert counts(runtime)[:2] == (1, 1)
    with runtime.db.read() as s:
        batch_id, created = s.execute(select(Batch.id, Batch.created_at)).one()
    lease = runtime.settings.lease_seconds
    with runtime.queue.celery.connection_for_write() as conn:
        client = conn.default_channel.client
        client.delete(VALIDATE_QUEUE)
        report = TickReport()
        resend_lost_validations(runtime, created + lease - 1, report)  # may still be on its way
        resend_lost_validations(runtime, created + lease + 1, report)
        resend_lost_validations(runtime, created + lease + 2, report)  # once a lease, not a tick
        sent = [json.loads(m)["headers"] for m in client.lrange(VALIDATE_QUEUE, 0, -1)]
    assert report.revalidated == [batch_id]
    assert [(h["task"], h["argsrepr"]) for h in sent] == [("freight.validate_batch", repr([batch_id]))]


def test_an_ingest_with_the_broker_down_is_withdrawn_and_read_again(runtime, s3, bucket, folder):
    """The validation task cannot be sent: the batch, its file and the claim on the inbox object
    are withdrawn (nothing left ``validating``), the scan backs off, and the next scan reads the
    object again and makes it a batch."""
    from dataclasses import replace

    down = Runtime(replace(runtime.settings, broker_url="redis://127.0.0.1:1/0"))  # nobody listens
    down.queue.celery.conf.broker_transport_options = {"max_retries": 0}
    down.queue.celery.conf.task_publish_retry = False
    put(s3, bucket, "inbox/queued.jsonl", jsonl([line("a")]))
    try:
        report = dropfolders.scan_folder(down, folder, later())
    finally:
        down.db.dispose()
    assert report.failed and report.created == []
    assert counts(runtime) == (0, 0, 0)  # no batch, no claim on the object, no stored copy
    assert "inbox/queued.jsonl" in keys(s3, bucket)
    with runtime.db.read() as s:
        assert s.get(DropFolder, folder).scan_failures == 1

    created = dropfolders.scan_folder(runtime, folder, later(60)).created  # past the backoff
    assert len(created) == 1 and counts(runtime) == (1, 1, 1)
    with runtime.db.read() as s:
        assert s.get(Batch, created[0]).status == "validating"
        assert s.scalar(select(DropObject.batch_id)) == created[0]


def test_invalid_files_get_a_failed_manifest_and_move_to_failed(runtime, s3, bucket, folder):
    put(s3, bucket, "inbox/broken.jsonl.gz", b"not gzip at all")
    put(s3, bucket, "inbox/bad.jsonl", jsonl([line("a")]) + b"{not json\n" + jsonl([line("a")]))
    put(s3, bucket, "inbox/side.jsonl", jsonl([line("a")]))
    put(s3, bucket, "inbox/side.jsonl.freight.json", b'{"modle": "demo"}')
    report = dropfolders.scan_folder(runtime, folder, later())
    assert sorted(report.refused) == ["inbox/broken.jsonl.gz", "inbox/side.jsonl"]
    [batch_id] = report.created
    validate_batch(runtime, batch_id)  # the control worker's job; fails on the bad lines

    delivered = dropfolders.poll(runtime, later()).deliveries
    assert len(delivered) == 3
    assert all(dropfolder_delivery.deliver(runtime, i, later()) for i in delivered)
    assert not any(dropfolder_delivery.deliver(runtime, i, later()) for i in delivered)  # exactly once

    assert keys(s3, bucket) == {
        "failed/broken.jsonl.gz", "failed/bad.jsonl", "failed/side.jsonl", "failed/side.jsonl.freight.json",
        "outbox/broken.manifest.json", "outbox/bad.manifest.json", "outbox/side.manifest.json",
    }  # fmt: skip
    gz = json.loads(get(s3, bucket, "outbox/broken.manifest.json"))
    assert gz["status"] == "failed" and gz["batch_id"] is None
    assert gz["errors"][0]["code"] == "invalid_gzip"
    bad = json.loads(get(s3, bucket, "outbox/bad.manifest.json"))
    assert bad["status"] == "failed" and bad["batch_id"] == batch_id
    assert {(e["code"], e["line"]) for e in bad["errors"]} == {
        ("invalid_json_line", 2),
        ("duplicate_custom_id", 3),
    }
    assert bad["results"]["input"] == f"s3://{bucket}/team/evals/failed/bad.jsonl"
    side = json.loads(get(s3, bucket, "outbox/side.manifest.json"))
    assert side["errors"][0]["code"] == "invalid_sidecar" and "modle" in side["errors"][0]["message"]
    assert dropfolders.scan_folder(runtime, folder, later()).created == []


def test_files_that_crashed_the_parser_do_not_block_the_folder(runtime, s3, bucket, folder):
    """A sidecar nested deeper than JSON decoders recurse, and a line holding a number past Python's
    4,300 digits, used to raise out of the scan on every pass (issue #19, section 2): now the one is
    refused, the other becomes a batch whose validation reports the line, and the file after them
    in the folder still becomes its batch."""
    put(s3, bucket, "inbox/a-deep.jsonl", jsonl([line("a")]))
    put(s3, bucket, "inbox/a-deep.jsonl.freight.json", b"[" * 20_000 + b"]" * 20_000)
    huge = (
        b'{"custom_id":"n","method":"POST","url":"/v1/chat/completions","body":{"seed":' + b"9" * 5000 + b"}}"
    )
    put(s3, bucket, "inbox/b-huge.jsonl", jsonl([line("a")]) + huge + b"\n")
    put(s3, bucket, "inbox/c-fine.jsonl", jsonl([line("a")]))
    report = dropfolders.scan_folder(runtime, folder, later())
    assert report.failed is None and report.refused == ["inbox/a-deep.jsonl"]
    assert len(report.created) == 2
    for batch_id in report.created:
        validate_batch(runtime, batch_id)
    with runtime.db.read() as s:
        batches = {b.metadata_["source_object"].rsplit("/", 1)[-1]: b for b in s.scalars(select(Batch))}
    assert batches["c-fine.jsonl"].status == "in_progress"
    assert batches["b-huge.jsonl"].status == "failed"
    [error] = batches["b-huge.jsonl"].errors["data"]
    assert (error["line"], error["code"]) == (2, "invalid_json_line") and "4300 digits" in error["message"]


def test_an_unreachable_bucket_backs_off_and_logs_no_secret(runtime, s3, bucket, folder, caplog):
    put(s3, bucket, "inbox/wait.jsonl", jsonl([line("a")]))
    good = s3.endpoint_url
    with runtime.db.write() as s:
        s.get(DropFolder, folder).s3_endpoint_url = f"http://127.0.0.1:{free_port()}"  # nobody listens
    t0 = later()
    report = dropfolders.scan_folder(runtime, folder, t0)
    assert report.failed and report.created == []
    assert dropfolders.scan_folder(runtime, folder, later()).failed is None  # backing off: not tried
    assert dropfolders.poll(runtime, t0 + 1).scans == []
    report = dropfolders.scan_folder(runtime, folder, later(60))
    assert report.failed
    with runtime.db.read() as s:
        state = s.get(DropFolder, folder)
    pause = 2 * runtime.settings.dropfolder_poll_seconds  # the second failure waits twice as long
    assert state.scan_failures == 2 and state.next_scan_at > time.time() + pause - 3
    assert "scan failed" in caplog.text and SECRET not in caplog.text

    with runtime.db.write() as s:  # the bucket is back: nothing was lost
        row = s.get(DropFolder, folder)
        row.s3_endpoint_url = good
        row.next_scan_at = None
    assert len(dropfolders.scan_folder(runtime, folder, later()).created) == 1


def test_a_failed_delivery_is_retried_with_backoff(runtime, s3, bucket, folder):
    put(s3, bucket, "inbox/z.jsonl.gz", b"broken")
    assert dropfolders.scan_folder(runtime, folder, later()).refused == ["inbox/z.jsonl.gz"]
    with runtime.db.write() as s:
        s.get(DropFolder, folder).s3_endpoint_url = f"http://127.0.0.1:{free_port()}"
    [object_id] = dropfolders.poll(runtime, later()).deliveries
    assert not dropfolder_delivery.deliver(runtime, object_id, later())
    with runtime.db.read() as s:
        obj = s.get(DropObject, object_id)
    assert obj.delivery_attempts == 1 and obj.last_error and obj.delivered_at is None
    assert dropfolders.poll(runtime, later()).deliveries == []  # waiting out the backoff
    with runtime.db.write() as s:
        s.get(DropFolder, folder).s3_endpoint_url = s3.endpoint_url
    assert dropfolder_delivery.deliver(runtime, object_id, later(60))
    assert "failed/z.jsonl.gz" in keys(s3, bucket) and "inbox/z.jsonl.gz" not in keys(s3, bucket)


def test_removed_folders_are_not_scanned(runtime, s3, bucket, folder):
    put(s3, bucket, "inbox/a.jsonl", jsonl([line("a")]))
    folders_service.remove(runtime, f"s3://{bucket}/team/evals", now())
    assert dropfolders.poll(runtime, later()).scans == []
    assert dropfolders.scan_folder(runtime, folder, later()).created == []


def test_a_disabled_tenants_folders_are_not_scanned_until_it_is_enabled(runtime, s3, bucket, folder):
    put(s3, bucket, "inbox/a.jsonl", jsonl([line("a")]))
    disable_tenant(runtime.db, "alpha", now())
    assert dropfolders.poll(runtime, later()).scans == []
    # a scan sent before the disabling takes no lease and reads nothing
    assert dropfolders.scan_folder(runtime, folder, later()).created == []
    assert counts(runtime) == (0, 0, 0)
    enable_tenant(runtime.db, "alpha")
    assert dropfolders.poll(runtime, later()).scans == [folder]
    assert len(dropfolders.scan_folder(runtime, folder, later()).created) == 1


def test_an_embeddings_file_runs_like_a_chat_file(runtime, s3, bucket, embed_model):
    """A folder for /v1/embeddings on an embedding model: its file becomes a batch of that endpoint
    with the folder's model filled in, validates on that model's tokenizer, and once its units ran
    (written as an engine worker writes them) the outbox holds the vectors as typed Parquet and a
    manifest of input tokens and no output tokens."""
    registration.add(runtime, AddRequest("emb", str(embed_model)), echo=lambda _: None)
    create_tenant(runtime.db, "alpha", now())
    folder = folders_service.add(
        runtime, f"s3://{bucket}/team/evals", "alpha", EMBEDDINGS, now=now(), model="emb",
        s3_endpoint_url=s3.endpoint_url, region="us-east-1", access_key_id="freight",
        secret_access_key=SECRET, output_format="parquet",
    ).id  # fmt: skip
    texts = [f"document {i} of the corpus" for i in range(5)]
    lines = [embedding_line(f"doc-{i}", text) for i, text in enumerate(texts)]
    for each in lines:
        del each["body"]["model"]  # the folder's model fills it in
    put(s3, bucket, "inbox/corpus.jsonl", jsonl(lines))
    [batch_id] = dropfolders.scan_folder(runtime, folder, later()).created
    validate_batch(runtime, batch_id)
    with runtime.db.read() as s:
        batch = s.get(Batch, batch_id)
        assert (batch.endpoint, batch.model, batch.status) == (EMBEDDINGS, "emb", "in_progress")
        assert batch.planned_prompt_tokens > 0

    vectors = {}
    with runtime.db.write() as s:  # each unit's results, as its engine worker writes them
        for unit in s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch_id)):
            out, tokens = [], 0
            for row in read_rows(runtime.store, unit.shard_key, unit.row_start, unit.n_requests):
                vectors[row.custom_id] = array("f", [row.line, 0.5, -1.0, 2.25]).tolist()
                tokens += row.prompt_len
                body = embeddings_body([vectors[row.custom_id]], "float", "emb", row.prompt_len)
                out.append(encode(success_line(row.custom_id, body)))
            base = f"batches/{batch_id}/units/{unit.seq:06d}.1"
            runtime.store.put_chunks(f"{base}.output.jsonl", out)
            runtime.store.put_chunks(f"{base}.errors.jsonl", [b""])
            unit.status, unit.output_key, unit.error_key = (
                UnitStatus.DONE,
                f"{base}.output.jsonl",
                f"{base}.errors.jsonl",
            )
            unit.completed, unit.prompt_tokens, unit.completion_tokens = unit.n_requests, tokens, 0
        s.execute(update(Batch).where(Batch.id == batch_id).values(status=BatchStatus.FINALIZING.value))
    assert finalize_batch(runtime, batch_id) == BatchStatus.COMPLETED

    [delivery] = dropfolders.poll(runtime, later()).deliveries
    assert dropfolder_delivery.deliver(runtime, delivery, later())
    assert keys(s3, bucket) == {
        "archive/corpus.jsonl", "outbox/corpus.output.parquet", "outbox/corpus.errors.parquet",
        "outbox/corpus.manifest.json",
    }  # fmt: skip
    manifest = json.loads(get(s3, bucket, "outbox/corpus.manifest.json"))
    with runtime.db.read() as s:
        planned = s.get(Batch, batch_id).planned_prompt_tokens
    assert (manifest["status"], manifest["endpoint"], manifest["model"]) == ("completed", EMBEDDINGS, "emb")
    assert manifest["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert manifest["usage"] == {"input_tokens": planned, "cached_tokens": 0, "output_tokens": 0,
                                 "total_tokens": planned}  # fmt: skip
    table = pq.read_table(io.BytesIO(get(s3, bucket, "outbox/corpus.output.parquet")))
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 4)
    got = {r["custom_id"]: r["embedding"] for r in table.select(["custom_id", "embedding"]).to_pylist()}
    assert got == vectors


def test_a_rerank_folder_makes_batches_for_its_cross_encoder(runtime, s3, bucket, score_model):
    """A folder for /v1/rerank on the demo cross-encoder: its file becomes a batch of that endpoint
    with the folder's model filled in, and validates on the cross-encoder's tokenizer; a folder for
    a text model is refused (it scores nothing)."""
    registration.add(runtime, AddRequest("rank", str(score_model)), echo=lambda _: None)
    create_tenant(runtime.db, "alpha", now())
    options = dict(s3_endpoint_url=s3.endpoint_url, region="us-east-1", access_key_id="freight",
                   secret_access_key=SECRET)  # fmt: skip
    with pytest.raises(ServiceError, match="'demo' generates text; it does not serve /v1/rerank"):
        folders_service.add(
            runtime, f"s3://{bucket}/team/bad", "alpha", "/v1/rerank", now=now(), model="demo", **options
        )
    folder = folders_service.add(
        runtime, f"s3://{bucket}/team/evals", "alpha", "/v1/rerank", now=now(), model="rank", **options
    ).id
    lines = [
        {"custom_id": f"q-{i}", "method": "POST", "url": "/v1/rerank",
         "body": {"query": f"question {i % 2}", "documents": ["one answer", "another answer"]}}
        for i in range(4)
    ]  # fmt: skip
    put(s3, bucket, "inbox/pairs.jsonl", jsonl(lines))
    [batch_id] = dropfolders.scan_folder(runtime, folder, later()).created
    validate_batch(runtime, batch_id)
    with runtime.db.read() as s:
        batch = s.get(Batch, batch_id)
        assert (batch.endpoint, batch.model, batch.status, batch.request_total) == (
            "/v1/rerank",
            "rank",
            "in_progress",
            4,
        )


def test_a_file_over_the_api_upload_limit_is_taken_up_to_the_uploads_limit(runtime, s3, bucket, folder):
    """A drop folder's object streams into the store as /v1/uploads' parts do, so it may be as
    large as FREIGHT_MAX_UPLOAD_BYTES, not only FREIGHT_MAX_FILE_BYTES (64 kB in these tests)."""
    data = jsonl(line(f"r{i}", model="demo") for i in range(1500))
    assert len(data) > runtime.settings.max_file_bytes
    put(s3, bucket, "inbox/large.jsonl", data)
    [batch_id] = dropfolders.scan_folder(runtime, folder, later()).created
    with runtime.db.read() as s:
        stored = s.get(StoredFile, s.get(Batch, batch_id).input_file_id)
    assert stored.bytes == len(data)


def test_a_parquet_audio_file_dropped_for_transcriptions_validates_with_its_audio_stored_once(
    runtime, s3, bucket, whisper_model
):
    """A folder for /v1/audio/transcriptions on a Whisper model: a Parquet file of an ``audio``
    column (WAV bytes, one recording in two rows) dropped in its inbox becomes a batch of that
    endpoint on the folder's model, whose validation stores each distinct audio once and leaves
    references in the shards."""
    from tests.audio_factories import tone
    from workers.media_files import AUDIO_REF

    registration.add(runtime, AddRequest("whisper", str(whisper_model)), echo=lambda _: None)
    create_tenant(runtime.db, "alpha", now())
    folder = folders_service.add(
        runtime, f"s3://{bucket}/team/evals", "alpha", "/v1/audio/transcriptions", now=now(),
        model="whisper", s3_endpoint_url=s3.endpoint_url, region="us-east-1", access_key_id="freight",
        secret_access_key=SECRET,
    ).id  # fmt: skip
    sounds = [tone(0.5), tone(0.7), tone(0.5)]
    table = pa.table(
        {"custom_id": ["a", "b", "a-again"], "audio": pa.array(sounds, pa.binary()), "language": ["en"] * 3}
    )
    out = io.BytesIO()
    pq.write_table(table, out)
    put(s3, bucket, "inbox/calls.parquet", out.getvalue())
    [batch_id] = dropfolders.scan_folder(runtime, folder, later()).created
    validate_batch(runtime, batch_id)
    with runtime.db.read() as s:
        batch = s.get(Batch, batch_id)
        assert (batch.endpoint, batch.model, batch.status) == (
            "/v1/audio/transcriptions",
            "whisper",
            "in_progress",
        )
    rows = {}
    for key in runtime.store.list(f"batches/{batch_id}/shards/"):
        rows.update({r.custom_id: json.loads(r.body_json) for r in read_rows(runtime.store, key, 0, 10)})
    assert {k: (b["model"], b["file_url"][: len(AUDIO_REF)]) for k, b in rows.items()} == {
        k: ("whisper", AUDIO_REF) for k in ("a", "b", "a-again")
    }
    assert rows["a"]["file_url"] == rows["a-again"]["file_url"] != rows["b"]["file_url"]
    assert len(list(runtime.store.list(f"batches/{batch_id}/audio/"))) == 2
