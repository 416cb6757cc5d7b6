"""The recorder on a real database and object store: a finished unit's spools uploaded and the
unit recorded once; a lost, a released and a taken-over unit are not recorded, and every unit
handed to it leaves the worker's books."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from sqlalchemy import select

from api.services.tenants import create_tenant
from storage.models import Batch, UnitStatus, WorkUnit
from storage.runtime import Runtime
from storage.settings import Settings
from storage.status import BatchStatus
from tests.conftest import now
from tests.factories import batch_units, chat_line, validated_batch
from workers.results import encode, stopped_line, success_line
from workers.runner_state import ActiveUnit, RunnerState, new_spool
from workers.unit_claims import claim_unit
from workers.unit_recorder import UnitRecorder

HOLDER = "recorder-test:1"


def claimed(rt: Runtime, n_lines: int) -> tuple[str, list[ActiveUnit]]:
    """A validated batch of ``n_lines`` whose every unit this process has claimed."""
    tenant, _ = create_tenant(rt.db, "t", now())
    lines = [chat_line(f"r-{i}", f"Row {i}", max_tokens=4) for i in range(n_lines)]
    batch_id = validated_batch(rt, tenant.id, lines)
    units = []
    for row in batch_units(rt, batch_id):
        claim = claim_unit(rt, row.id, time.time(), HOLDER)
        assert claim is not None
        units.append(ActiveUnit(claim, new_spool(), new_spool(), claim.n_requests))
    return batch_id, units


def record(rt: Runtime, units: list[ActiveUnit]) -> RunnerState:
    """Hand ``units`` to a recorder running on its thread, and wait until it has done with them."""
    state = RunnerState()
    state.hold(units)
    recorder = UnitRecorder(rt, state, "demo", shape=None)
    thread = threading.Thread(target=recorder.run)
    thread.start()
    for unit in units:
        recorder.finished.put(unit)
    recorder.finished.put(None)
    thread.join(timeout=30)
    assert not thread.is_alive()
    return state


def test_a_finished_unit_is_uploaded_recorded_and_its_batch_readied_for_finalization(
    settings: Settings,
) -> None:
    rt = Runtime(replace(settings, unit_size=2))
    try:
        batch_id, (unit,) = claimed(rt, 2)
        out, err = encode(success_line("r-0", {"ok": 1})), encode(stopped_line("r-1", "batch_cancelled"))
        unit.out.write(out)
        unit.err.write(err)
        unit.results, unit.tally.completed, unit.tally.failed = 2, 1, 1
        unit.tally.prompt_tokens, unit.tally.completion_tokens = 12, 4
        unit.fill_seconds, unit.seconds = 0.5, 1.0
        state = record(rt, [unit])
        assert not state.busy() and unit.out.closed and unit.err.closed
        (row,) = batch_units(rt, batch_id)
        assert (row.status, row.completed, row.failed, row.prompt_tokens, row.mean_fill) == (
            UnitStatus.DONE, 1, 1, 12, 0.5
        )  # fmt: skip
        assert row.mfu is None and row.model_parameters is None  # no shape: no estimate
        assert row.output_key is not None and row.error_key is not None
        with rt.store.open(row.output_key) as f:
            assert f.read() == out
        with rt.store.open(row.error_key) as f:
            assert f.read() == err
        with rt.db.read() as s:
            batch = s.get(Batch, batch_id)
            assert batch is not None
            assert (batch.request_completed, batch.request_failed, batch.completion_tokens) == (1, 1, 4)
            assert batch.status == BatchStatus.FINALIZING  # its last unit
    finally:
        rt.db.dispose()


def test_a_lost_a_released_and_a_taken_over_unit_are_not_recorded(settings: Settings) -> None:
    """Lost (the watcher saw another worker's claim): discarded. Released at shutdown: back to
    pending, the attempt not counted. Taken over between the watcher's check and the record: the
    compare-and-set records nothing. Each leaves the worker's books all the same."""
    rt = Runtime(replace(settings, unit_size=2))
    try:
        batch_id, (lost, released, taken) = claimed(rt, 6)
        lost.lost = True
        released.released = True
        with rt.db.write() as s:
            row = s.get(WorkUnit, taken.claim.unit_id)
            assert row is not None
            row.worker = "other:1:b"
        for unit in (lost, released, taken):
            unit.tally.completed = unit.results = 2
        state = record(rt, [lost, released, taken])
        assert not state.busy()
        with rt.db.read() as s:
            rows = {u.id: u for u in s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch_id))}
        by = {unit: rows[unit.claim.unit_id] for unit in (lost, released, taken)}
        assert (by[lost].status, by[lost].worker, by[lost].output_key) == (
            UnitStatus.RUNNING,
            lost.claim.token,
            None,
        )
        assert (by[released].status, by[released].worker, by[released].attempts) == (
            UnitStatus.PENDING,
            None,
            0,
        )
        assert (by[taken].status, by[taken].worker, by[taken].output_key) == (
            UnitStatus.RUNNING,
            "other:1:b",
            None,
        )
        assert all(r.completed == 0 for r in rows.values())
        with rt.db.read() as s:
            assert s.get(Batch, batch_id).request_completed == 0  # type: ignore[union-attr]
    finally:
        rt.db.dispose()
