"""The tasks' exception policy and the validation lease, against a real database (SQLite and
PostgreSQL) and a real broker; no engine. An outage retries a task, a fault ends its batch
``failed`` naming the step, and a validation whose message or worker was lost is sent again by the
dispatcher's tick once its lease has run out (a fake clock: ``now`` is passed in, nothing sleeps).

The tasks run in this process through Celery's own task objects (``apply``), not a worker: the
same task class, exception policy and retry decisions, with each retry run at once instead of
after its countdown (up to a minute of real waits for the outage's retries, which is what this
module counts). A worker running the same policy is tested where time is what matters:
``freight worker --control`` in tests/workers/test_control_roles.py (a validation past its limit
failed, a killed one failed from the supervisor) and the live stack's service faults
(tests/e2e/test_service_faults.py)."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
from sqlalchemy import select, update

from api.services.tenants import create_tenant
from storage.models import Batch, StoredFile, UnitStatus, WorkUnit
from storage.runtime import Runtime
from storage.status import BatchStatus
from tests.conftest import now
from tests.factories import chat_line, upload_and_create, validated_batch
from workers import dispatcher, finalize, task_policy, unit_claims, validation
from workers.celery_app import make_celery
from workers.identity import holder_id

LINES = [chat_line("a"), chat_line("b")]


def worker_app(rt: Runtime):
    """A worker process's Celery app, its tasks run in-process (``apply``: retries run at once; see
    the module's docstring)."""
    app = make_celery(rt.settings)
    app.runtime = rt
    return app


def batch_row(rt: Runtime, batch_id: str) -> Batch:
    with rt.db.read() as s:
        row = s.get(Batch, batch_id)
        assert row is not None
        return row


@pytest.fixture
def tenant(runtime: Runtime) -> str:
    return create_tenant(runtime.db, "a", now())[0].id


def count_calls(monkeypatch, module, name: str) -> list[tuple]:
    calls: list[tuple] = []
    real = getattr(module, name)

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_an_object_store_outage_retries_validation_then_leaves_it_to_the_lease(
    settings, runtime, tenant, monkeypatch
):
    batch = upload_and_create(runtime, tenant, LINES)
    # the same database and broker, an object store nobody answers at, and no time to retry there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "freight")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "freight")
    dead = Runtime(replace(settings, object_store_url="s3://freight/x", s3_endpoint_url="http://127.0.0.1:1",
                           object_store_retry_seconds=0))  # fmt: skip
    calls = count_calls(monkeypatch, validation, "validate_batch")
    app = worker_app(dead)
    try:
        app.tasks["freight.validate_batch"].apply(args=[batch.id])
    finally:
        dead.db.dispose()
    assert len(calls) == task_policy.MAX_RETRIES + 1  # retried while the outage lasted
    row = batch_row(runtime, batch.id)
    assert row.status == BatchStatus.VALIDATING and row.errors is None
    assert row.validation_heartbeat_at is None  # given back: nothing holds it

    # each retry noted when it was due: the tick waits a lease past the last one, then sends once
    last_retry = task_policy.retry_countdown(task_policy.MAX_RETRIES - 1)
    assert row.validation_due_at is not None and row.validation_due_at >= row.created_at + last_retry
    lease = settings.lease_seconds
    runtime.queue.broker_was_reset()  # the marker is set: only the lease decides below
    assert dispatcher.tick(runtime, row.created_at + lease + 1).revalidated == []  # a retry is due
    assert dispatcher.tick(runtime, row.validation_due_at + lease - 1).revalidated == []
    assert dispatcher.tick(runtime, row.validation_due_at + lease + 1).revalidated == [batch.id]
    # and with the store back, that delivery validates it
    app.runtime = runtime
    app.tasks["freight.validate_batch"].apply(args=[batch.id])
    assert batch_row(runtime, batch.id).status == BatchStatus.IN_PROGRESS


def test_a_validation_fault_fails_the_batch_naming_the_step(runtime, tenant, monkeypatch):
    batch = upload_and_create(runtime, tenant, LINES)
    with runtime.db.read() as s:
        key = s.get(StoredFile, batch.input_file_id).object_key
    runtime.store.delete(key)  # the input object vanished: no retry will bring it back
    calls = count_calls(monkeypatch, validation, "validate_batch")
    worker_app(runtime).tasks["freight.validate_batch"].apply(args=[batch.id])
    assert len(calls) == 1  # not retried
    row = batch_row(runtime, batch.id)
    assert row.status == BatchStatus.FAILED and row.failed_at and row.request_total == 0
    [error] = row.errors["data"]
    assert error["message"].startswith(
        "validation failed: internal error in step validate_batch: ObjectNotFound"
    )
    assert key in error["message"] and error["line"] is None and error["code"] == "internal_error"


