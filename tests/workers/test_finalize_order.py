"""Finalization copies the units' result objects in unit order, whatever order the objects
opened ahead (workers.finalize._opened) arrive in, and leaves no stream or thread behind when an
object is missing."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest
from sqlalchemy import select, update

from storage.models import Batch, StoredFile, UnitStatus, WorkUnit
from storage.objectstore import ObjectNotFound
from storage.runtime import Runtime
from storage.shards import read_rows
from storage.status import BatchStatus
from tests.workers.test_finalize_release import validated_batch
from workers.finalize import PREFETCH_UNITS, finalize_batch


def _lines(rt: Runtime, batch_id: str, attr: str) -> list[dict]:
    with rt.db.read() as s:
        key = s.get(StoredFile, getattr(s.get(Batch, batch_id), attr)).object_key
    with rt.store.open(key) as f:
        return [json.loads(x) for x in f.read().splitlines()]


def _ran_and_skipped(rt: Runtime, batch_id: str) -> list[WorkUnit]:
    """Even units ran (two output lines, one error line each); odd ones were skipped by a cancel."""
    with rt.db.write() as s:
        units = list(s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch_id).order_by(WorkUnit.seq)))
        for unit in units:
            if unit.seq % 2:
                unit.status = UnitStatus.SKIPPED
                continue
            base = f"batches/{batch_id}/units/{unit.seq:06d}.1"
            out = b"".join(b'{"custom_id": "ran-%d-%d"}\n' % (unit.seq, k) for k in range(2))
            rt.store.put_chunks(f"{base}.output.jsonl", [out])
            rt.store.put_chunks(f"{base}.errors.jsonl", [b'{"custom_id": "err-%d"}\n' % unit.seq])
            unit.status, unit.completed = UnitStatus.DONE, 2
            unit.output_key, unit.error_key = f"{base}.output.jsonl", f"{base}.errors.jsonl"
        s.execute(update(Batch).where(Batch.id == batch_id).values(status=BatchStatus.CANCELLING))
        s.expunge_all()
    return units


def test_results_are_copied_in_unit_order_past_the_prefetch_window(settings):
    rt = Runtime(replace(settings, unit_size=2))
    try:
        batch_id = validated_batch(rt, requests=2 * (3 * PREFETCH_UNITS + 1))
        units = _ran_and_skipped(rt, batch_id)
        assert len(units) > 3 * PREFETCH_UNITS
        assert finalize_batch(rt, batch_id) == BatchStatus.CANCELLED
        ran = [u for u in units if u.seq % 2 == 0]
        assert [x["custom_id"] for x in _lines(rt, batch_id, "output_file_id")] == [
            f"ran-{u.seq}-{k}" for u in ran for k in range(2)
        ]
        errors = _lines(rt, batch_id, "error_file_id")
        expected = []
        for unit in units:  # a ran unit's error object, a skipped unit's requests as stopped lines
            if unit.seq % 2 == 0:
                expected.append(f"err-{unit.seq}")
            else:
                expected += [
                    r.custom_id for r in read_rows(rt.store, unit.shard_key, unit.row_start, unit.n_requests)
                ]
        assert [e["custom_id"] for e in errors] == expected
        stopped = [e for e in errors if not e["custom_id"].startswith("err-")]
        assert len(stopped) == sum(u.n_requests for u in units if u.seq % 2)
        assert all(e["error"]["code"] == "batch_cancelled" for e in stopped)
    finally:
        rt.db.dispose()


def test_a_missing_result_object_fails_the_pass_and_leaves_no_thread(settings):
    rt = Runtime(replace(settings, unit_size=2))
    try:
        batch_id = validated_batch(rt, requests=2 * (2 * PREFETCH_UNITS))
        units = _ran_and_skipped(rt, batch_id)
        rt.store.delete(units[4].output_key)  # a later unit's object, opened ahead of its turn
        before = threading.active_count()
        with pytest.raises(ObjectNotFound):
            finalize_batch(rt, batch_id)
        assert not [t for t in threading.enumerate() if t.name.startswith("finalize-get")]
        assert threading.active_count() <= before
        with rt.db.read() as s:
            row = s.get(Batch, batch_id)
            assert row.status == BatchStatus.CANCELLING and row.output_file_id is None
            assert row.finalizer_heartbeat_at is None  # released: the next tick tries again
    finally:
        rt.db.dispose()


def test_a_cancelled_batch_reads_each_shard_once_for_the_requests_that_never_ran(settings, monkeypatch):
    """Every request of a batch cancelled before it ran gets its stopped line, in file order, and
    each shard is opened once for all its units (not once per unit: 79 s of a cancelled
    million-request batch's finalization, and a whole-shard GET per unit on S3)."""
    from storage.shards import SHARD_UNITS

    rt = Runtime(replace(settings, unit_size=2))
    try:
        batch_id = validated_batch(rt, requests=2 * (2 * SHARD_UNITS + 3))  # three shards
        with rt.db.write() as s:
            units = list(
                s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch_id).order_by(WorkUnit.seq))
            )
            for unit in units:  # what a cancel does to units that never ran
                unit.status = UnitStatus.SKIPPED
            s.execute(update(Batch).where(Batch.id == batch_id).values(status=BatchStatus.CANCELLING))
            s.expunge_all()
        shards = sorted({u.shard_key for u in units})
        assert len(shards) == 3
        expected = [
            r.custom_id for u in units for r in read_rows(rt.store, u.shard_key, u.row_start, u.n_requests)
        ]
        opened: list[str] = []
        real_open = rt.store.open
        monkeypatch.setattr(rt.store, "open", lambda key: opened.append(key) or real_open(key))
        assert finalize_batch(rt, batch_id) == BatchStatus.CANCELLED
        errors = _lines(rt, batch_id, "error_file_id")
        assert [e["custom_id"] for e in errors] == expected and len(set(expected)) == len(expected)
        assert all(e["error"]["code"] == "batch_cancelled" and e["response"] is None for e in errors)
        assert sorted(k for k in opened if "/shards/" in k) == shards  # once each
    finally:
        rt.db.dispose()
