"""The dispatcher against a real database and broker (no engine): packing across batches and
tenants, and re-sending packs whose message went with a dead worker."""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import select

from api.services.tenants import create_tenant
from storage import tick_clock
from storage.broker import VALIDATE_QUEUE
from storage.models import Batch, UnitStatus, WorkUnit
from storage.runtime import Runtime
from storage.settings import Settings
from tests.conftest import now
from tests.factories import chat_line, create, upload, upload_and_create, validated_batch
from workers import dispatcher
from workers.unit_claims import claim_unit


def submit(rt: Runtime, tenant_id: str, n: int, tag: str) -> str:
    lines = [chat_line(f"{tag}-{i}", f"{tag} {i}", max_tokens=2) for i in range(n)]
    return validated_batch(rt, tenant_id, lines, name=f"{tag}.jsonl")


def units(rt: Runtime) -> list[WorkUnit]:
    with rt.db.read() as s:
        return list(s.scalars(select(WorkUnit).order_by(WorkUnit.id)).all())


def test_small_batches_are_packed_together_and_lost_packs_are_sent_again(settings):
    rt = Runtime(replace(settings, unit_size=4, pack_requests=12, queue_depth=1, lease_seconds=30))
    try:
        a, _ = create_tenant(rt.db, "a", now())
        b, _ = create_tenant(rt.db, "b", now())
        ids = [submit(rt, a.id, 4, "a1"), submit(rt, b.id, 4, "b1"), submit(rt, a.id, 8, "a2")]
        t0 = float(now())
        report = dispatcher.tick(rt, t0)
        assert len(report.packs) == 1 and len(report.enqueued) == 3  # depth 1: one pack of 12
        queued = [u for u in units(rt) if u.status == UnitStatus.QUEUED]
        tenant_of = {ids[0]: "a", ids[1]: "b", ids[2]: "a"}
        assert {tenant_of[u.batch_id] for u in queued} == {"a", "b"}  # tenants share the pack
        assert len({u.batch_id for u in queued}) >= 2
        assert len({u.pack_id for u in queued}) == 1
        # nothing changes while the pack may still be in the broker queue
        assert dispatcher.tick(rt, t0 + 10).requeued == []
        # a lease later (no throughput measured yet) the message counts as lost: packed again
        report = dispatcher.tick(rt, t0 + 31)
        assert sorted(report.requeued) == sorted(u.id for u in queued)
        again = [u for u in units(rt) if u.status == UnitStatus.QUEUED]
        assert {u.id for u in again} == {u.id for u in queued} and again[0].pack_id != queued[0].pack_id
        assert all(u.attempts == 0 for u in again)
    finally:
        rt.db.dispose()


def test_queued_units_are_packed_again_at_once_when_the_broker_lost_its_data(settings):
    """Redis restarted without persistence: the dispatcher's marker key is gone with the queued
    messages, so the next tick packs the queued units again without waiting for a lease."""
    from storage.broker import BROKER_MARKER_KEY

    rt = Runtime(replace(settings, unit_size=4, pack_requests=8, queue_depth=1, lease_seconds=300))
    try:
        tenant, _ = create_tenant(rt.db, "a", now())
        submit(rt, tenant.id, 8, "lost")
        t0 = float(now())
        dispatcher.tick(rt, t0)
        queued = {u.id: u.pack_id for u in units(rt) if u.status == UnitStatus.QUEUED}
        assert queued and dispatcher.tick(rt, t0 + 1).requeued == []  # the marker is there
        with rt.queue.celery.connection_for_write() as conn:
            conn.default_channel.client.flushdb()  # what a restart without persistence leaves
        report = dispatcher.tick(rt, t0 + 2)
        assert sorted(report.requeued) == sorted(queued)
        again = {u.id: u.pack_id for u in units(rt) if u.status == UnitStatus.QUEUED}
        assert again.keys() == queued.keys() and not set(again.values()) & set(queued.values())
        assert dispatcher.tick(rt, t0 + 3).requeued == []  # once: the marker is back
        with rt.queue.celery.connection_for_write() as conn:
            assert conn.default_channel.client.exists(BROKER_MARKER_KEY)
    finally:
        rt.db.dispose()


