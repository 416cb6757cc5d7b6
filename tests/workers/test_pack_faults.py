"""An engine worker's pack path through faults that once stopped a batch for good (a CI run: a
batch ``in_progress`` 400 s after an object store outage).

Two faults met there. A pack's units were claimed before their rows were read, but heartbeated
only once the rows were on the feed, so reads retrying through a store outage longer than a lease
lost every claim of the pack: the units ran twice and used up their attempts. And a unit lost that
way could be claimed again by the same process while its first attempt's requests were still in
the engine, under the same engine key: the engine refused the second and the worker died.

Against the session's real vLLM engine on the demo model, a real database and a SeaweedFS of this
module's own that the tests stop and start again. The first two are the ``pack_store_outage``
reliability scenario (docs/reliability.md): each adds its figures to the one record.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

import pytest

from api.services.tenants import create_tenant
from storage.lifecycle import NO_LIVE_COUNTS, move_units
from storage.models import UnitStatus, WorkUnit
from storage.objectstore import ObjectStoreError
from storage.runtime import Runtime
from storage.settings import Settings
from tests.conftest import Weed, now
from tests.factories import batch_units, chat_line, validated_batch, wait_units_done
from workers.dispatcher import TickReport, redeliver_stale
from workers.engine import Engine
from workers.pack_feed import PackOrder

LEASE_SECONDS = 3.0  # 12 heartbeats of 0.25 s: a pass slowed by a second or two under load keeps it
# the pack_store_outage scenario's counts and figures, both tests' (each records the whole so far)
PACK_COUNTS: Counter[str] = Counter()
PACK_FIGURES: dict[str, object] = {}


def record_pack_outage(reliability, expected: list[str], ran: list[str], **figures: object) -> None:
    """Add a test's lost and duplicated custom_ids and its figures to the scenario's record."""
    PACK_COUNTS.update(lost=len(set(expected) - set(ran)), duplicated=len(ran) - len(set(ran)))
    PACK_FIGURES.update(figures)
    reliability.record(
        "pack_store_outage", lost=PACK_COUNTS["lost"], duplicated=PACK_COUNTS["duplicated"], server_errors=0,
        **PACK_FIGURES,
    )  # fmt: skip


def output_ids(rt: Runtime, done: list[WorkUnit]) -> list[str]:
    """The custom_ids in the units' recorded output files, repeats kept."""
    ids = []
    for unit in done:
        assert unit.output_key is not None
        with rt.store.open(unit.output_key) as f:
            ids += [json.loads(line)["custom_id"] for line in f.read().splitlines()]
    return ids


@pytest.fixture
def s3_runtime(settings: Settings, weed: Weed, monkeypatch: pytest.MonkeyPatch) -> Iterator[Runtime]:
    """Freight's store on this module's SeaweedFS, with leases short enough that a read outlives one."""
    for name, value in weed.credentials().items():
        monkeypatch.setenv(name, value)
    bucket = weed.handle.create_bucket(f"packs-{uuid.uuid4().hex[:8]}")
    rt = Runtime(
        replace(
            settings,
            object_store_url=f"s3://{bucket}/freight",
            s3_endpoint_url=weed.handle.endpoint_url,
            lease_seconds=LEASE_SECONDS,
            heartbeat_seconds=0.25,
            unit_size=2,
        )
    )
    yield rt
    rt.db.dispose()


def lines(tag: str, n: int, tokens: int = 4) -> list[dict]:
    return [
        chat_line(f"{tag}-{i}", f"Row {i} of {tag}", max_tokens=tokens, min_tokens=tokens) for i in range(n)
    ]


