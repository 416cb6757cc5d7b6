"""Webhooks end to end, without an engine: batches made final through the lifecycle functions the
workers use, deliveries sent to a real HTTP server on 127.0.0.1 (tests/webhook_receiver.py), on
SQLite and PostgreSQL. Every final batch is delivered once per subscribing endpoint, signed as
Standard Webhooks says; a receiver that answers 500 three times still gets it; one that always
fails ends with its delivery failed and the endpoint disabled with a visible reason; a slow
receiver holds one thread of a real webhook worker, and the other tenants' deliveries go on."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
from celery.contrib.testing.worker import start_worker
from sqlalchemy import func, select, text

from api.services import webhooks as service
from api.services.tenants import create_tenant, disable_tenant, enable_tenant
from scheduler.webhooks import ATTEMPTS, RETRY_SCHEDULE
from storage import secret_box
from storage.broker import WEBHOOK_QUEUE
from storage.lifecycle import finish_if_done, stop_batch
from storage.models import Batch, Tenant, WebhookDelivery, WebhookEndpoint
from storage.runtime import Runtime
from storage.status import BatchStatus, DeliveryStatus, EndpointStatus, transition
from storage.stored_secrets import reseal_all
from tests import factories, webhook_receiver
from tests.conftest import now
from tests.factories import chat_line
from tests.webhook_receiver import Behaviour, Receiver, verify
from workers import cleanup
from workers.celery_app import make_celery
from workers.finalize import finalize_batch
from workers.task_policy import fail_validation
from workers.webhooks import (
    TENANT_DISABLED,
    _claim,
    _record,
    deliver,
    lease_seconds,
    mark_sent,
    post,
    send_due,
)

ALL = "batch.completed,batch.failed,batch.cancelled,batch.expired"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = webhook_receiver.start()
    yield r
    r.server.shutdown()
    r.server.server_close()


@pytest.fixture
def rt(settings) -> Iterator[Runtime]:
    runtime = Runtime(replace(settings, webhook_allow_private_targets=True, webhook_timeout_seconds=2.0))
    yield runtime
    runtime.db.dispose()


def final_batch(rt: Runtime, tenant_id: str, status: str) -> str:
    """A one-line batch of the tenant, taken to ``status`` the way the workers take it there."""
    batch_id = factories.upload_and_create(rt, tenant_id, [chat_line("r0", "hi", max_tokens=2)]).id
    if status == "failed":
        assert fail_validation(rt, "internal error in step validate_batch: boom", batch_id)
        return batch_id
    with rt.db.write() as s:
        batch = s.get(Batch, batch_id)
        if status == "cancelled":
            stop_batch(s, batch, BatchStatus.CANCELLING, now())
        elif status == "expired":
            stop_batch(s, batch, BatchStatus.EXPIRED, now())
        else:  # validated into no units: every unit (none) is done
            transition(batch, BatchStatus.IN_PROGRESS, now())
            assert finish_if_done(s, batch, now())
    assert finalize_batch(rt, batch_id) == status
    return batch_id


def pending(rt: Runtime, at: float) -> list[int]:
    with rt.db.read() as s:
        return list(
            s.scalars(
                select(WebhookDelivery.id)
                .where(
                    WebhookDelivery.status == DeliveryStatus.PENDING, WebhookDelivery.next_attempt_at <= at
                )
                .order_by(WebhookDelivery.id)
            )
        )


def deliver_due(rt: Runtime, at: float) -> list[str | None]:
    """One attempt of every delivery due at ``at``, in turn (what the webhook role's threads do)."""
    return [deliver(rt, delivery_id, at) for delivery_id in pending(rt, at)]


def test_every_final_batch_is_delivered_once_signed_in_openais_shape(rt, receiver):
    alpha, _ = create_tenant(rt.db, "alpha", now())
    beta, _ = create_tenant(rt.db, "beta", now())
    hook = service.add(rt, alpha.id, receiver.url("/alpha"), ALL, now())
    assert hook.secret.startswith("whsec_")
    # beta wants completions only, at its own receiver: none of alpha's events, none of its failures
    service.add(rt, beta.id, receiver.url("/beta"), "batch.completed", now())
    batches = {
        status: final_batch(rt, alpha.id, status)
        for status in ("completed", "failed", "cancelled", "expired")
    }
    beta_failed = final_batch(rt, beta.id, "failed")

    # the tick's step finds each endpoint's earliest due delivery and sends a task for it
    assert len(send_due(rt, time.time())) == 1  # one endpoint subscribed to these, one at a time
    while pending(rt, time.time()):
        assert set(deliver_due(rt, time.time())) <= {"delivered", None}

    got = receiver.at("/alpha")
    assert len(got) == 4 and receiver.at("/beta") == []
    by_batch = {}
    for request in got:
        event = json.loads(request.body)
        assert set(event) == {"id", "object", "type", "created_at", "data"} and event["object"] == "event"
        assert event["data"] == {"id": event["data"]["id"]} and event["id"].startswith("evt_")
        assert request.headers["webhook-id"] == event["id"]
        assert abs(int(request.headers["webhook-timestamp"]) - time.time()) < 60
        assert verify(hook.secret, request.headers, request.body)
        assert not verify(hook.secret, request.headers, request.body.replace(b"batch_", b"batch-"))
        assert request.headers["content-type"] == "application/json"
        by_batch[event["data"]["id"]] = event["type"]
    assert by_batch == {batch_id: f"batch.{status}" for status, batch_id in batches.items()}

    # the delivery log of a batch: one delivery, delivered at the first attempt with a 200
    [entry] = service.deliveries(rt, alpha.id, batch_id=batches["completed"])
    assert (entry.status, entry.attempts, entry.last_status_code, entry.last_error) == (
        "delivered",
        1,
        200,
        None,
    )
    assert service.deliveries(rt, beta.id, batch_id=beta_failed) == []
    # nothing left to send, and an attempt of a delivered one does nothing
    assert send_due(rt, time.time()) == [] and deliver(rt, entry.id, time.time()) is None
    assert len(receiver.at("/alpha")) == 4
    # the log is kept as long as result files (FREIGHT_FILE_RETENTION_SECONDS), then pruned
    assert cleanup.run(rt, time.time()).deliveries_pruned == 0
    later = time.time() + rt.settings.file_retention_seconds + 1
    assert cleanup.prune_deliveries(rt, int(later), cleanup.CleanupReport()) is None
    assert service.deliveries(rt, alpha.id) == []


def test_a_receiver_that_answers_500_three_times_still_gets_it(rt, receiver):
    tenant, _ = create_tenant(rt.db, "t", now())
    receiver.behaviours["/flaky"] = Behaviour(fail_first=3)
    hook = service.add(rt, tenant.id, receiver.url("/flaky"), ALL, now())
    batch_id = final_batch(rt, tenant.id, "completed")
    with rt.db.read() as s:  # due from the batch's final moment (whole seconds), not from now
        t = s.scalar(select(WebhookDelivery.next_attempt_at).where(WebhookDelivery.batch_id == batch_id))
    outcomes = []
    for delay in (0.0, *RETRY_SCHEDULE[:3]):  # the clock moved on to each retry's time
        t += delay
        assert deliver_due(rt, t - 1) in ([], [None])  # not due a second early
        outcomes += deliver_due(rt, t)
    assert outcomes == ["retry", "retry", "retry", "delivered"]
    got = receiver.at("/flaky")
    assert [r.status for r in got] == [500, 500, 500, 200]
    assert len({r.headers["webhook-id"] for r in got}) == 1  # the same message each time
    assert all(verify(hook.secret, r.headers, r.body) for r in got)
    [entry] = service.deliveries(rt, tenant.id, batch_id=batch_id)
    assert (entry.status, entry.attempts, entry.last_status_code) == ("delivered", 4, 200)
    assert service.get(rt, tenant.id, hook.id).status == EndpointStatus.ACTIVE


def test_an_endpoint_that_keeps_failing_is_disabled_with_its_reason(rt, receiver):
    tenant, _ = create_tenant(rt.db, "t", now())
    receiver.behaviours["/down"] = Behaviour(fail_first=10**6)
    hook = service.add(rt, tenant.id, receiver.url("/down"), ALL, now())
    batch_id = final_batch(rt, tenant.id, "failed")
    t = time.time()
    outcomes = []
    for delay in (0.0, *RETRY_SCHEDULE):
        t += delay
        outcomes += deliver_due(rt, t)
    assert outcomes == ["retry"] * (ATTEMPTS - 1) + ["failed"]
    assert sum(RETRY_SCHEDULE) > 24 * 3600  # retried over a day
    [entry] = service.deliveries(rt, tenant.id, batch_id=batch_id)
    assert (entry.status, entry.attempts, entry.last_error) == ("failed", ATTEMPTS, "HTTP 500")
    endpoint = service.get(rt, tenant.id, hook.id)
    assert endpoint.status == EndpointStatus.DISABLED
    assert f"{ATTEMPTS} attempts" in endpoint.disabled_reason and "HTTP 500" in endpoint.disabled_reason
    # disabled: the next batch's event is not recorded for it, nothing more is sent
    final_batch(rt, tenant.id, "completed")
    assert pending(rt, t + 10**6) == [] and len(receiver.at("/down")) == ATTEMPTS
    # enabled again by its tenant: the next batch's event goes out
    receiver.behaviours["/down"] = Behaviour()
    service.set_enabled(rt, tenant.id, hook.id, True, now())
    final_batch(rt, tenant.id, "cancelled")
    assert deliver_due(rt, time.time()) == ["delivered"]


def test_a_lost_task_is_only_a_delay_the_tick_sends_it_again(rt, receiver):
    tenant, _ = create_tenant(rt.db, "t", now())
    service.add(rt, tenant.id, receiver.url("/t"), ALL, now())
    final_batch(rt, tenant.id, "expired")
    t = time.time()
    [sent] = send_due(rt, t)  # its message is lost: no worker takes it
    assert send_due(rt, t + 1) == []  # in flight as far as anyone knows: not sent twice
    assert send_due(rt, t + lease_seconds(rt) + 1) == [sent]  # a lease later, the tick sends it again
    assert deliver(rt, sent, time.time()) == "delivered" and len(receiver.at("/t")) == 1


def test_a_sender_that_read_a_delivery_before_its_attempt_ended_sends_nothing(rt, receiver):
    """The tick reads the due deliveries, then marks them sent: an attempt that ends between the two
    (a finalization's task delivered it, or put its retry off) leaves the tick nothing to send, and
    a retry's time is not held back by a send that never happened."""
    tenant, _ = create_tenant(rt.db, "t", now())
    receiver.behaviours["/t"] = Behaviour(fail_first=1)
    service.add(rt, tenant.id, receiver.url("/t"), ALL, now())
    final_batch(rt, tenant.id, "completed")
    t = time.time()
    [read_by_tick] = pending(rt, t)  # the tick's read
    assert deliver(rt, read_by_tick, t) == "retry"  # another sender's task attempted it meanwhile
    assert mark_sent(rt, [read_by_tick], t) == []  # not due: no task, no mark
    with rt.db.read() as s:
        retry_at = s.get(WebhookDelivery, read_by_tick).next_attempt_at
    assert send_due(rt, retry_at) == [read_by_tick]  # sent at its time
    assert deliver(rt, read_by_tick, retry_at) == "delivered"
    assert mark_sent(rt, [read_by_tick], retry_at + lease_seconds(rt) + 1) == []  # delivered: never again
    assert len(receiver.at("/t")) == 2


def test_redirects_are_not_followed_and_answers_are_read_bounded(rt, receiver):
    receiver.behaviours["/moved"] = Behaviour(status=302)
    receiver.behaviours["/big"] = Behaviour(body_bytes=20 * 1024 * 1024)
    assert post(receiver.url("/moved"), {}, b"{}", 2.0, True) == (302, "HTTP 302")
    started = time.monotonic()
    assert post(receiver.url("/big"), {}, b"{}", 2.0, True) == (200, None)  # 64 KiB read, then closed
    assert time.monotonic() - started < 1.0


def test_a_private_target_is_refused_unless_the_operator_allows_it(rt, receiver, caplog):
    body = b"{}"
    with caplog.at_level(logging.WARNING, logger="workers.outbound_http"):
        status, error = post(receiver.url("/x").replace("127.0.0.1", "localhost"), {}, body, 2.0, False, "t1")
    assert status is None and "refused" in error and "not a public address" in error
    # the tenant is not told how the deployment's names resolve; the operator's log says
    assert "localhost resolves to an address that is not allowed" in error
    assert "127.0.0.1" not in error and "::1" not in error
    assert any("localhost resolves to" in r.getMessage() and "t1" in r.getMessage() for r in caplog.records)
    assert any(a in r.getMessage() for r in caplog.records for a in ("127.0.0.1", "::1"))
    assert receiver.at("/x") == []  # not even a connection
    assert post(receiver.url("/x"), {}, body, 2.0, True) == (200, None)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_slow_receiver_does_not_hold_up_other_tenants(rt, receiver):
    """A real webhook worker (the role's threads pool, 3 threads) takes the tasks from Redis. The
    slow tenant has three receivers that hang past the 2 s limit; it holds two threads at most
    (FREIGHT_WEBHOOK_TENANT_CONCURRENCY), one endpoint one each, and the fast tenant's deliveries
    go through the third at once."""
    slow, _ = create_tenant(rt.db, "slow", now())
    fast, _ = create_tenant(rt.db, "fast", now())
    slow_paths = ("/slow1", "/slow2", "/slow3")
    for path in slow_paths:
        receiver.behaviours[path] = Behaviour(wait=6.0)  # past the 2 s limit: cut off, retried later
        service.add(rt, slow.id, receiver.url(path), ALL, now())
    service.add(rt, fast.id, receiver.url("/fast"), ALL, now())
    for _ in range(2):
        final_batch(rt, slow.id, "failed")

    def slow_arrivals(before: float = float("inf")) -> list[str]:
        return [r.path for r in receiver.received if r.path in slow_paths and r.arrived <= before]

    # the session's tests share one broker: deliveries other tests sent are in the queue, named by
    # their own databases' ids, which are this test's too (the worker took two of them for this
    # test's first deliveries, once, and send_due found only the third)
    with rt.queue.celery.connection_for_write() as conn:
        conn.default_channel.client.delete(WEBHOOK_QUEUE)
    app = make_celery(replace(rt.settings, webhook_concurrency=3))
    with start_worker(app, pool="threads", concurrency=3, perform_ping_check=False, queues=[WEBHOOK_QUEUE],
                      shutdown_timeout=20):  # fmt: skip
        assert len(send_due(rt, time.time())) == 3  # one per endpoint; the third waits its turn
        receiver.wait_for(lambda: len(slow_arrivals()) == 2)  # two threads held by the slow tenant
        started = time.time()
        fast_batches = [final_batch(rt, fast.id, "completed") for _ in range(3)]
        for batch_id in fast_batches:  # what the finalize task does after its commit
            send_due(rt, time.time(), batch_id)
        receiver.wait_for(lambda: sum(1 for r in receiver.at("/fast") if r.answered) == 3, timeout=10)
        fast_done = max(r.answered for r in receiver.at("/fast"))
        # all three delivered while the slow receivers still hang (they are cut at 2 s)
        assert fast_done - started < 2.0, (
            fast_done - started,
            [(r.path, r.arrived - started) for r in receiver.received],
        )
        assert len(slow_arrivals(fast_done)) == 2  # never more than two of the slow tenant's at once
        receiver.wait_for(
            lambda: any(d.attempts for d in service.deliveries(rt, slow.id) if d.last_error), timeout=10
        )
    cut = [d for d in service.deliveries(rt, slow.id) if d.attempts]  # the first, and any ended since
    assert cut and all(d.status == "pending" and "no answer within 2 s" in d.last_error for d in cut)
    assert [d.status for d in service.deliveries(rt, fast.id)] == ["delivered"] * 3


def test_a_rotated_secret_signs_beside_the_new_one_for_the_grace_only(rt, receiver):
    tenant, _ = create_tenant(rt.db, "t", now())
    hook = service.add(rt, tenant.id, receiver.url("/r"), ALL, now())
    old, old_id, at = hook.secret, hook.id, now()
    rotated = service.rotate_secret(rt, tenant.id, old_id, at)
    new, until = rotated.secret, rotated.previous_secret_until
    assert new != old and new.startswith("whsec_") and until == at + rt.settings.webhook_secret_grace_seconds
    # during the grace: two v1 signatures, a receiver checking either secret accepts it
    final_batch(rt, tenant.id, "completed")
    assert deliver_due(rt, time.time()) == ["delivered"]
    [during] = receiver.at("/r")
    assert len(during.headers["webhook-signature"].split()) == 2
    assert verify(old, during.headers, during.body) and verify(new, during.headers, during.body)
    # after it: the new secret alone
    final_batch(rt, tenant.id, "failed")
    assert deliver_due(rt, until + 1) == ["delivered"]
    after = receiver.at("/r")[1]
    assert len(after.headers["webhook-signature"].split()) == 1
    assert verify(new, after.headers, after.body) and not verify(old, after.headers, after.body)
    # a second rotation: the first secret is gone at once, the second signs through the grace
    third = service.rotate_secret(rt, tenant.id, old_id, now()).secret
    final_batch(rt, tenant.id, "cancelled")
    assert deliver_due(rt, time.time()) == ["delivered"]
    last = receiver.at("/r")[2]
    assert verify(third, last.headers, last.body) and verify(new, last.headers, last.body)
    assert not verify(old, last.headers, last.body)


def test_sealed_secrets_sign_as_the_plain_ones_did_across_a_key_rotation(rt, receiver):
    old_key, new_key = secret_box.new_key(), secret_box.new_key()
    keyed = Runtime(replace(rt.settings, secrets_keys=old_key))
    try:
        tenant, _ = create_tenant(keyed.db, "t", now())
        hook = service.add(keyed, tenant.id, receiver.url("/r"), ALL, now())
        first = hook.secret
        second = service.rotate_secret(keyed, tenant.id, hook.id, now()).secret
    finally:
        keyed.db.dispose()
    with rt.db.read() as s:
        row = s.get(WebhookEndpoint, hook.id)
    assert row.secret.startswith("fernet:") and row.previous_secret.startswith("fernet:")
    assert first not in row.secret + row.previous_secret and second not in row.secret + row.previous_secret
    # the operator rotates the key: the new one first, the old kept for reading, then resealed
    rotating = Runtime(replace(rt.settings, secrets_keys=f"{new_key},{old_key}"))
    try:
        assert reseal_all(rotating.db, rotating.secrets, plain_only=False) == 2
    finally:
        rotating.db.dispose()
    rotated = Runtime(replace(rt.settings, secrets_keys=new_key))  # the old key dropped
    try:
        final_batch(rotated, tenant.id, "completed")
        assert deliver_due(rotated, time.time()) == ["delivered"]
    finally:
        rotated.db.dispose()
    [got] = receiver.at("/r")
    assert verify(first, got.headers, got.body) and verify(second, got.headers, got.body)


def test_a_receiver_answering_410_gone_disables_its_endpoint_at_once(rt, receiver):
    tenant, _ = create_tenant(rt.db, "t", now())
    receiver.behaviours["/gone"] = Behaviour(status=410)
    hook = service.add(rt, tenant.id, receiver.url("/gone"), ALL, now())
    other = service.add(rt, tenant.id, receiver.url("/ok"), ALL, now())
    first = final_batch(rt, tenant.id, "completed")
    second = final_batch(rt, tenant.id, "failed")
    t = time.time()
    # one pass over the due ones: the first to /gone fails, the second to it is not attempted
    assert sorted(map(str, deliver_due(rt, t))) == ["None", "delivered", "delivered", "failed"]
    # one attempt, no retry: the delivery failed and the endpoint is disabled saying why
    assert [r.status for r in receiver.at("/gone")] == [410]
    assert len(receiver.at("/ok")) == 2  # the tenant's other endpoint goes on
    [gone] = [d for d in service.deliveries(rt, tenant.id, batch_id=first) if d.endpoint_id == hook.id]
    assert (gone.status, gone.attempts, gone.last_status_code) == ("failed", 1, 410)
    endpoint = service.get(rt, tenant.id, hook.id)
    assert endpoint.status == EndpointStatus.DISABLED and "410 Gone" in endpoint.disabled_reason
    assert service.get(rt, tenant.id, other.id).status == EndpointStatus.ACTIVE
    # the second batch's delivery to it waits, never sent, even long after every retry time
    [waiting] = [d for d in service.deliveries(rt, tenant.id, batch_id=second) if d.endpoint_id == hook.id]
    assert waiting.status == "pending"
    later = t + sum(RETRY_SCHEDULE) + 1
    assert send_due(rt, later) == [] and deliver(rt, waiting.id, later) is None
    assert len(receiver.at("/gone")) == 1


def test_an_attempt_whose_leases_were_taken_over_leaves_them_to_the_new_holder(rt, receiver):
    """The delivery's and the endpoint's leases are released under the claim's time: an attempt
    that outlived its lease records its outcome but frees neither lease of the attempt that took
    them over, which holds the endpoint until it ends."""
    tenant, _ = create_tenant(rt.db, "t", now())
    hook = service.add(rt, tenant.id, receiver.url("/t"), ALL, now())
    final_batch(rt, tenant.id, "completed")
    [delivery_id] = pending(rt, time.time())
    t0 = time.time()
    stale = _claim(rt, delivery_id, t0)
    assert stale is not None and _claim(rt, delivery_id, t0 + 1) is None  # held
    t1 = t0 + lease_seconds(rt) + 1
    fresh = _claim(rt, delivery_id, t1)  # the first ran out: taken over
    assert fresh is not None

    def leases() -> tuple[float | None, float | None, int]:
        with rt.db.read() as s:
            delivery = s.get(WebhookDelivery, delivery_id)
            return delivery.lease_at, s.get(WebhookEndpoint, hook.id).busy_at, delivery.attempts

    assert _record(rt, delivery_id, stale, t0, 500, "HTTP 500") == "retry"
    assert leases() == (t1, t1, 1)  # its outcome counted, the new holder's leases kept
    assert _record(rt, delivery_id, fresh, t1, 200, None) == "delivered"
    assert leases() == (None, None, 1)


def test_a_disabled_tenants_deliveries_end_unsent_with_the_reason(rt, receiver):
    alpha, _ = create_tenant(rt.db, "alpha", now())
    beta, _ = create_tenant(rt.db, "beta", now())
    service.add(rt, alpha.id, receiver.url("/alpha"), ALL, now())
    service.add(rt, beta.id, receiver.url("/beta"), ALL, now())
    before = final_batch(rt, alpha.id, "completed")  # pending when its tenant is disabled
    disable_tenant(rt.db, "alpha", now())
    during = final_batch(rt, alpha.id, "failed")  # a batch that ends after: recorded, never sent
    final_batch(rt, beta.id, "completed")
    t = time.time()
    assert sorted(map(str, deliver_due(rt, t))) == ["None", "None", "delivered"]
    assert receiver.at("/alpha") == [] and len(receiver.at("/beta")) == 1
    for batch_id in (before, during):
        [entry] = service.deliveries(rt, alpha.id, batch_id=batch_id)
        assert (entry.status, entry.attempts, entry.last_error) == ("failed", 0, TENANT_DISABLED)
    assert pending(rt, t + sum(RETRY_SCHEDULE)) == [] and send_due(rt, t + 10**6) == []
    assert receiver.at("/alpha") == []
    # enabled again: the batches that end from now on are delivered (those ended meanwhile stay so)
    enable_tenant(rt.db, "alpha")
    after = final_batch(rt, alpha.id, "completed")
    assert [str(x) for x in deliver_due(rt, time.time())] == ["delivered"]
    [entry] = service.deliveries(rt, alpha.id, batch_id=after)
    assert entry.status == "delivered" and len(receiver.at("/alpha")) == 1


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_two_claims_racing_on_postgresql_keep_the_tenant_cap(settings):
    """Two workers claim deliveries to two endpoints of a tenant whose cap is one: both reach the
    claim while a third transaction holds the tenant's row, so neither has counted yet; once it
    ends they run one after the other and only the first gets the place."""
    rt = Runtime(replace(settings, webhook_allow_private_targets=True, webhook_tenant_concurrency=1))
    try:
        tenant, _ = create_tenant(rt.db, "t", now())
        for path in ("/a", "/b"):
            service.add(rt, tenant.id, f"http://127.0.0.1:9{path}", ALL, now())
        final_batch(rt, tenant.id, "completed")
        t = time.time()
        ids = pending(rt, t)
        assert len(ids) == 2
        claims: dict[int, object] = {}
        racers = [threading.Thread(target=lambda i=i: claims.__setitem__(i, _claim(rt, i, t))) for i in ids]
        with rt.db.write() as s:
            s.get(Tenant, tenant.id, with_for_update={"key_share": True})
            for racer in racers:
                racer.start()
            waiting = text(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            deadline = time.monotonic() + 10
            while True:  # both claims wait on the tenant's row, neither has read the count
                with rt.db.read() as r:
                    if r.scalar(waiting) == 2:
                        break
                assert time.monotonic() < deadline, "the claims did not wait for the tenant's row"
                time.sleep(0.02)
        for racer in racers:
            racer.join(timeout=10)
        assert sorted(c is not None for c in claims.values()) == [False, True]  # the cap, exactly
        with rt.db.read() as s:
            busy = s.scalar(
                select(func.count()).select_from(WebhookEndpoint).where(WebhookEndpoint.busy_at.is_not(None))
            )
        assert busy == 1
    finally:
        rt.db.dispose()