def test_validation_is_sent_again_when_the_broker_lost_its_data(settings):
    rt = Runtime(settings)
    try:
        tenant, _ = create_tenant(rt.db, "a", now())
        waiting = upload_and_create(rt, tenant.id, b'{"custom_id": "x"}\n', name="v.jsonl")
        dispatcher.tick(rt, float(now()))  # sets the marker
        with rt.queue.celery.connection_for_write() as conn:
            client = conn.default_channel.client
            client.flushdb()  # the validation message is gone with the broker's data
            report = dispatcher.tick(rt, float(now()))
            assert report.revalidated == [waiting.id]
            sent = [json.loads(m)["headers"] for m in client.lrange(VALIDATE_QUEUE, 0, -1)]
        assert [(h["task"], h["argsrepr"]) for h in sent if h["task"] == "freight.validate_batch"] == [
            ("freight.validate_batch", repr([waiting.id]))
        ]
    finally:
        rt.db.dispose()


def test_a_batch_is_not_left_behind_when_the_broker_is_down(settings):
    """Creating a batch while Redis is unreachable: the client gets the broker error (the API
    answers 503) and no batch row stays ``validating`` with no task to validate it."""
    from kombu.exceptions import OperationalError

    from storage.broker import BROKER_ERRORS
    from storage.models import Batch

    down = replace(settings, broker_url="redis://127.0.0.1:1/0")  # nothing listens on port 1
    rt = Runtime(down)
    rt.queue.celery.conf.broker_transport_options = {"max_retries": 0}
    rt.queue.celery.conf.task_publish_retry = False
    try:
        tenant, _ = create_tenant(rt.db, "a", now())
        stored = upload(rt, tenant.id, b'{"custom_id": "x"}\n', "v.jsonl")
        try:
            create(rt, tenant.id, stored.id)
        except BROKER_ERRORS as exc:
            assert isinstance(exc, OperationalError | ConnectionError)
        else:
            raise AssertionError("creating a batch with the broker down did not fail")
        with rt.db.read() as s:
            assert s.scalars(select(Batch)).all() == []
    finally:
        rt.db.dispose()


def test_a_lost_units_live_counts_are_cleared(settings):
    """Heartbeats write a running unit's results so far (requests, input and output tokens); when
    its worker is lost those results are gone, so redelivery (and giving up) must not leave them in
    request_counts', the console's or finalization's sums."""
    from workers.unit_claims import UnitTally, heartbeat

    rt = Runtime(replace(settings, unit_size=4, lease_seconds=30, max_unit_attempts=2))
    try:
        tenant, _ = create_tenant(rt.db, "a", now())
        submit(rt, tenant.id, 8, "lost")
        t0 = float(now())
        first, second = units(rt)
        for attempt, unit in ((1, first), (1, second), (2, second)):
            claim = claim_unit(rt, unit.id, t0, "w:1-0a1b2c3d")
            assert claim is not None
            so_far = UnitTally(completed=3, failed=1, prompt_tokens=900, completion_tokens=120)
            heartbeat(rt, [(claim, so_far)], t0 + 1)  # mid-unit
            with rt.db.read() as s:
                beat = s.get(WorkUnit, unit.id)
                assert beat is not None
                assert (beat.completed, beat.failed, beat.prompt_tokens, beat.completion_tokens, beat.heartbeat_at) == (3, 1, 900, 120, t0 + 1)  # fmt: skip
            report = dispatcher.TickReport()
            dispatcher.redeliver_stale(rt, t0 + 32, report)
            if attempt == 1:
                assert report.redelivered == [unit.id]
        by_id = {u.id: u for u in units(rt)}
        assert by_id[first.id].status == UnitStatus.PENDING
        assert by_id[second.id].status == UnitStatus.FAILED  # lost twice: given up
        assert all(
            (u.completed, u.failed, u.prompt_tokens, u.completion_tokens) == (0, 0, 0, 0)
            for u in by_id.values()
        )
    finally:
        rt.db.dispose()