def test_a_lost_validation_is_sent_again_once_its_lease_is_stale(settings, runtime, tenant):
    lease = settings.lease_seconds
    batch = upload_and_create(runtime, tenant, LINES)  # its message is never consumed: lost
    created = batch_row(runtime, batch.id).created_at
    runtime.queue.broker_was_reset()  # the marker is set: the broker did not lose its data
    assert dispatcher.tick(runtime, created + lease - 1).revalidated == []  # may still be on its way
    assert dispatcher.tick(runtime, created + lease + 1).revalidated == [batch.id]
    # one copy a lease, however many ticks pass while it waits in the queue
    for t in range(2, int(lease), 2):
        assert dispatcher.tick(runtime, created + lease + t).revalidated == []
    assert dispatcher.tick(runtime, created + 2 * lease + 2).revalidated == [batch.id]

    # a validation holding a fresh lease is left alone until its lease runs out
    beat = float(created + 3 * lease)
    with runtime.db.write() as s:
        s.execute(update(Batch).where(Batch.id == batch.id).values(validation_heartbeat_at=beat))
    assert dispatcher.tick(runtime, beat + lease / 2).revalidated == []
    assert dispatcher.tick(runtime, beat + lease + 1).revalidated == [batch.id]


def test_a_delivery_finding_a_fresh_lease_does_nothing(settings, runtime, tenant):
    import time

    batch = upload_and_create(runtime, tenant, LINES)
    held = time.time()
    with runtime.db.write() as s:  # another validation took the lease just now
        s.execute(update(Batch).where(Batch.id == batch.id).values(validation_heartbeat_at=held))
    validation.validate_batch(runtime, batch.id)
    row = batch_row(runtime, batch.id)
    assert row.status == BatchStatus.VALIDATING and row.validation_heartbeat_at == held
    with runtime.db.write() as s:  # its worker died: the lease runs out, the next delivery takes it
        s.execute(
            update(Batch)
            .where(Batch.id == batch.id)
            .values(validation_heartbeat_at=held - settings.lease_seconds - 1)
        )
    validation.validate_batch(runtime, batch.id)
    row = batch_row(runtime, batch.id)
    assert row.status == BatchStatus.IN_PROGRESS and row.validation_heartbeat_at is None


@pytest.mark.parametrize("status", [BatchStatus.FINALIZING, BatchStatus.CANCELLING])
def test_a_finalization_fault_fails_the_batch_only_where_the_states_allow(
    runtime, tenant, monkeypatch, status
):
    batch = upload_and_create(runtime, tenant, LINES)
    with runtime.db.write() as s:
        s.execute(update(Batch).where(Batch.id == batch.id).values(status=status, finalizer_heartbeat_at=1.0))

    def broken(rt: Runtime, batch_id: str) -> None:
        raise KeyError("a bug")

    monkeypatch.setattr(finalize, "finalize_batch", broken)
    worker_app(runtime).tasks["freight.finalize_batch"].apply(args=[batch.id])
    row = batch_row(runtime, batch.id)
    message = row.errors["data"][0]["message"]
    assert message == "finalization failed: internal error in step finalize_batch: KeyError: 'a bug'"
    assert row.finalizer_heartbeat_at is None  # the tick may send it again
    # finalizing -> failed; a cancelling batch can only become cancelled: it keeps its state
    assert row.status == (BatchStatus.FAILED if status == BatchStatus.FINALIZING else BatchStatus.CANCELLING)


