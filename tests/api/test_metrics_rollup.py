"""The rollup of final batches behind /metrics (storage/rollup.py): the scrape reads the rollup and
the batches not rolled up yet, and gives exactly what the full scan of every batch and work unit
gave; a batch is added once; migration 0011 backfills it; the scrape reads no final batch's row."""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import event, func, select, true

from api.services.monitoring import metrics_snapshot
from api.services.reports import NO_MODEL
from api.services.tenants import create_tenant
from scheduler.cost import charged_micros
from storage.lifecycle import finish_batch, finish_if_done, move_units, stop_batch
from storage.migrate import check, upgrade
from storage.models import Batch, BatchRollup, StoredFile, Tenant, UnitStatus, WorkUnit
from storage.rollup import roll_up, roll_up_stragglers
from storage.runtime import Runtime
from storage.status import BatchStatus
from tests.api.test_metrics import add_unit, metrics_app, scrape, seed
from tests.factories import chat_line, validated_batch
from workers.cleanup import run as cleanup
from workers.task_policy import fail_finalization, fail_validation

U = UnitStatus


def full_scan(rt: Runtime) -> dict[str, dict]:
    """The figures as /metrics computed them before the rollup: GROUP BYs over every batch and
    every work unit (the reference the rollup must agree with)."""
    with rt.db.read() as s:
        batches = {
            (status, model or NO_MODEL): int(n)
            for status, model, n in s.execute(
                select(Batch.status, Batch.model, func.count()).group_by(Batch.status, Batch.model)
            )
        }
        units = {
            (model, status): int(n)
            for model, status, n in s.execute(
                select(WorkUnit.model, WorkUnit.status, func.count()).group_by(
                    WorkUnit.model, WorkUnit.status
                )
            )
        }
        charged: dict[tuple[str, str], int] = defaultdict(int)
        for tenant, model, cost, mult in s.execute(
            select(Tenant.name, Batch.model, Batch.cost_micros, Batch.price_multiplier)
            .join(Tenant, Tenant.id == Batch.tenant_id)
            .where(Batch.status.in_(BatchStatus.FINAL), Batch.cost_micros > 0)
        ):
            charged[(tenant, model or NO_MODEL)] += charged_micros(cost, mult)
        sla = {
            (tenant, model or NO_MODEL, "true" if met else "false"): int(n)
            for tenant, model, met, n in s.execute(
                select(Tenant.name, Batch.model, Batch.sla_met, func.count())
                .join(Tenant, Tenant.id == Batch.tenant_id)
                .where(Batch.sla_met.is_not(None))
                .group_by(Tenant.name, Batch.model, Batch.sla_met)
            )
        }
    return {
        "batches": batches,
        "units": units,
        "cost": {key: micros / 1e6 for key, micros in sorted(charged.items())},
        "sla": sla,
    }


def from_snapshot(rt: Runtime) -> dict[str, dict]:
    snap = metrics_snapshot(rt, time.time())
    return {
        "batches": {k: n for k, n in snap.batches.items() if n},
        "units": {k: n for k, n in snap.work_units.items() if n},
        "cost": dict(snap.batch_cost_dollars),
        "sla": dict(snap.sla_batches),
    }


def rolled_up(rt: Runtime) -> int:
    with rt.db.read() as s:
        return s.scalar(select(func.count()).select_from(Batch).where(Batch.rolled_up_at.is_not(None))) or 0


def add_batch(s, tenant_id: str, model: str | None, status: str, **columns) -> Batch:
    """A batch (and its input file row) in ``status``; created now, due in a day unless given."""
    now = int(time.time())
    return add_batch_row(
        s, tenant_id, model, status, **{"created_at": now, "expires_at": now + 86400, **columns}
    )


def add_batch_row(s, tenant_id: str, model: str | None, status: str, **columns) -> Batch:
    f = StoredFile(tenant_id=tenant_id, purpose="batch", filename="in.jsonl", bytes=1, object_key="k",
                   created_at=0)  # fmt: skip
    s.add(f)
    s.flush()
    b = Batch(tenant_id=tenant_id, endpoint="/v1/chat/completions", model=model, input_file_id=f.id,
              completion_window="24h", status=status, **columns)  # fmt: skip
    s.add(b)
    s.flush()
    return b


