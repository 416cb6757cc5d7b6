"""A control role run as ``freight worker --control --role finalize`` runs it, with
FREIGHT_LOG_FORMAT=json: every line it writes (Celery's, the task's in its pool process) is a
JSON object, and the task's lines about a batch carry the batch id; so do lines about a batch
written outside its task (a thread of the validation, the tick) and a webhook attempt's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import update

from api.services import webhooks as webhook_service
from api.services.tenants import create_tenant
from storage.logs import bound
from storage.models import Batch
from storage.runtime import Runtime
from storage.settings import Settings
from storage.status import BatchStatus
from tests.conftest import REPO, json_lines, now
from tests.factories import chat_line, upload_and_create
from tests.webhook_receiver import start as start_receiver
from tests.workers.test_control_roles import batch_row, wait_until, worker_env
from tests.workers.test_webhook_delivery import deliver_due, final_batch
from workers import validation
from workers.bootstrap import engine_config
from workers.dispatcher import TickReport, expire_overdue


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_task_logs_json_lines_with_its_batch_id(settings: Settings, redis_service, tmp_path: Path) -> None:
    settings = replace(settings, broker_url=redis_service.url.rsplit("/", 1)[0] + "/9")
    rt = Runtime(settings)
    with rt.queue.celery.connection_for_write() as conn:
        conn.default_channel.client.flushdb()
    tenant = create_tenant(rt.db, "a", now())[0].id
    batch_id = upload_and_create(rt, tenant, [chat_line("a")]).id
    with rt.db.write() as s:  # its requests all done: only the files are left to write
        s.execute(update(Batch).where(Batch.id == batch_id).values(status=BatchStatus.FINALIZING))
    log = tmp_path / "finalize.log"
    env = worker_env(settings, FREIGHT_LOG_FORMAT="json", FREIGHT_FINALIZE_CONCURRENCY="1")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers.bootstrap", "worker", "--control", "--role", "finalize"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        rt.queue.finalize(batch_id)
        wait_until(
            lambda: " succeeded in " in log.read_text(errors="replace"), "the task done", 60, proc, log
        )
        lines = json_lines(log.read_text())  # all of them: Celery's banner is left out too
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            rt.db.dispose()
    assert batch_row(rt, batch_id).status == BatchStatus.COMPLETED
    [done] = [line for line in lines if line["logger"] == "workers.finalize"]
    assert done["batch_id"] == batch_id and done["message"].startswith(f"batch {batch_id} completed")
    assert done["pid"] != proc.pid  # the pool process ran it
    assert all(line["role"] == "finalize" for line in lines)
    assert any(
        line["message"].endswith(" ready.") and line["logger"] == "celery.apps.worker" for line in lines
    )
    # Celery's line after the task returned is about the task, and no longer carries the id
    [succeeded] = [line for line in lines if " succeeded in " in line["message"]]
    assert succeeded["pid"] == done["pid"] and "batch_id" not in succeeded


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_lines_about_a_batch_outside_its_task_carry_its_id(settings: Settings, json_logs) -> None:
    """The validation's lease keeper logs from a thread of its own; the tick about many batches."""
    rt = Runtime(replace(settings, lease_seconds=0.2))
    try:
        tenant = create_tenant(rt.db, "a", now())[0].id
        batch_id = upload_and_create(rt, tenant, [chat_line("a")]).id
        with bound(batch_id=batch_id):  # as the validation task has it
            keeper = validation._LeaseKeeper(rt, batch_id, token=1.0)  # a lease it does not hold
        with keeper:
            deadline = time.monotonic() + 10
            while "took over" not in json_logs.getvalue():
                assert time.monotonic() < deadline, json_logs.getvalue()
                time.sleep(0.02)
        with rt.db.write() as s:
            s.execute(update(Batch).where(Batch.id == batch_id).values(expires_at=now() - 1))
        expire_overdue(rt, now(), TickReport())
    finally:
        rt.db.dispose()
    lines = {line["message"]: line for line in json_lines(json_logs.getvalue())}
    assert lines[f"batch {batch_id}: another validation took over the lease"]["batch_id"] == batch_id
    assert lines[f"batch {batch_id} expired"]["batch_id"] == batch_id


def test_json_logs_turn_the_weight_loading_progress_bar_off() -> None:
    """vLLM draws it with tqdm on the engine's stderr: lines no JSON parser reads."""
    json_settings = Settings.from_env({"FREIGHT_LOG_FORMAT": "json"})
    assert engine_config(json_settings, "demo", "/m").engine_args == {"use_tqdm_on_load": False}
    assert engine_config(json_settings, "demo", "/m", engine_args={"use_tqdm_on_load": True}).engine_args == {
        "use_tqdm_on_load": True
    }  # the model's own word wins
    assert "use_tqdm_on_load" not in engine_config(Settings(), "demo", "/m").engine_args


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_webhook_attempts_line_carries_its_batch_id(settings: Settings, json_logs) -> None:
    rt = Runtime(replace(settings, webhook_allow_private_targets=True))
    receiver = start_receiver()
    try:
        tenant, _ = create_tenant(rt.db, "alpha", now())
        webhook_service.add(rt, tenant.id, receiver.url("/alpha"), "batch.completed", now())
        batch_id = final_batch(rt, tenant.id, "completed")
        assert deliver_due(rt, time.time()) == ["delivered"]
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()
        rt.db.dispose()
    [line] = [line for line in json_lines(json_logs.getvalue()) if line["logger"] == "workers.webhooks"]
    assert line["message"].startswith("webhook delivery ") and line["batch_id"] == batch_id