def test_finalization_starts_for_finished_batches_in_one_query(settings):
    """Only batches whose units have all finished move to finalizing; finding them takes the same
    statements however many batches are still running (it once took a count query per batch)."""
    from sqlalchemy import event, update

    from storage.models import Batch
    from storage.status import BatchStatus

    rt = Runtime(replace(settings, unit_size=4))
    statements: list[str] = []

    def count(conn, cursor, statement, *args):
        statements.append(statement)

    try:
        tenant, _ = create_tenant(rt.db, "a", now())
        done = submit(rt, tenant.id, 4, "done")
        running = [submit(rt, tenant.id, 8, f"run{i}") for i in range(2)]

        def tick_statements() -> int:
            statements.clear()
            event.listen(rt.db.engine, "before_cursor_execute", count)
            try:
                dispatcher.start_finalization(rt, now(), report)
            finally:
                event.remove(rt.db.engine, "before_cursor_execute", count)
            return len(statements)

        with rt.db.write() as s:  # every unit of `done`, and one of each running batch, finished
            s.execute(update(WorkUnit).where(WorkUnit.batch_id == done).values(status=UnitStatus.DONE))
            for batch_id in running:
                first = s.scalar(select(WorkUnit.id).where(WorkUnit.batch_id == batch_id).limit(1))
                s.execute(update(WorkUnit).where(WorkUnit.id == first).values(status=UnitStatus.DONE))
        report = dispatcher.TickReport()
        tick_statements()
        assert report.finalizing == [done]
        with rt.db.read() as s:
            status = dict(s.execute(select(Batch.id, Batch.status)).all())
        assert status[done] == BatchStatus.FINALIZING
        assert all(status[b] == BatchStatus.IN_PROGRESS for b in running)

        # `done` is sent again on every tick until a finalizer takes its lease
        few = tick_statements()
        running += [submit(rt, tenant.id, 8, f"more{i}") for i in range(6)]
        report = dispatcher.TickReport()
        assert tick_statements() == few
        assert report.finalizing == [done]
    finally:
        rt.db.dispose()


def sent_packs(rt: Runtime, model: str = "demo") -> list[list]:
    """The args of the run_pack messages waiting in a model's broker queue, oldest first."""
    import base64

    from storage.broker import model_queue

    with rt.queue.celery.connection_for_write() as conn:
        raw = conn.default_channel.client.lrange(model_queue(model), 0, -1)
    messages = [json.loads(m) for m in reversed(raw)]  # kombu pushes to the left
    return [json.loads(base64.b64decode(m["body"]))[0] for m in messages]


def packing_runtime(settings: Settings, **changes: Any) -> Runtime:
    """A runtime that packs units of 4 requests a pack at a time, its queues in Redis empty."""
    rt = Runtime(replace(settings, unit_size=4, pack_requests=4, queue_depth=1, **changes))
    with rt.queue.celery.connection_for_write() as conn:
        conn.default_channel.client.flushdb()
    return rt


def test_a_pack_says_whether_more_batches_are_still_validating(settings):
    """An idle engine worker waits a moment to merge jobs (FREIGHT_FEED_MERGE_SECONDS) only when
    the pack says batches that may be of its model were still validating when it was made."""
    rt = packing_runtime(settings)
    try:
        tenant, _ = create_tenant(rt.db, "a", now())
        first = submit(rt, tenant.id, 4, "first")
        later = upload_and_create(rt, tenant.id, [chat_line("l-0", "later", max_tokens=2)], name="l.jsonl")
        dispatcher.tick(rt, float(now()))
        assert [(args[1], args[2]) for args in sent_packs(rt)] == [([u.id for u in units(rt)], True)]
        # and when the newest batch that may be of its model was created, to the sub-second: the
        # validating one, whose model is not known yet
        with rt.db.read() as s:
            created = dict(s.execute(select(Batch.id, Batch.submitted_at)).all())
        assert created[first] < created[later.id] and sent_packs(rt)[-1][4] == created[later.id]
        from workers.validation import validate_batch

        validate_batch(rt, later.id)  # nothing validating any more
        with rt.db.write() as s:  # the first pack ran; make room in the queue for the next
            s.execute(
                WorkUnit.__table__.update().where(WorkUnit.batch_id == first).values(status=UnitStatus.DONE)
            )
        dispatcher.tick(rt, float(now()))
        assert sent_packs(rt)[-1][2] is False
        assert sent_packs(rt)[-1][4] == created[later.id]  # the newest of the model's, validated
    finally:
        rt.db.dispose()


def test_a_pack_says_more_may_come_while_an_uploaded_file_waits_for_its_batch(settings):
    """A batch file uploaded within FREIGHT_FEED_MERGE_SECONDS that no batch names yet is a batch
    on its way (a client uploads, then creates): the pack says more may come, so an idle worker
    waits for it; once a batch names the file, or the window has passed, nothing is coming and a
    job alone starts at once (workers/arrivals.py)."""
    rt = packing_runtime(settings)
    try:
        tenant, _ = create_tenant(rt.db, "a", now())
        # the file first: uploaded before the running batch or after, it is on its way all the same
        pending = upload(rt, tenant.id, [chat_line("p-0", "pending", max_tokens=2)], name="p.jsonl")
        first = submit(rt, tenant.id, 4, "first")
        dispatcher.tick(rt, float(now()))
        assert [args[2] for args in sent_packs(rt)] == [True]
        # past the window the file no longer counts: it may be kept for later
        done_with(rt, first)
        submit(rt, tenant.id, 4, "second")
        dispatcher.tick(rt, float(now()) + settings.feed_merge_seconds + 2)
        assert sent_packs(rt)[-1][2] is False
        # named by a batch (validated: nothing validating either), it is no longer on its way
        batch = create(rt, tenant.id, pending.id)
        from workers.validation import validate_batch

        validate_batch(rt, batch.id)
        done_with(rt, *(u.batch_id for u in units(rt)))
        submit(rt, tenant.id, 4, "third")
        dispatcher.tick(rt, float(now()))
        assert sent_packs(rt)[-1][2] is False
    finally:
        rt.db.dispose()


