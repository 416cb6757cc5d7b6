"""The engine worker's database writes apart from the engine: claim renewal."""

from __future__ import annotations

from dataclasses import replace

from sqlalchemy import select

from bench.dispatcher_load import Sizes, load
from storage.models import WorkUnit
from storage.runtime import Runtime
from storage.status import UnitStatus
from tests.conftest import now
from workers.unit_claims import UnitTally, claim_unit, heartbeat


def test_a_heartbeat_renews_the_claims_still_held_with_their_counts(settings):
    """One executemany renews every claim given (in unit order, whatever order they come in); a
    claim another worker took over in the meantime is left alone."""
    rt = Runtime(replace(settings, unit_size=2))
    try:
        load(rt.db, Sizes(requests=6, batches=1, tenants=1, models=1, workers=1), now(), unit_size=2)
        with rt.db.read() as s:
            ids = list(s.scalars(select(WorkUnit.id).order_by(WorkUnit.id)))
        t0 = float(now())
        claims = [claim_unit(rt, unit_id, t0, "w:1:a") for unit_id in ids]
        assert all(claims)
        with rt.db.write() as s:  # the last unit's claim was lost to another worker
            s.get(WorkUnit, ids[-1]).worker = "other:1:b"
        so_far = UnitTally(completed=1, failed=1, prompt_tokens=40, completion_tokens=7)
        heartbeat(rt, [(c, so_far) for c in reversed(claims) if c is not None], t0 + 30)
        heartbeat(rt, [], t0 + 31)  # nothing held: nothing written
        with rt.db.read() as s:
            rows = {u.id: u for u in s.scalars(select(WorkUnit).where(WorkUnit.id.in_(ids)))}
        for unit_id in ids[:-1]:
            row = rows[unit_id]
            assert (row.heartbeat_at, row.completed, row.failed, row.prompt_tokens, row.completion_tokens) == (
                t0 + 30, 1, 1, 40, 7
            )  # fmt: skip
        assert (rows[ids[-1]].heartbeat_at, rows[ids[-1]].completed, rows[ids[-1]].completion_tokens) == (
            t0,
            0,
            0,
        )
    finally:
        rt.db.dispose()


def test_a_unit_taken_by_a_late_pack_message_records_that_pack(settings):
    """A unit packed again after its message waited too long is pending with no pack; its old
    message may still deliver it (the claim lets one delivery run it), and then the unit names the
    pack it ran in. A delivery without a pack (a direct claim) leaves the pack as it was."""
    rt = Runtime(replace(settings, unit_size=2))
    try:
        load(rt.db, Sizes(requests=4, batches=1, tenants=1, models=1, workers=1), now(), unit_size=2)
        with rt.db.write() as s:
            units = list(s.scalars(select(WorkUnit).order_by(WorkUnit.id)))
            for unit in units:
                unit.pack_id = None  # requeued: pending, its pack cleared
        late, direct = (u.id for u in units)
        assert claim_unit(rt, late, float(now()), "w:1:a", pack_id="pack_late") is not None
        assert claim_unit(rt, direct, float(now()), "w:1:a") is not None
        assert claim_unit(rt, late, float(now()), "w:2:b", pack_id="pack_new") is None  # one delivery runs it
        with rt.db.read() as s:
            rows = {u.id: u for u in s.scalars(select(WorkUnit).where(WorkUnit.id.in_([late, direct])))}
        assert rows[late].pack_id == "pack_late" and rows[late].status == UnitStatus.RUNNING
        assert rows[direct].pack_id is None
    finally:
        rt.db.dispose()