@pytest.mark.reliability
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the store's fault, not the database's
def test_claims_are_heartbeated_while_their_rows_are_read_through_a_store_outage(
    s3_runtime: Runtime, weed: Weed, vllm_engine: Engine, runner_of, reliability
) -> None:
    """The store is down for three leases when a pack comes: its reads retry until the store is
    back, the dispatcher's redelivery (run every quarter lease meanwhile) takes none of its units,
    and each unit runs once, on its first attempt."""
    rt = s3_runtime
    runner = runner_of(rt, vllm_engine)
    tenant, _ = create_tenant(rt.db, "t", now())
    batch_id = validated_batch(rt, tenant.id, lines("outage", 6))
    ids = [u.id for u in batch_units(rt, batch_id)]
    assert len(ids) == 3

    redelivered: list[int] = []
    stop = threading.Event()

    def dispatcher() -> None:
        while not stop.wait(LEASE_SECONDS / 4):
            report = TickReport()
            redeliver_stale(rt, time.time(), report)
            redelivered.extend(report.redelivered)

    weed.stop()
    restart = threading.Timer(3 * LEASE_SECONDS, weed.start)
    ticks = threading.Thread(target=dispatcher, daemon=True)
    restart.start()
    ticks.start()
    try:
        began = time.monotonic()
        assert runner.run_pack(PackOrder("pack-outage", ids)) == len(ids)  # returns once the rows are read
        read_wait_s = time.monotonic() - began
        assert read_wait_s >= 2 * LEASE_SECONDS  # the reads did wait for the store
        done = wait_units_done(rt, runner, batch_id)
    finally:
        restart.join()
        stop.set()
        ticks.join()
    record_pack_outage(
        reliability, [x["custom_id"] for x in lines("outage", 6)], output_ids(rt, done),
        read_wait_s=round(read_wait_s, 1), lease_s=LEASE_SECONDS, redelivered_units=len(redelivered),
        read_units=len(done), read_attempts_max=max(u.attempts for u in done),
    )  # fmt: skip
    assert redelivered == []
    assert [u.attempts for u in done] == [1, 1, 1]
    assert sorted(output_ids(rt, done)) == sorted(x["custom_id"] for x in lines("outage", 6))


@pytest.mark.reliability
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_pack_whose_rows_stay_unreadable_is_given_back_without_using_attempts(
    s3_runtime: Runtime, weed: Weed, vllm_engine: Engine, runner_of, reliability
) -> None:
    """An outage longer than the store's retry deadline: the pack fails as an outage (the task's
    policy sends it again later), its units go back to pending with no attempt counted and no
    worker, and the next pack runs them once."""
    rt = Runtime(replace(s3_runtime.settings, object_store_retry_seconds=1.0))
    try:
        runner = runner_of(rt, vllm_engine)
        tenant, _ = create_tenant(rt.db, "t", now())
        batch_id = validated_batch(rt, tenant.id, lines("down", 4))
        ids = [u.id for u in batch_units(rt, batch_id)]
        weed.stop()
        try:
            with pytest.raises(ObjectStoreError):
                runner.run_pack(PackOrder("pack-down", ids))
        finally:
            weed.start()
        back = batch_units(rt, batch_id)
        assert [(u.status, u.attempts, u.worker, u.pack_id) for u in back] == [
            (UnitStatus.PENDING, 0, None, None)
        ] * len(ids)
        assert runner.failure is None and not runner.busy()

        assert runner.run_pack(PackOrder("pack-again", ids)) == len(ids)
        done = wait_units_done(rt, runner, batch_id)
        record_pack_outage(
            reliability, [x["custom_id"] for x in lines("down", 4)], output_ids(rt, done),
            retry_deadline_s=rt.settings.object_store_retry_seconds,
            given_back_units=sum(u.status == UnitStatus.PENDING and u.worker is None for u in back),
            given_back_attempts=sum(u.attempts for u in back),
            given_back_attempts_max=max(u.attempts for u in done),
        )  # fmt: skip
        assert [u.attempts for u in done] == [1] * len(ids)
        assert sorted(output_ids(rt, done)) == sorted(x["custom_id"] for x in lines("down", 4))
    finally:
        rt.db.dispose()