@pytest.mark.parametrize("sharing", ["tenant", "global"])
def test_another_tenants_arrivals_hold_a_pack_only_where_they_share_its_cache(settings, sharing):
    """With prefix caches per tenant (the default) another tenant's batch validating or file
    waiting for its batch shares no cache entry with a pack's requests: the pack does not say more
    may come, and that tenant's upload cannot hold up the first tenant's job. With one cache for
    all, the jobs would meet in it, and the pack says so."""
    rt = packing_runtime(settings, prefix_cache_sharing=sharing)
    try:
        a, _ = create_tenant(rt.db, "a", now())
        b, _ = create_tenant(rt.db, "b", now())
        submit(rt, a.id, 4, "first")
        upload(rt, b.id, [chat_line("b-0", "b's", max_tokens=2)], name="b.jsonl")
        upload_and_create(rt, b.id, [chat_line("b-1", "b's", max_tokens=2)], name="b2.jsonl")
        dispatcher.tick(rt, float(now()))
        assert [args[2] for args in sent_packs(rt)] == [sharing == "global"]
    finally:
        rt.db.dispose()


def done_with(rt: Runtime, *batch_ids: str) -> None:
    """These batches' units ran (room in the queue for the next pack)."""
    with rt.db.write() as s:
        s.execute(
            WorkUnit.__table__.update().where(WorkUnit.batch_id.in_(batch_ids)).values(status=UnitStatus.DONE)
        )


@pytest.mark.parametrize(("share", "urgent_units"), [(0.5, 1), (1.0, 2)])
def test_a_pack_names_the_units_urgent_within_the_tenants_share(settings, share, urgent_units):
    """Issue #19, section 3: every batch is short of slack here (FREIGHT_URGENT_SLACK_SECONDS is
    huge), yet a tenant's urgency takes it ahead only up to FREIGHT_URGENT_SHARE of the requests
    in flight while another tenant waits; the pack tells the worker which units run first, and
    the claim carries it."""
    rt = Runtime(replace(settings, unit_size=4, pack_requests=12, queue_depth=1, urgent_slack_seconds=1e9,
                         urgent_share=share))  # fmt: skip
    try:
        a, _ = create_tenant(rt.db, "a", now())
        b, _ = create_tenant(rt.db, "b", now())
        with rt.queue.celery.connection_for_write() as conn:
            conn.default_channel.client.flushdb()
        lines = [chat_line(f"a-{i}", f"a {i}", max_tokens=2) for i in range(8)]  # two units of 4
        first = validated_batch(rt, a.id, lines, name="a.jsonl", completion_window="1h")  # due first
        submit(rt, b.id, 4, "b")
        dispatcher.tick(rt, float(now()))
        [(_, unit_ids, _, urgent, _)] = sent_packs(rt)
        a_units = [u.id for u in units(rt) if u.batch_id == first]
        b_units = [u.id for u in units(rt) if u.batch_id != first]
        # b's unit is urgent too (b holds nothing); a's second only when urgency has no cap
        assert len(unit_ids) == 3 and set(urgent) == {*a_units[:urgent_units], *b_units}
        claim = claim_unit(rt, urgent[0], float(now()), "w", urgent=True)
        assert claim is not None and claim.urgent
    finally:
        rt.db.dispose()


