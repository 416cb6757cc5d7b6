"""A chunked validation across control processes, as deployed: the validation role run as
``freight worker --control --role validate`` (one process, then two taking chunks side by side)
against PostgreSQL, Redis and SeaweedFS. The same file gives byte-identical shards and the same
unit plan either way, and the same as one task in-process (issue #21 s1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from api.services.tenants import create_tenant
from storage.runtime import Runtime
from storage.settings import Settings
from tests.conftest import REPO, now
from tests.factories import jsonl, upload_and_create
from tests.workers.test_control_roles import wait_until, worker_env
from tests.workers.test_validation_chunks import doc_lines, outcome
from workers.validation import validate_batch

CHUNK = 32 * 1024


def start_validation_process(settings: Settings, name: str, log: Path) -> subprocess.Popen:
    """One control process of the validation role alone, one task at a time (a machine's worth)."""
    env = worker_env(
        settings,
        FREIGHT_OBJECT_STORE_URL=settings.object_store_url,
        FREIGHT_S3_ENDPOINT_URL=settings.s3_endpoint_url or "",
        FREIGHT_VALIDATION_CHUNK_BYTES=str(settings.validation_chunk_bytes),
        FREIGHT_VALIDATION_HEAD_ROWS=str(settings.validation_head_rows),
        FREIGHT_UNIT_SIZE=str(settings.unit_size),
        FREIGHT_MAX_FILE_BYTES=str(settings.max_file_bytes),
        FREIGHT_VALIDATION_CONCURRENCY="1",
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers.bootstrap", "worker", "--control", "--role", "validate", "--name", name],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    wait_until(lambda: " ready." in log.read_text(errors="replace"), "ready", 180, proc, log)
    return proc


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def chunk_tasks(log: Path, offset: int = 0) -> int:
    """Chunk tasks the process logging to ``log`` ran since byte ``offset`` of it."""
    text = log.read_bytes()[offset:].decode(errors="replace")
    return text.count("freight.validate_chunk[") // 2  # received, succeeded


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_one_or_two_control_processes_make_byte_identical_shards(
    settings, redis_service, s3_service, tmp_path, monkeypatch
):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "freight")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "freight")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    bucket = s3_service.create_bucket(f"pv-{uuid.uuid4().hex[:10]}")
    settings = replace(
        settings,
        broker_url=redis_service.url.rsplit("/", 1)[0] + "/9",
        object_store_url=f"s3://{bucket}/freight",
        s3_endpoint_url=s3_service.endpoint_url,
        validation_chunk_bytes=CHUNK,
        validation_head_rows=0,  # no early slice: the shards of the whole-file sort, compared below
        unit_size=8,
        max_file_bytes=4 << 20,
    )
    rt = Runtime(settings)
    procs: list[subprocess.Popen] = []
    try:
        with rt.queue.celery.connection_for_write() as conn:
            conn.default_channel.client.flushdb()
        tenant = create_tenant(rt.db, "t", now())[0].id
        data = jsonl(doc_lines(2000, seed=11))
        assert len(data) > 12 * CHUNK  # a dozen chunks and more

        # the reference: one task, in-process
        one_task = Runtime(replace(settings, validation_chunk_bytes=0))
        try:
            reference = upload_and_create(one_task, tenant, data, name="ref.jsonl").id
            with rt.queue.celery.connection_for_write() as conn:
                conn.default_channel.client.flushdb()  # its creation's message: run here instead
            validate_batch(one_task, reference)
            expected = outcome(one_task, reference)
        finally:
            one_task.db.dispose()
        assert expected[0].status == "in_progress" and expected[0].request_total == 2000

        results = {}
        logs: list[Path] = []
        for n in (1, 2):  # one process, then a second beside it (the first one stays up)
            logs.append(tmp_path / f"validate-{n}.log")
            procs.append(start_validation_process(settings, f"pv{n}", logs[-1]))
            offsets = [log.stat().st_size for log in logs]
            batch_id = upload_and_create(rt, tenant, data, name=f"in{n}.jsonl").id  # sends its validation
            wait_until(
                lambda b=batch_id: outcome(rt, b)[0].status != "validating",
                "validated", 300, procs[0], logs[0],
            )  # fmt: skip
            results[n] = outcome(rt, batch_id)
            ran = [chunk_tasks(log, offset) for log, offset in zip(logs, offsets, strict=True)]
            assert sum(ran) >= 13, ran
            if n == 2:
                assert all(ran), ran  # both processes took chunks
        for n, (batch, plan, shards) in results.items():
            assert batch.status == "in_progress" and batch.request_total == 2000, (n, batch.errors)
            assert plan == expected[1], n  # the unit plan
            assert shards == expected[2], n  # the shard objects, byte for byte
    finally:
        stop(procs)
        rt.db.dispose()