def test_which_errors_are_outages():
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError
    from kombu.exceptions import OperationalError as BrokerDown
    from sqlalchemy.exc import OperationalError as DatabaseDown

    from storage.objectstore import ObjectNotFound, ObjectStoreError

    def wrapped(cause: Exception) -> ObjectStoreError:
        try:
            raise ObjectStoreError("store call failed") from cause
        except ObjectStoreError as exc:
            return exc

    denied = ClientError(
        {"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "Get"
    )
    busy = ClientError({"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "Get")
    assert task_policy.is_transient(BrokerDown("no broker"))
    assert task_policy.is_transient(DatabaseDown("select 1", {}, Exception("connection refused")))
    assert task_policy.is_transient(wrapped(EndpointConnectionError(endpoint_url="http://x")))
    assert task_policy.is_transient(wrapped(busy))
    assert not task_policy.is_transient(wrapped(denied))
    assert not task_policy.is_transient(wrapped(NoCredentialsError()))
    assert not task_policy.is_transient(ObjectNotFound("files/x"))
    assert not task_policy.is_transient(ValueError("a bug"))
    assert [task_policy.retry_countdown(n) for n in range(8)] == [5, 10, 20, 40, 80, 160, 300, 300]


def test_a_failed_pack_fails_only_the_units_this_process_holds(settings, tenant):
    """A worker restarted under its old name meets its dead predecessor's units, still held by the
    predecessor's claims until their lease runs out, in the pack Redis redelivered to it. When the
    pack fails in the new process, fail_pack must fail its own claims alone: the incarnation in
    the claim token tells the two processes apart (workers/identity.py), and a name's LIKE
    wildcards (``_``, ``%``) match only themselves."""
    rt = Runtime(replace(settings, unit_size=2))
    try:
        lines = [chat_line(f"r{i}") for i in range(8)]  # four units of two
        unit_ids = [u.id for u in units_of(rt, validated_batch(rt, tenant, lines))]
        name = "engine_%@gpu7"
        dead, alive = holder_id(name, "7-0a1b2c3d"), holder_id(name, "7-9f8e7d6c")  # one pid, two starts
        lookalike = holder_id("engineX%@gpu7", "7-9f8e7d6c")  # `_` as a wildcard would match it
        holders = [dead, alive, alive, lookalike]
        t = float(now())
        claims = [unit_claims.claim_unit(rt, u, t, h) for u, h in zip(unit_ids, holders, strict=True)]
        assert all(claims)
        with rt.db.write() as s:
            s.execute(update(WorkUnit).where(WorkUnit.id.in_(unit_ids)).values(pack_id="pack-1"))
        assert task_policy.fail_pack(rt, alive, False, "boom", "pack-1", unit_ids) == 2
        after = {u.id: u for u in units_of(rt)}
        assert [after[u].status for u in unit_ids] == [
            UnitStatus.RUNNING, UnitStatus.FAILED, UnitStatus.FAILED, UnitStatus.RUNNING
        ]  # fmt: skip
        assert after[unit_ids[0]].worker == claims[0].token  # type: ignore[union-attr]  # still the dead one's
        # the predecessor's unit is left to the lease, which queues it again for anyone
        assert task_policy.fail_pack(rt, alive, True, "engine died", "pack-1", unit_ids) == 0
    finally:
        rt.db.dispose()


def units_of(rt: Runtime, batch_id: str | None = None) -> list[WorkUnit]:
    with rt.db.read() as s:
        query = select(WorkUnit).order_by(WorkUnit.id)
        if batch_id is not None:
            query = query.where(WorkUnit.batch_id == batch_id)
        return list(s.scalars(query).all())


def test_past_the_soft_limit_a_wrapped_error_is_still_the_time_limits() -> None:
    """Code that turns any error of a step into its own (a tokenizer's load: TokenizerUnavailable)
    catches Celery's SoftTimeLimitExceeded too; the task's wrapper must still report the time
    limit, not the wrapping error (seen once in the control-roles test)."""
    import os
    import signal
    import time

    from celery.exceptions import SoftTimeLimitExceeded

    from workers.task_policy import TaskTimeLimit, time_limited

    def load_tokenizer() -> None:
        try:
            os.kill(os.getpid(), signal.SIGUSR1)  # what Celery's pool sends at the soft limit
            time.sleep(5)
        except SoftTimeLimitExceeded as exc:
            raise RuntimeError("the tokenizer could not be loaded") from exc

    def unrelated() -> None:
        raise RuntimeError("the tokenizer could not be loaded")

    setting = "FREIGHT_VALIDATION_TIME_LIMIT_SECONDS"
    with pytest.raises(TaskTimeLimit, match=rf"ran past its time limit of 0.5s \({setting}\)"):
        time_limited(load_tokenizer, 0.5, setting)()
    with pytest.raises(RuntimeError, match="could not be loaded"):  # no limit reached: its own error
        time_limited(unrelated, 0.5, setting)()


def test_the_hard_limits_handler_does_not_wait_for_the_killed_process_rows(settings, runtime, tenant):
    """Billiard calls the hard time limit's handler before it kills the stuck pool process, which
    may hold the batch row in an open transaction. The handler gives up on the row after a short
    lock wait (the kill comes once it returns), and a retry writes once the row is free."""
    import threading
    import time

    from sqlalchemy import create_engine, text

    if not settings.database_url.startswith("postgresql"):
        pytest.skip("SQLite has no row locks: its one writer holds them all")
    batch_id = upload_and_create(runtime, tenant, LINES).id
    error = "internal error in step validate_batch: TaskTimeLimit: ran past its time limit and was killed"
    task = worker_app(runtime).tasks["freight.validate_batch"]  # its fault: the batch fails
    record = functools.partial(
        task_policy.record_killed, task, task.fault, error, "validate_batch", (batch_id,)
    )
    stuck = create_engine(settings.database_url)
    try:
        with stuck.connect() as conn:  # the stuck process's transaction, holding the batch row
            conn.execute(text("SELECT id FROM batches WHERE id = :id FOR UPDATE"), {"id": batch_id})
            started = time.monotonic()
            assert record() is False  # it did not wait for the holder
            assert time.monotonic() - started < task_policy.KILLED_LOCK_WAIT_MS / 1000 + 3
            assert batch_row(runtime, batch_id).status == BatchStatus.VALIDATING
            retrying = threading.Thread(
                target=task_policy.retry_killed, args=(record, "validate_batch", (batch_id,))
            )
            retrying.start()
            time.sleep(1.5)
            conn.rollback()  # the kill: the holder's transaction ends
        retrying.join(timeout=30)
        assert not retrying.is_alive()
        row = batch_row(runtime, batch_id)
        assert row.status == BatchStatus.FAILED
        assert row.errors["data"][0]["message"] == f"validation failed: {error}"
    finally:
        stuck.dispose()