def test_a_refill_between_ticks_keeps_urgency_and_its_cap(settings):
    """Most packs are made between ticks (a unit done, a pack taken): they carry the same urgency
    as the tick's, so a batch short of slack still goes first, and the cap still holds."""
    rt = Runtime(replace(settings, unit_size=4, pack_requests=8, queue_depth=1, urgent_slack_seconds=1e9))
    try:
        a, _ = create_tenant(rt.db, "a", now())
        b, _ = create_tenant(rt.db, "b", now())
        with rt.queue.celery.connection_for_write() as conn:
            conn.default_channel.client.flushdb()
        lines = [chat_line(f"a-{i}", f"a {i}", max_tokens=2) for i in range(8)]  # two units of 4
        validated_batch(rt, a.id, lines, name="a.jsonl", completion_window="1h")  # due first
        later = submit(rt, b.id, 4, "b")
        dispatcher.enqueue_units(rt, float(now()), dispatcher.TickReport())  # not a tick
        [(_, unit_ids, _, urgent, _)] = sent_packs(rt)
        b_unit = next(u.id for u in units(rt) if u.batch_id == later)
        # a's first unit is urgent (a held nothing), then a is over its share while b waits: b's
        # unit (urgent too, b holding nothing) goes next, and a's second waits for the next pack
        assert len(unit_ids) == 2 and b_unit in unit_ids and set(urgent) == set(unit_ids)
    finally:
        rt.db.dispose()


def test_a_refill_packs_its_own_model_and_leaves_a_packing_pass_under_way_alone(settings):
    """Issue #21 s3: a fleet refills after every unit and pack. A refill packs only the model whose
    queue a unit or pack made room in, does nothing while that queue is full, and on PostgreSQL
    steps aside while another packing pass of its model holds that model's lock (concurrent passes
    deadlocked), while a pass of another model goes on (one lock for all left queues empty)."""
    from bench.dispatcher_load import Sizes, load
    from storage.db import transaction_lock

    rt = Runtime(replace(settings, unit_size=4, pack_requests=4, queue_depth=1))
    try:
        load(rt.db, Sizes(requests=64, batches=4, tenants=2, models=2, workers=2), now(), unit_size=4)

        def queued() -> dict[str, int]:
            return {m: sum(1 for u in units(rt) if u.model == m and u.status == UnitStatus.QUEUED)
                    for m in ("m0", "m1")}  # fmt: skip

        if not rt.db.is_sqlite:  # SQLite's write transaction is the lock
            with rt.db.write() as s:
                assert transaction_lock(s, dispatcher.packing_lock("m1"))
                dispatcher.enqueue_units(rt, float(now()), dispatcher.TickReport(), model="m1")
                assert queued() == {"m0": 0, "m1": 0}
                dispatcher.enqueue_units(rt, float(now()), dispatcher.TickReport(), model="m0")
                assert queued() == {"m0": 1, "m1": 0}
        else:
            dispatcher.enqueue_units(rt, float(now()), dispatcher.TickReport(), model="m0")
        assert queued() == {"m0": 1, "m1": 0}
        assert not dispatcher.queue_has_room(rt, "m0", float(now())) and dispatcher.queue_has_room(
            rt, "m1", float(now())
        )
        dispatcher.enqueue_units(rt, float(now()), dispatcher.TickReport(), model="m0")  # full: nothing
        assert queued() == {"m0": 1, "m1": 0}
        dispatcher.enqueue_units(rt, float(now()), dispatcher.TickReport(), model="m1")
        assert queued() == {"m0": 1, "m1": 1}
    finally:
        rt.db.dispose()