def mixed(rt: Runtime, now: int) -> dict[str, str]:
    """Batches of three tenants and two models through every way to a final state, their units in
    every state; a few left open. Returns the id of the batch made final with a unit running."""
    tenants = [create_tenant(rt.db, name, now)[0].id for name in ("alpha", "beta", "gamma")]
    # two batches through the real intake and validation: real units of the real model
    real = [validated_batch(rt, tenants[i], [chat_line(f"r{j}") for j in range(3)]) for i in (0, 1)]
    ids: dict[str, str] = {}
    validating: list[str] = []
    with rt.db.write() as s:
        for i in range(24):
            tenant = tenants[i % 3]
            model = ("demo", "other")[i % 2]
            # past or future deadline: the SLA met or missed
            expires = now + 3600 if i % 4 else now - 60
            kind = i % 6
            if kind == 0:  # completed: every unit finished, charged at a multiplier
                b = add_batch(s, tenant, model, "in_progress", expires_at=expires, cost_micros=1000 + i,
                              price_multiplier=1.5, request_total=3)  # fmt: skip
                for seq, st in enumerate((U.DONE, U.DONE, U.FAILED)):
                    add_unit(s, b, seq, st)
                s.flush()
                assert finish_if_done(s, b, now)
                finish_batch(s, b, BatchStatus.COMPLETED, now)
            elif kind == 1:  # cancelled: pending and queued units skipped, the running one done
                b = add_batch(s, tenant, model, "in_progress", expires_at=expires, cost_micros=7)
                for seq, st in enumerate((U.PENDING, U.QUEUED, U.RUNNING, U.DONE)):
                    add_unit(s, b, seq, st)
                s.flush()
                stop_batch(s, b, BatchStatus.CANCELLING, now)
                move_units(s, WorkUnit.batch_id == b.id, from_=U.RUNNING, to=U.DONE)
                finish_batch(s, b, BatchStatus.CANCELLED, now)
            elif kind == 2:  # expired: finalizing, then expired; costs nothing
                b = add_batch(s, tenant, model, "in_progress", expires_at=now - 10)
                for seq, st in enumerate((U.QUEUED, U.DONE)):
                    add_unit(s, b, seq, st)
                s.flush()
                stop_batch(s, b, BatchStatus.EXPIRED, now)
                finish_batch(s, b, BatchStatus.EXPIRED, now)
            elif kind == 3:  # a charge that rounds to 0 still lists the series
                b = add_batch(s, tenant, model, "in_progress", expires_at=expires, cost_micros=1,
                              price_multiplier=0.25)  # fmt: skip
                add_unit(s, b, 0, U.DONE)
                s.flush()
                finish_if_done(s, b, now)
                finish_batch(s, b, BatchStatus.COMPLETED, now)
            elif kind == 4:  # failed validation, below: no model, no units, no SLA verdict
                validating.append(add_batch(s, tenant, None, "validating", expires_at=expires).id)
            else:  # left open: in progress with units in every state
                b = add_batch(s, tenant, model, "in_progress", expires_at=expires, request_total=9,
                              request_completed=2, cost_micros=99)  # fmt: skip
                for seq, st in enumerate((U.PENDING, U.QUEUED, U.RUNNING, U.DONE, U.FAILED)):
                    add_unit(s, b, seq, st)
        # made final while a unit still runs (a finalization that failed): not rolled up yet
        straggler = add_batch(s, tenants[2], "demo", "in_progress", expires_at=now + 60, cost_micros=5000)
        for seq, st in enumerate((U.RUNNING, U.DONE)):
            add_unit(s, straggler, seq, st)
        s.flush()
        stop_batch(s, straggler, BatchStatus.EXPIRED, now)
        ids["straggler"] = straggler.id
        # a final batch written without the rollup (as by an older release): read row by row
        add_batch(s, tenants[1], "other", "completed", completed_at=now, sla_met=True, cost_micros=300)
    for batch_id in validating:
        assert fail_validation(rt, "boom", batch_id)
    assert fail_finalization(rt, "boom", ids["straggler"])
    with rt.db.write() as s:  # one of the validated batches is cancelled; the other stays open
        b = s.get(Batch, real[0])
        assert b is not None
        stop_batch(s, b, BatchStatus.CANCELLING, now)
        finish_batch(s, b, BatchStatus.CANCELLED, now)
    return ids


