"""The watcher on a real database and broker, with a scripted engine behind the loop it serves:
it hands the engine loop the units that must stop (a cancelled batch, a claim taken over),
heartbeats the rest with their results so far, renews the worker's ask after the broker lost it,
and writes the engine's sample."""

from __future__ import annotations

import itertools
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

from sqlalchemy import select

from api.services.tenants import create_tenant
from storage.broker import ASKS_KEY
from storage.models import Batch, EngineSample, WorkUnit
from storage.runtime import Runtime
from storage.settings import Settings
from storage.status import BatchStatus
from tests.conftest import now
from tests.factories import batch_units, chat_line, validated_batch
from tests.workers.scripted_engine import ScriptedEngine
from workers.cost_meter import CostMeter
from workers.engine_loop import EngineLoop
from workers.pack_feed import PackFeed
from workers.pack_watcher import CHECK_SECONDS, PackWatcher
from workers.runner_state import ActiveUnit, RunnerState, new_spool
from workers.unit_claims import claim_unit


def until(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def claimed(rt: Runtime, tenant_id: str, holder: str, n_lines: int) -> tuple[str, list[ActiveUnit]]:
    batch_id = validated_batch(rt, tenant_id, [chat_line(f"w-{i}", f"Row {i}") for i in range(n_lines)])
    claims = [claim_unit(rt, u.id, time.time(), holder) for u in batch_units(rt, batch_id)]
    return batch_id, [ActiveUnit(c, new_spool(), new_spool(), c.n_requests) for c in claims if c is not None]


def test_the_watcher_stops_what_must_stop_heartbeats_the_rest_renews_the_ask_and_samples(
    settings: Settings,
) -> None:
    rt = Runtime(replace(settings, unit_size=2, heartbeat_seconds=0.25, sample_seconds=0.25))
    worker = f"watcher-test-{uuid.uuid4().hex[:6]}"
    try:
        tenant, _ = create_tenant(rt.db, "t", now())
        _, (kept, taken) = claimed(rt, tenant.id, f"{worker}:1", 4)
        cancelled_batch, (cancelled,) = claimed(rt, tenant.id, f"{worker}:1", 2)
        kept.tally.completed, kept.tally.prompt_tokens, kept.tally.completion_tokens = 1, 10, 3
        with rt.db.write() as s:
            s.get(WorkUnit, taken.claim.unit_id).worker = "other:1:b"  # type: ignore[union-attr]
            s.get(Batch, cancelled_batch).status = BatchStatus.CANCELLING  # type: ignore[union-attr]
        state = RunnerState()
        state.hold([kept, taken, cancelled])
        feed = PackFeed(rt, state, queue.Queue(), f"m-{worker}", f"{worker}:1", 8)
        loop = EngineLoop(ScriptedEngine(), state, feed, queue.Queue(), CostMeter(3.6), lambda exc: None)
        with loop._sample_lock:  # three steps, as the engine loop's accounting adds them
            loop._sample.steps, loop._sample.seconds, loop._sample.running = 3, 1.5, 3.0
            loop._sample.requests, loop._sample.output_tokens = 2, 6
        feed.ask()
        with rt.queue.celery.pool.acquire(block=True) as conn:  # the broker lost its data
            conn.default_channel.client.delete(ASKS_KEY + feed.model)
        assert rt.queue.asks.count(feed.model, time.time()) == 0
        watcher = PackWatcher(rt, state, loop, feed, worker, "demo", None, 3.6, 8)
        thread = threading.Thread(target=watcher.run)
        thread.start()
        try:
            stopped = {loop.stops.get(timeout=15) for _ in range(2)}
            assert stopped == {taken, cancelled}
            assert taken.lost and cancelled.reason == "batch_cancelled"
            assert not kept.stopping

            def beaten() -> bool:
                with rt.db.read() as s:
                    row = s.get(WorkUnit, kept.claim.unit_id)
                    return row is not None and row.completed == 1

            until(beaten)
            with rt.db.read() as s:
                row = s.get(WorkUnit, kept.claim.unit_id)
                assert row is not None and (row.prompt_tokens, row.completion_tokens) == (10, 3)
                assert s.get(WorkUnit, taken.claim.unit_id).completed == 0  # type: ignore[union-attr]
            until(lambda: rt.queue.asks.count(feed.model, time.time()) == 1)  # asked again
        finally:
            state.stopped.set()
            thread.join(timeout=10)
        with rt.db.read() as s:
            (sample,) = s.scalars(select(EngineSample).where(EngineSample.worker == worker))
        assert (sample.model, sample.steps, sample.seconds, sample.running_mean) == ("demo", 3, 1.5, 2.0)
        assert (sample.requests, sample.output_tokens, sample.max_num_seqs) == (2, 6, 8)
        assert sample.mfu is None  # no shape: no estimate
    finally:
        rt.db.dispose()


def test_a_heartbeat_shorter_than_a_check_is_kept(settings: Settings) -> None:
    """FREIGHT_HEARTBEAT_SECONDS under the watcher's one-second check: its passes come as often as
    the heartbeat. (They came a second apart, so a 0.25 s heartbeat beat once a second, and a 2 s
    lease ran out in CI under load.) Each beat's time is the one it writes to the claims."""
    rt = Runtime(replace(settings, unit_size=2, heartbeat_seconds=0.25))
    worker = f"beats-{uuid.uuid4().hex[:6]}"
    try:
        tenant, _ = create_tenant(rt.db, "t", now())
        _, units = claimed(rt, tenant.id, f"{worker}:1", 2)
        state = RunnerState()
        state.hold(units)
        feed = PackFeed(rt, state, queue.Queue(), f"m-{worker}", f"{worker}:1", 8)
        loop = EngineLoop(ScriptedEngine(), state, feed, queue.Queue(), CostMeter(3.6), lambda exc: None)
        watcher = PackWatcher(rt, state, loop, feed, worker, "demo", None, 3.6, 8)
        beats: list[float] = []
        real = watcher._heartbeat

        def beat(beaten: list[ActiveUnit], at: float) -> None:
            real(beaten, at)
            beats.append(at)

        watcher._heartbeat = beat  # type: ignore[method-assign]
        thread = threading.Thread(target=watcher.run)
        thread.start()
        try:
            until(lambda: len(beats) >= 5)
        finally:
            state.stopped.set()
            thread.join(timeout=10)
        gaps = [b - a for a, b in itertools.pairwise(beats)]
        assert min(gaps) < CHECK_SECONDS, gaps  # a check apart at least, before
        with rt.db.read() as s:
            row = s.get(WorkUnit, units[0].claim.unit_id)
            assert row is not None and row.heartbeat_at in beats
    finally:
        rt.db.dispose()


class CountingEngine(ScriptedEngine):
    """A scripted engine that counts preemptions as workers/engine.py does for an inline core."""

    preemptions: int | None = 0


def test_the_watcher_stores_the_samples_preemptions_and_planned_cache_hits(settings: Settings) -> None:
    """KV-aware admission's report of a sample (issue #51 part 6) lands in its row: vLLM's
    preemptions as the engine loop counted them over its steps (NULL where the engine does not
    count them: a core in its own process), and the cached tokens the plan gave its finished
    requests (NULL with admission by count, where there is no plan)."""
    rows = []
    for counting, admission in ((True, True), (False, True), (True, False)):
        rt = Runtime(replace(settings, kv_admission=admission))
        worker = f"kv-report-{uuid.uuid4().hex[:6]}"
        try:
            state = RunnerState()
            feed = PackFeed(rt, state, queue.Queue(), f"m-{worker}", f"{worker}:1", 8)
            engine = CountingEngine() if counting else ScriptedEngine()
            loop = EngineLoop(engine, state, feed, queue.Queue(), CostMeter(3.6), lambda exc: None)
            for preempted in (2, 3):  # the engine's running count after each step: 2, then 5
                if counting:
                    engine.preemptions += preempted  # type: ignore[attr-defined]
                loop._account(0.5)
            with loop._sample_lock:
                loop._sample.prompt_tokens, loop._sample.cached_tokens = 1000, 700
                loop._sample.planned_cached_tokens = 800
            PackWatcher(rt, state, loop, feed, worker, "demo", None, 3.6, 8)._flush_sample()
            with rt.db.read() as s:
                (row,) = s.scalars(select(EngineSample).where(EngineSample.worker == worker))
                rows.append((row.steps, row.preemptions, row.cached_tokens, row.planned_cached_tokens))
        finally:
            rt.db.dispose()
    assert rows == [(2, 5, 700, 800), (2, None, 700, 800), (2, 5, 700, None)]


def test_migration_0034_goes_down_and_up(runtime, settings: Settings) -> None:
    from alembic import command
    from sqlalchemy import inspect

    from storage.migrate import alembic_config, check, upgrade

    runtime.db.dispose()
    command.downgrade(alembic_config(settings.database_url), "0033")
    columns = {c["name"] for c in inspect(runtime.db.engine).get_columns("engine_samples")}
    assert "preemptions" not in columns and "planned_cached_tokens" not in columns
    totals = {c["name"] for c in inspect(runtime.db.engine).get_columns("engine_sample_totals")}
    assert "preemptions" not in totals
    runtime.db.dispose()
    upgrade(settings.database_url)
    check(settings.database_url)  # the tables match the models again