def test_packs_are_made_for_the_workers_that_ask_and_no_more(settings):
    """Issue #21 s3: no pack stands in a model's queue waiting for a worker. A pass makes one pack
    per worker waiting (its ask not lapsed) less the packs already queued; a worker that takes its
    pack withdraws its ask first; an ask that lapses (its worker died) is not packed for; and
    ``FREIGHT_QUEUE_DEPTH`` packs more are kept if asked."""
    from bench.dispatcher_load import Sizes, load

    rt = Runtime(replace(settings, unit_size=4, pack_requests=4, ask_lifetime_seconds=30))
    model, holders = "m0", [f"w-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    t0 = float(now())

    def queued_packs() -> list[str]:
        return sorted({u.pack_id for u in units(rt) if u.model == model and u.status == UnitStatus.QUEUED})

    try:
        load(rt.db, Sizes(requests=64, batches=4, tenants=2, models=1, workers=1), int(t0), unit_size=4)
        assert rt.settings.queue_depth == 0  # the default
        assert dispatcher.tick(rt, t0).packs == [] and queued_packs() == []  # nobody asked
        assert not dispatcher.queue_has_room(rt, model, t0)
        for holder in holders[:2]:
            rt.queue.asks.add(model, holder, t0, 30)
        assert rt.queue.asks.count(model, t0) == 2
        report = dispatcher.tick(rt, t0)
        assert len(report.packs) == 2 and queued_packs() == sorted(report.packs)
        assert dispatcher.tick(rt, t0 + 1).packs == []  # each ask has its pack
        # the first worker takes a pack: its ask goes before its claims, and nothing more is made
        rt.queue.asks.withdraw(model, holders[0])
        taken = [u.id for u in units(rt) if u.pack_id == report.packs[0]]
        assert all(claim_unit(rt, u, t0 + 2, holders[0], pack_id=report.packs[0]) for u in taken)
        assert queued_packs() == [report.packs[1]]
        # a renewal racing that withdrawal does not bring the ask back; a live ask's is renewed
        assert not rt.queue.asks.renew(model, holders[0], t0 + 2, 30)
        assert rt.queue.asks.renew(model, holders[1], t0 + 2, 30)
        assert dispatcher.tick(rt, t0 + 2).packs == []
        # it asks again when its feed runs short: one pack, for it
        rt.queue.asks.add(model, holders[0], t0 + 3, 30)
        assert len(dispatcher.tick(rt, t0 + 3).packs) == 1
        # asks lapse: a third worker asks, the two others stop asking (they died); 31 s on, only the
        # third's ask counts, and the two packs already queued cover it
        rt.queue.asks.add(model, holders[2], t0 + 20, 30)
        assert rt.queue.asks.count(model, t0 + 34) == 1
        # a waiting worker's watcher keeps its ask: renewed while the broker has it, else made again
        assert rt.queue.asks.keep(model, holders[2], t0 + 34, 30) is False
        assert rt.queue.asks.keep(model, holders[0], t0 + 34, 30) is True  # its ask had lapsed
        assert rt.queue.asks.count(model, t0 + 60) == 2  # both good for 30 s from t0 + 34
        rt.queue.asks.withdraw(model, holders[0])
        assert not dispatcher.queue_has_room(rt, model, t0 + 34)
        # a standing queue on top of the asks, if configured
        deeper = Runtime(replace(rt.settings, queue_depth=2))
        try:
            assert len(dispatcher.tick(deeper, t0 + 34).packs) == 1  # 1 ask + 2 standing - 2 queued
        finally:
            deeper.db.dispose()
    finally:
        for holder in holders:
            rt.queue.asks.withdraw(model, holder)
        rt.db.dispose()


def late_batches(rt: Runtime, t0: int) -> list[str]:
    """Two running batches of 20 requests and an engine sample of 1 request in 100,000 s: at that
    measured rate every batch is late. Their ids, sorted."""
    from bench.dispatcher_load import Sizes, load
    from storage.models import Batch, EngineSample

    load(rt.db, Sizes(requests=40, batches=2, tenants=2, models=1, workers=1), t0, unit_size=4)
    with rt.db.write() as s:
        s.add(EngineSample(worker="w", model="m0", started_at=t0 - 10, seconds=1e5, steps=1, running_mean=1,
                           waiting_mean=0, max_num_seqs=1, prompt_tokens=0, cached_tokens=0, output_tokens=0,
                           requests=1))  # fmt: skip
        return sorted(s.scalars(select(Batch.id)).all())


def test_the_tick_sets_etas_and_flags_at_risk_without_locking_the_batches(settings):
    """assess_deadlines reads the running batches without row locks and writes the changed ETAs
    and flags in one statement: at 1 request/s every batch here is late, so each is flagged once,
    and a later tick leaves the flag's time alone."""
    from storage.models import Batch

    rt = Runtime(replace(settings, unit_size=4, pack_requests=4, queue_depth=1))
    try:
        t0 = now()
        late_batches(rt, t0)
        report = dispatcher.tick(rt, float(t0))
        with rt.db.read() as s:
            batches = s.scalars(select(Batch)).all()
        assert sorted(report.at_risk) == sorted(b.id for b in batches)
        assert all(
            b.at_risk_since == t0 and b.eta_at is not None and b.eta_at > b.expires_at for b in batches
        )
        assert dispatcher.tick(rt, float(t0 + 1)).at_risk == []
        with rt.db.read() as s:
            assert all(b.at_risk_since == t0 for b in s.scalars(select(Batch)).all())
    finally:
        rt.db.dispose()


def test_the_tick_skips_a_batch_row_a_record_holds_and_writes_it_next_time(settings):
    """A unit's record holds its batch's row until it commits. The tick's deadline pass does not
    wait for it (under 1,000 simulated workers it waited 64 s, and records of the batches it had
    already written queued behind it): the held batch keeps its old flags until the next tick."""
    from sqlalchemy import create_engine, text

    from storage.models import Batch

    if not settings.database_url.startswith("postgresql"):
        pytest.skip("SQLite has no row locks: its one writer holds them all")
    rt = Runtime(replace(settings, unit_size=4, pack_requests=4, queue_depth=1))
    other = create_engine(settings.database_url)
    try:
        t0 = now()
        held, free = late_batches(rt, t0)
        with other.connect() as record:  # a record in flight: the row locked by an UPDATE
            record.execute(text("SET lock_timeout = '20s'"))
            record.execute(
                text("UPDATE batches SET request_completed = request_completed WHERE id = :id"), {"id": held}
            )
            # the record commits 3 s later, whatever the tick does (so a tick that waits ends)
            done = threading.Timer(3.0, record.rollback)
            done.start()
            started = time.monotonic()
            report = dispatcher.tick(rt, float(t0))
            waited = time.monotonic() - started
            done.join()
            assert waited < 2.5  # it did not wait for the record
            assert report.at_risk == [free]
        with rt.db.read() as s:
            flags = dict(s.execute(select(Batch.id, Batch.at_risk_since)).all())
        assert flags == {held: None, free: t0}
        assert dispatcher.tick(rt, float(t0 + 1)).at_risk == [held]
        with rt.db.read() as s:
            assert dict(s.execute(select(Batch.id, Batch.at_risk_since)).all()) == {held: t0 + 1, free: t0}
    finally:
        other.dispose()
        rt.db.dispose()


def test_redelivery_skips_a_stale_unit_whose_row_a_worker_holds(settings):
    """A running unit past its lease whose row a transaction holds (its worker's record or
    heartbeat in flight: the worker is alive) is not redelivered and the tick does not wait for
    it; once the holder commits a fresh heartbeat it is not stale any more. Another stale unit is
    redelivered meanwhile."""
    from sqlalchemy import create_engine, text

    if not settings.database_url.startswith("postgresql"):
        pytest.skip("SQLite has no row locks: its one writer holds them all")
    rt = Runtime(replace(settings, unit_size=4, lease_seconds=30))
    other = create_engine(settings.database_url)
    try:
        tenant, _ = create_tenant(rt.db, "a", now())
        submit(rt, tenant.id, 8, "held")
        t0 = float(now())
        held, lost = units(rt)
        for unit in (held, lost):
            assert claim_unit(rt, unit.id, t0, "w:1-0a1b2c3d") is not None
        with other.connect() as beat:  # the worker's heartbeat, committed 3 s into the tick
            beat.execute(text("SET lock_timeout = '20s'"))
            beat.execute(
                text("UPDATE work_units SET heartbeat_at = :at WHERE id = :id"),
                {"at": t0 + 31, "id": held.id},
            )
            done = threading.Timer(3.0, beat.commit)
            done.start()
            report = dispatcher.TickReport()
            started = time.monotonic()
            dispatcher.redeliver_stale(rt, t0 + 32, report)
            waited = time.monotonic() - started
            done.join()
        assert waited < 2.5  # it did not wait for the worker's transaction
        assert report.redelivered == [lost.id]
        by_id = {u.id: u for u in units(rt)}
        assert by_id[held.id].status == UnitStatus.RUNNING and by_id[lost.id].status == UnitStatus.PENDING
        again = dispatcher.TickReport()
        dispatcher.redeliver_stale(rt, t0 + 33, again)  # the fresh heartbeat keeps it
        assert again.redelivered == []
    finally:
        other.dispose()
        rt.db.dispose()


def test_requeue_skips_a_queued_unit_whose_row_a_claim_holds(settings):
    """A queued unit whose pack message waited past its limit, but whose row a worker's claim
    holds right now, is being taken, not lost: the tick does not wait for the claim and leaves the
    unit to it. Another overdue unit is packed again meanwhile."""
    from sqlalchemy import create_engine, text

    if not settings.database_url.startswith("postgresql"):
        pytest.skip("SQLite has no row locks: its one writer holds them all")
    rt = Runtime(replace(settings, unit_size=4, pack_requests=4, queue_depth=2, lease_seconds=30))
    other = create_engine(settings.database_url)
    try:
        tenant, _ = create_tenant(rt.db, "a", now())
        submit(rt, tenant.id, 8, "queued")
        t0 = float(now())
        assert len(dispatcher.tick(rt, t0).enqueued) == 2
        taken, lost = units(rt)
        with other.connect() as claim:  # a worker's claim in flight, committed 3 s into the pass
            claim.execute(text("SET lock_timeout = '20s'"))
            claim.execute(
                text("UPDATE work_units SET status = 'running', worker = 'w:1-0a1b2c3d' WHERE id = :id"),
                {"id": taken.id},
            )
            done = threading.Timer(3.0, claim.commit)
            done.start()
            report = dispatcher.TickReport()
            started = time.monotonic()
            dispatcher.requeue_lost(rt, t0 + 31, report, {})
            waited = time.monotonic() - started
            done.join()
        assert waited < 2.5  # it did not wait for the claim
        assert report.requeued == [lost.id]
        by_id = {u.id: u for u in units(rt)}
        assert by_id[taken.id].status == UnitStatus.RUNNING
        assert by_id[lost.id].status == UnitStatus.PENDING and by_id[lost.id].pack_id is None
    finally:
        other.dispose()
        rt.db.dispose()


def test_a_tenant_of_n128_lines_does_not_crowd_out_one_of_single_lines(settings):
    """Issue #49 part 4: the dispatcher shares by work, not lines. Tenant heavy's lines ask for 128
    sequences each, light's for one: counted by lines the two took turns (4 units each of the first
    8, 128 : 1 in sequences); weighed by the work validation stored on each unit, light's units go
    until its work packed reaches heavy's, and the loads the next pass starts from are work."""
    rt = Runtime(replace(settings, unit_size=4, pack_requests=4, queue_depth=8))
    try:
        heavy, _ = create_tenant(rt.db, "heavy", now())
        light, _ = create_tenant(rt.db, "light", now())
        with rt.queue.celery.connection_for_write() as conn:
            conn.default_channel.client.flushdb()
        lines = [chat_line(f"h-{i}", f"h {i}", max_tokens=2, n=128) for i in range(32)]
        heavy_batch = validated_batch(rt, heavy.id, lines, name="heavy.jsonl")
        light_batch = submit(rt, light.id, 32, "light")
        made = units(rt)
        tenant_of = {heavy_batch: "heavy", light_batch: "light"}
        # what validation stored: the sequences asked for, and the work (prompt once + 2 tokens a sequence)
        assert {u.sequences for u in made if tenant_of[u.batch_id] == "heavy"} == {4 * 128}
        assert {u.sequences for u in made if tenant_of[u.batch_id] == "light"} == {4}
        for u in made:
            n = 128 if tenant_of[u.batch_id] == "heavy" else 1
            assert u.work == u.planned_prompt_tokens + 4 * n * 2
        heavy_unit = max(u.work for u in made if tenant_of[u.batch_id] == "heavy")
        light_unit = max(u.work for u in made if tenant_of[u.batch_id] == "light")
        assert heavy_unit > 7 * light_unit  # so 7 light units weigh less than one heavy unit
        dispatcher.tick(rt, float(now()))
        queued = [u for u in units(rt) if u.status == UnitStatus.QUEUED]
        assert len(queued) == 8
        by_tenant = {t: [u for u in queued if tenant_of[u.batch_id] == t] for t in ("heavy", "light")}
        assert len(by_tenant["heavy"]) == 1 and len(by_tenant["light"]) == 7
        work = {t: sum(u.work for u in us) for t, us in by_tenant.items()}
        assert work["light"] <= work["heavy"]  # light still has the lesser share: it is next
        with rt.db.read() as s:
            loads = dispatcher.in_flight(s, "demo", with_tenants=True)
        assert loads.model_tenants == {heavy.id: work["heavy"], light.id: work["light"]}
        assert loads.tenants == loads.model_tenants
        assert loads.batches == {heavy_batch: work["heavy"], light_batch: work["light"]}
    finally:
        rt.db.dispose()


def test_each_tick_records_when_it_completed_and_the_clock_never_goes_back(settings):
    rt = Runtime(settings)
    try:
        with rt.db.read() as s:
            assert tick_clock.last_tick(s) is None  # before the first tick
        before = time.time()
        dispatcher.tick(rt, float(now()))
        with rt.db.read() as s:
            first = tick_clock.last_tick(s)
        assert first is not None and before <= first <= time.time()
        with rt.db.write() as s:  # a slower tick that finished earlier does not move it back
            tick_clock.record_tick(s, first - 60)
        with rt.db.read() as s:
            assert tick_clock.last_tick(s) == first
        dispatcher.tick(rt, float(now()))
        with rt.db.read() as s:
            assert tick_clock.last_tick(s) >= first
    finally:
        rt.db.dispose()