def test_rollup_gives_the_full_scan_figures(runtime):
    now = int(time.time())
    ids = mixed(runtime, now)
    expected = full_scan(runtime)
    assert sum(expected["batches"].values()) == 24 + 2 + 2
    assert expected["cost"] and expected["sla"] and ("demo", "skipped") in expected["units"]
    assert from_snapshot(runtime) == expected
    assert rolled_up(runtime) == 4 * 5 + 1  # the straggler, the legacy row and open ones are not

    # the straggler's unit ends: the cleanup adds it, and nothing moves
    with runtime.db.write() as s:
        move_units(s, WorkUnit.batch_id == ids["straggler"], from_=U.RUNNING, to=U.DONE)
    cleanup(runtime, time.time())
    assert rolled_up(runtime) == 4 * 5 + 3  # and the legacy row
    assert from_snapshot(runtime) == full_scan(runtime) != expected  # one unit moved: running -> done


def test_a_batch_is_added_once(runtime):
    now = int(time.time())
    mixed(runtime, now)
    before = from_snapshot(runtime)
    with runtime.db.read() as s:
        rows = {(r.tenant_id, r.model, r.status, r.sla): r.batches for r in s.scalars(select(BatchRollup))}
    # finalization, expiry or the cleanup run again, also in separate transactions: nothing is added
    for added in (1, 0):  # the legacy row, the first time; the straggler's unit still runs
        with runtime.db.write() as s:
            assert roll_up(s, true(), now=now + 1) == added
    with runtime.db.write() as s:
        assert roll_up_stragglers(s, now + 2, 100) == 0
    with runtime.db.write() as s:
        b = s.scalars(select(Batch).where(Batch.status == BatchStatus.COMPLETED).limit(1)).one()
        assert roll_up(s, Batch.id == b.id, now=now + 3) == 0
        with pytest.raises(Exception, match="cannot go from completed"):
            finish_batch(s, b, BatchStatus.COMPLETED, now)
    with runtime.db.read() as s:
        after = {(r.tenant_id, r.model, r.status, r.sla): r.batches for r in s.scalars(select(BatchRollup))}
    assert sum(after.values()) == sum(rows.values()) + 1
    assert from_snapshot(runtime) == before == full_scan(runtime)


def test_scrape_is_the_same_before_and_after_rolling_up(runtime):
    """The seed of test_metrics.py (final batches written directly, not rolled up), scraped; then
    every batch rolled up: every sample of /metrics is the same."""
    now = int(time.time())
    seed(runtime, now)
    client = metrics_app(runtime).test_client()
    before = scrape(client)
    with runtime.db.write() as s:
        assert roll_up(s, true(), now=now) == 5  # its final batches
    assert scrape(client) == before


def insert(conn: sa.Connection, table: str, **values) -> None:
    conn.execute(sa.Table(table, sa.MetaData(), autoload_with=conn).insert().values(**values))


