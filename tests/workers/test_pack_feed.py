"""The engine worker's feed on a real database, store and broker, with no engine: a pack's units
claimed, their rows merged onto the elevator feed, the ask for the next pack, a pack whose rows
cannot be read, and whether an idle engine waits for more packs (``PackFeed.gathering``)."""

from __future__ import annotations

import queue
import time
import uuid
from dataclasses import replace

import pytest
from sqlalchemy import select

from api.services.tenants import create_tenant
from storage.models import UnitStatus, WorkUnit
from storage.objectstore import ObjectNotFound
from storage.runtime import Runtime
from storage.settings import Settings
from storage.shards import ShardRow
from tests.conftest import now
from tests.factories import batch_units, chat_line, validated_batch
from workers.pack_feed import PackFeed, PackOrder, feed_key
from workers.runner_state import ActiveUnit, RunnerState

HOLDER = "feed-test:1"


def lines(tag: str, n: int) -> list[dict]:
    return [chat_line(f"{tag}-{i}", f"Row {i} of {tag}", max_tokens=4) for i in range(n)]


def feed_on(
    rt: Runtime, max_num_seqs: int = 8
) -> tuple[PackFeed, RunnerState, queue.Queue[ActiveUnit | None]]:
    state = RunnerState()
    finished: queue.Queue[ActiveUnit | None] = queue.Queue()
    # a model name of the test's own: asks live in the shared broker
    return PackFeed(rt, state, finished, f"m-{uuid.uuid4().hex[:8]}", HOLDER, max_num_seqs), state, finished


def drained(feed: PackFeed) -> list[tuple[ActiveUnit, ShardRow]]:
    """Everything on the feed, in the order the engine loop would pop it."""
    out = []
    while feed.requests:
        out.append(feed.requests.pop())
    return out


def test_a_pack_is_claimed_and_merged_onto_the_feed_urgent_first_then_in_prefix_order(
    settings: Settings,
) -> None:
    """run_pack claims every unit of the pack under this process's holder (recording the pack),
    puts every row on the feed once (the urgent unit's first, the rest in prompt-key order), asks
    for the next pack as it returns, and claims nothing a second time."""
    rt = Runtime(replace(settings, unit_size=2))
    try:
        tenant, _ = create_tenant(rt.db, "t", now())
        batch_id = validated_batch(rt, tenant.id, lines("p", 6))
        ids = [u.id for u in batch_units(rt, batch_id)]
        feed, state, finished = feed_on(rt)
        assert feed.run_pack(PackOrder("pack-1", ids, urgent=[ids[-1]])) == 3
        assert rt.queue.asks.count(feed.model, time.time()) == 1  # the task ends: it asks for the next
        held = sorted(state.held(), key=lambda u: u.claim.unit_id)
        assert [u.claim.unit_id for u in held] == ids
        assert all(u.claim.token.startswith(HOLDER) and u.total == 2 for u in held)
        assert [u.claim.urgent for u in held] == [False, False, True]
        with rt.db.read() as s:
            rows = list(s.scalars(select(WorkUnit).where(WorkUnit.id.in_(ids)).order_by(WorkUnit.id)))
        assert [(r.status, r.worker, r.pack_id, r.attempts) for r in rows] == [
            (UnitStatus.RUNNING, u.claim.token, "pack-1", 1) for u in held
        ]
        order = drained(feed)
        assert sorted(r.custom_id for _, r in order) == sorted(f"p-{i}" for i in range(6))
        assert {u.claim.unit_id for u, _ in order[:2]} == {ids[-1]}  # urgent first
        rest = [feed_key(u, r) for u, r in order[2:]]
        assert rest == sorted(rest)  # one sweep up the prompt keys, across the two units
        assert feed.run_pack(PackOrder("pack-2", ids)) == 0  # running under this claim: not taken again
        assert len(state.held()) == 3 and finished.empty()
    finally:
        rt.db.dispose()


def test_a_closing_worker_takes_no_pack_and_asks_for_none(settings: Settings) -> None:
    rt = Runtime(replace(settings, unit_size=2))
    try:
        tenant, _ = create_tenant(rt.db, "t", now())
        batch_id = validated_batch(rt, tenant.id, lines("c", 2))
        ids = [u.id for u in batch_units(rt, batch_id)]
        feed, state, _ = feed_on(rt)
        state.closing.set()
        assert feed.run_pack(PackOrder("pack-c", ids)) == 0
        assert rt.queue.asks.count(feed.model, time.time()) == 0
        assert not state.busy()
        assert all(u.status != UnitStatus.RUNNING for u in batch_units(rt, batch_id))
    finally:
        rt.db.dispose()


