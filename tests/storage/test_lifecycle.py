"""storage.lifecycle's passes over many units by id, on both databases."""

from __future__ import annotations

from sqlalchemy import select

from api.services.tenants import create_tenant
from storage.lifecycle import IDS_PER_STATEMENT, lock_free_units, move_units_by_id
from storage.models import UnitStatus, WorkUnit
from storage.runtime import Runtime
from tests.conftest import now
from tests.factories import chat_line, validated_batch


def test_units_are_locked_and_moved_by_id_past_postgresqls_parameter_limit(settings):
    """A fleet-wide outage can leave more stale units than one PostgreSQL statement takes
    parameters (65,535): the ids go ``IDS_PER_STATEMENT`` at a time, and ids of units that do
    not match (or do not exist) are left out."""
    rt = Runtime(settings)
    try:
        tenant, _ = create_tenant(rt.db, "a", now())
        lines = [chat_line(f"c{i}", f"prompt {i}", max_tokens=2) for i in range(3)]
        validated_batch(rt, tenant.id, lines, name="many.jsonl")
        with rt.db.read() as s:
            real = sorted(s.scalars(select(WorkUnit.id)).all())
        asked = [*range(1, 70_001), *real]  # 70,000 ids and more: past the limit, some twice
        assert len(asked) > 65_535 > IDS_PER_STATEMENT
        with rt.db.write() as s:
            assert lock_free_units(s, reversed(asked), WorkUnit.status == UnitStatus.PENDING) == real
            assert lock_free_units(s, asked, WorkUnit.status == UnitStatus.RUNNING) == []
            moved = move_units_by_id(
                s, asked, from_=UnitStatus.PENDING, to=UnitStatus.SKIPPED, finished_at=1.0
            )
            assert moved == len(real)
        with rt.db.read() as s:
            assert set(s.scalars(select(WorkUnit.status)).all()) == {UnitStatus.SKIPPED}
    finally:
        rt.db.dispose()