def test_migration_backfills_the_rollup(tmp_path: Path, runtime, request: pytest.FixtureRequest):
    """Rows written at revision 0010 (no rollup), upgraded: the scrape gives the full scan's
    figures, read from the backfilled rollup. On each database kind: the backfill is SQL."""
    if runtime.db.is_sqlite:
        url = f"sqlite:///{tmp_path / 'old.db'}"
    else:  # an empty database of its own, migrated from nothing to 0010
        url = request.getfixturevalue("postgres_service").create_database(f"old_{uuid.uuid4().hex[:12]}")
    upgrade(url, "0010")
    engine = sa.create_engine(url)
    now = int(time.time())
    with engine.begin() as conn:
        for t in ("alpha", "beta"):
            insert(conn, "tenants", id=f"t_{t}", name=t, created_at=now)
        insert(conn, "files", id="file-1", tenant_id="t_alpha", purpose="batch", filename="in.jsonl", bytes=1,
               object_key="k", created_at=now)  # fmt: skip
        n_unit = 0
        for i in range(30):
            status = ("completed", "expired", "cancelled", "failed", "in_progress", "finalizing")[i % 6]
            final = status in BatchStatus.FINAL
            stamp = {f"{status}_at": now - i} if final else {}
            insert(conn, "batches", id=f"batch_{i}", tenant_id=("t_alpha", "t_beta")[i % 2], endpoint="/v1/chat",
                   model=None if i == 3 else ("demo", "other")[i % 3 % 2], input_file_id="file-1",
                   completion_window="24h", status=status, created_at=now - 99, expires_at=now,
                   sla_met=(i % 4 != 0) if final and i != 3 else None, cost_micros=(i % 5) * 333,
                   price_multiplier=(1.0, 1.5, 0.5)[i % 3], request_total=3, request_completed=1,
                   request_failed=0, prompt_tokens=0, cached_tokens=0, completion_tokens=0, **stamp)  # fmt: skip
            unit_states = [U.DONE, U.SKIPPED, U.FAILED] if final else [U.PENDING, U.RUNNING, U.DONE]
            if i == 8:  # final with a unit still running: stays out of the rollup
                unit_states = [U.RUNNING, U.DONE]
            for seq, st in enumerate(unit_states[: 1 + i % 3] if i != 3 else []):
                n_unit += 1
                insert(conn, "work_units", id=n_unit, batch_id=f"batch_{i}", seq=seq,
                       model=("demo", "other")[i % 3 % 2], shard_key="x", first_line=0, n_requests=1,
                       status=st, attempts=0, completed=0, failed=0, prompt_tokens=0, cached_tokens=0,
                       completion_tokens=0)  # fmt: skip
    engine.dispose()
    rt = Runtime(replace(runtime.settings, database_url=url))
    try:
        before = full_scan(rt)
        upgrade(url)
        check(url)  # the models and the migrations agree
        assert full_scan(rt) == before
        assert from_snapshot(rt) == before
        with rt.db.read() as s:
            assert s.scalar(select(func.sum(BatchRollup.batches))) == 20 - 1  # final ones, but batch_8
            assert s.scalar(select(func.sum(BatchRollup.units_done))) > 0
            assert s.get(Batch, "batch_8").rolled_up_at is None  # type: ignore[union-attr]
        with rt.db.write() as s:  # the backfill marked what it added: nothing is added again
            assert roll_up(s, true(), now=now) == 0
        assert from_snapshot(rt) == before
    finally:
        rt.db.dispose()


def test_scrape_reads_no_final_batch_row(runtime):
    """Every statement of the snapshot, explained by the database: batches and work units are
    searched through an index, never scanned (engine_samples, bounded by retention, may be).
    PostgreSQL's planner scans a table of a few rows whatever its indexes, so there it explains
    with sequential scans priced out (``enable_seqscan = off``): a scan it still plans is one no
    index can replace."""
    mixed(runtime, int(time.time()))
    statements: list[tuple[str, object]] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("SELECT"):
            statements.append((statement, parameters))

    engine = runtime.db.engine
    event.listen(engine, "before_cursor_execute", record)
    try:
        metrics_snapshot(runtime, time.time())
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert len(statements) >= 8
    plans = []
    sqlite = runtime.db.is_sqlite
    scans = (
        ("SCAN batches", "SCAN work_units") if sqlite else ("Seq Scan on batches", "Seq Scan on work_units")
    )
    with engine.connect() as conn:
        if not sqlite:
            conn.exec_driver_sql("SET enable_seqscan = off")
        for statement, parameters in statements:
            if sqlite:
                plan = [row[3] for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)]
            else:
                plan = [row[0].strip() for row in conn.exec_driver_sql("EXPLAIN " + statement, parameters)]
            plans.append(plan)
            for step in plan:
                assert scans[0] not in step and scans[1] not in step, (statement, plan)
    touched = " ".join(" ".join(p) for p in plans)
    assert "ix_batches_rolled_up" in touched  # the batches not rolled up
    assert "ix_work_units_batch_id" in touched  # their units
    assert "ix_batches_status_final_at" in touched  # the SLA window


def test_models_match_the_migrations(runtime):
    """On PostgreSQL too, whose reflection compares the expression index of the SLA window."""
    check(runtime.settings.database_url)