def test_a_unit_lost_and_claimed_again_by_the_same_process_runs_once(
    settings: Settings, vllm_engine: Engine, runner_of
) -> None:
    """The dispatcher takes a running unit back (as when its lease ran out) and the same process
    claims it again while the first attempt's requests are still in the engine: both attempts
    are in the engine at once under keys of their own, the first is found lost and discarded, the
    second records every line once."""
    rt = Runtime(replace(settings, heartbeat_seconds=0.25))
    try:
        runner = runner_of(rt, vllm_engine)
        tenant, _ = create_tenant(rt.db, "t", now())
        # 320 tokens each: the first attempt is still in the engine when it is taken back (with 48,
        # a fast host's engine ran all six in 0.18 s, and the unit was recorded first)
        batch_id = validated_batch(rt, tenant.id, lines("again", 6, tokens=320))
        ids = [u.id for u in batch_units(rt, batch_id)]
        assert runner.run_pack(PackOrder("pack-first", ids)) == len(ids)
        deadline = time.monotonic() + 30
        while vllm_engine.load == 0:  # the first attempt's requests reach the engine
            assert time.monotonic() < deadline and runner.failure is None
            time.sleep(0.005)
        with rt.db.write() as s:  # what the dispatcher's redelivery does to a unit it took back
            taken = move_units(
                s,
                WorkUnit.id.in_(ids),
                from_=UnitStatus.RUNNING,
                to=UnitStatus.PENDING,
                worker=None,
                pack_id=None,
                **NO_LIVE_COUNTS,
            )
        assert taken == len(ids)
        assert runner.run_pack(PackOrder("pack-second", ids)) == len(ids)
        done = wait_units_done(rt, runner, batch_id)
        assert [u.attempts for u in done] == [2] * len(ids)
        assert sum(u.completed for u in done) == 6
        assert sorted(output_ids(rt, done)) == sorted(x["custom_id"] for x in lines("again", 6))
    finally:
        rt.db.dispose()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # asks live in the broker
def test_a_worker_asks_for_a_pack_only_while_it_waits_for_one_and_again_after_the_broker_lost_it(
    settings: Settings, vllm_engine: Engine, runner_of, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #21 s3: packs are made for the workers that ask (``workers.dispatcher.pack_depth``).
    A started worker asks; it withdraws its ask before it claims a pack's units (so the
    dispatcher never packs for it while it takes one), and asks again as the pack's task ends; its
    ask is renewed while it waits, so it outlives its lifetime, and comes back within a heartbeat
    after the broker lost it; a closed worker asks for nothing."""
    from storage.broker import ASKS_KEY
    from workers import pack_feed

    # renewed with each 0.25 s heartbeat: a lifetime of 2.5 s lapses only if the renewals stop
    rt = Runtime(replace(settings, heartbeat_seconds=0.25, ask_lifetime_seconds=2.5))
    try:
        runner = runner_of(rt, vllm_engine)

        def asking() -> bool:
            return rt.queue.asks.count("demo", time.time()) == 1

        assert asking()
        seen_in_claims: list[bool] = []
        real_claim = pack_feed.claim_unit

        def claim(*args, **kwargs):  # the real claim, noting whether the worker was asking
            seen_in_claims.append(asking())
            return real_claim(*args, **kwargs)

        monkeypatch.setattr(pack_feed, "claim_unit", claim)
        tenant, _ = create_tenant(rt.db, "t", now())
        batch_id = validated_batch(rt, tenant.id, lines("asks", 4))
        ids = [u.id for u in batch_units(rt, batch_id)]
        assert runner.run_pack(PackOrder("pack-asks", ids)) == len(ids)
        assert seen_in_claims == [False] * len(ids)
        assert asking()  # the task ends: it takes the next message, so it asks
        wait_units_done(rt, runner, batch_id)
        # renewed while it waits: alive past its lifetime
        began = time.monotonic()
        while time.monotonic() - began < 4.0:
            assert asking()
            time.sleep(0.1)
        # the broker lost its data: the ask is back within a heartbeat (and a check's period)
        with rt.queue.celery.pool.acquire(block=True) as conn:
            conn.default_channel.client.delete(ASKS_KEY + "demo")
        assert not asking()
        deadline = time.monotonic() + 5
        while not asking():
            assert time.monotonic() < deadline, "the ask did not come back"
            time.sleep(0.05)
        runner.close(5)
        assert rt.queue.asks.count("demo", time.time()) == 0
    finally:
        rt.db.dispose()