def test_a_pack_whose_rows_are_gone_is_dropped_from_the_books_and_left_claimed_for_the_policy(
    settings: Settings,
) -> None:
    """Not an outage (its shard is gone): the units leave the worker's books (not heartbeated, not
    on the feed) but stay claimed, for the task's policy to fail (task_policy.fail_pack); the
    error goes up to the task."""
    rt = Runtime(replace(settings, unit_size=2))
    try:
        tenant, _ = create_tenant(rt.db, "t", now())
        batch_id = validated_batch(rt, tenant.id, lines("g", 4))
        units = batch_units(rt, batch_id)
        for key in {u.shard_key for u in units}:
            rt.store.delete(key)
        feed, state, _ = feed_on(rt)
        with pytest.raises(ObjectNotFound):
            feed.run_pack(PackOrder("pack-g", [u.id for u in units]))
        assert not state.busy() and not feed.requests
        assert [u.status for u in batch_units(rt, batch_id)] == [UnitStatus.RUNNING] * len(units)
        assert rt.queue.asks.count(feed.model, time.time()) == 1  # it takes the next message all the same
    finally:
        rt.db.dispose()


def test_an_idle_engine_gathers_packs_while_more_may_come_never_past_the_window_or_with_urgent_work(
    settings: Settings,
) -> None:
    """``gathering`` with the pack's word that more may come: it waits (the gather begins now),
    until the merge window from the first wait has passed; nothing to wait for with an empty feed,
    an urgent request waiting, or a closing worker (the gather's start is kept as it was, or begins
    now where it had not: the engine loop logs every idle start with the wait it took)."""
    rt = Runtime(replace(settings, unit_size=2, feed_merge_seconds=0.3, feed_settle_seconds=0.0))
    try:
        tenant, _ = create_tenant(rt.db, "t", now())
        ids = [u.id for u in batch_units(rt, validated_batch(rt, tenant.id, lines("w", 4)))]
        feed, state, _ = feed_on(rt)
        assert feed.gathering(None) == (False, None)  # an empty feed: nothing to gather for
        feed.run_pack(PackOrder("pack-w", ids[:1], more_coming=True))
        began = time.monotonic()
        waited, since = feed.gathering(None)
        assert waited and since is not None and began <= since <= time.monotonic()
        assert feed.gathering(since - 0.3) == (False, since - 0.3)  # the merge window is over
        state.closing.set()
        assert feed.gathering(since) == (False, since)
        state.closing.clear()
        feed.run_pack(PackOrder("pack-u", ids[1:], urgent=ids[1:]))
        began = time.monotonic()
        waited, since = feed.gathering(None)  # urgent work starts at once
        assert not waited and since is not None and began <= since <= time.monotonic()
    finally:
        rt.db.dispose()


def test_requests_that_had_their_wait_are_not_waited_for_again_until_a_new_pack_comes(
    settings: Settings,
) -> None:
    """An engine the KV gate empties between requests finds the feed's next ones waiting each time:
    once it has started on them, a pack's word that more may come (stale: the batch it meant
    had been packed already) holds no later start, until another pack comes with the word."""
    rt = Runtime(replace(settings, unit_size=2, feed_merge_seconds=2.0, feed_settle_seconds=0.0))
    try:
        tenant, _ = create_tenant(rt.db, "t", now())
        ids = [u.id for u in batch_units(rt, validated_batch(rt, tenant.id, lines("k", 6)))]
        feed, _, _ = feed_on(rt)
        feed.run_pack(PackOrder("pack-k1", ids[:1], more_coming=True))
        waited, since = feed.gathering(None)
        assert waited and since is not None
        assert feed.gathering(since - 2.0) == (False, since - 2.0)  # the window over: it starts
        feed.requests.pop()  # one request in, one left waiting (the KV gate held it)
        began = time.monotonic()
        assert feed.gathering(None)[0] is False  # emptied again: starts at once
        assert time.monotonic() - began < 0.5
        feed.run_pack(PackOrder("pack-k2", ids[1:2], more_coming=True))  # a new pack: a new wait
        assert feed.gathering(None)[0] is True
    finally:
        rt.db.dispose()


def test_an_idle_engine_waits_for_a_burst_of_jobs_by_the_newest_ones_age(settings: Settings) -> None:
    """With nothing validating, an idle engine waits FREIGHT_FEED_SETTLE_SECONDS from the newest
    batch's creation the pack names: a job alone created longer ago than that (its validation
    took longer) starts at once; one created just now waits; a pack naming none waits from its
    own arrival, as before the word existed."""
    rt = Runtime(replace(settings, unit_size=1, feed_merge_seconds=2.0, feed_settle_seconds=5.0))
    try:
        tenant, _ = create_tenant(rt.db, "t", now())
        ids = [u.id for u in batch_units(rt, validated_batch(rt, tenant.id, lines("b", 3)))]
        feed, _, _ = feed_on(rt)
        feed.run_pack(PackOrder("pack-old", ids[:1], newest_batch_at=time.time() - 6.0))
        assert feed.gathering(None)[0] is False
        feed.run_pack(PackOrder("pack-new", ids[1:2], newest_batch_at=time.time() - 0.1))
        waited, since = feed.gathering(None)
        assert waited and since is not None
        feed.requests.pop(), feed.requests.pop()
        feed.run_pack(PackOrder("pack-unsaid", ids[2:]))
        assert feed.gathering(None)[0] is True
    finally:
        rt.db.dispose()
