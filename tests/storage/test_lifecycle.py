"""storage.lifecycle's passes over many units by id, and the estimates' one mover, on both databases."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from sqlalchemy import select

from api.services.tenants import create_tenant
from storage.lifecycle import IDS_PER_STATEMENT, lock_free_units, move_estimates, move_units_by_id
from storage.models import Estimate, UnitStatus, WorkUnit
from storage.runtime import Runtime
from storage.status import ESTIMATE_TRANSITIONS, EstimateStatus, estimate_sources
from tests.conftest import now
from tests.factories import chat_line, validated_batch

REPO = Path(__file__).resolve().parents[2]


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


# -- estimates -----------------------------------------------------------------------------------

E = EstimateStatus
# every estimate move Freight makes, and where
ESTIMATE_MOVES = {
    (E.VALIDATING, E.COMPLETED),  # workers.estimates.run: the file would validate; the answer
    (E.VALIDATING, E.FAILED),  # workers.estimates.run and .fail; workers.cleanup.end_estimates
}


def test_the_estimate_table_holds_the_moves_the_code_makes_and_nothing_leaves_a_final_state():
    assert {(a, b) for a, targets in ESTIMATE_TRANSITIONS.items() for b in targets} == ESTIMATE_MOVES
    assert estimate_sources(E.COMPLETED) == estimate_sources(E.FAILED) == (E.VALIDATING,)
    assert ESTIMATE_TRANSITIONS[E.COMPLETED] == ESTIMATE_TRANSITIONS[E.FAILED] == frozenset()
    with pytest.raises(ValueError, match="no estimate moves to 'validating'"):
        estimate_sources(E.VALIDATING)


def test_no_estimate_status_is_written_but_by_move_estimates():
    """A final estimate state in the product code is only ever a ``to=`` of ``move_estimates``
    (a new estimate is made ``validating``): an UPDATE or an assignment of its own would bypass
    the table and the stamp."""
    final = {"COMPLETED", "FAILED"}
    found = []
    for folder in ("storage", "workers", "api"):
        for path in (REPO / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            allowed = {
                id(k.value)
                for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "move_estimates"
                for k in node.keywords
                if k.arg == "to"
            }
            for node in ast.walk(tree):
                values = []
                if isinstance(node, ast.Call):
                    values = [k.value for k in node.keywords if k.arg == "status"]
                elif isinstance(node, ast.Assign):
                    values = [node.value]
                for value in values:
                    for sub in ast.walk(value):
                        if (
                            isinstance(sub, ast.Attribute)
                            and ast.unparse(sub.value) == "EstimateStatus"
                            and sub.attr in final
                            and id(sub) not in allowed
                        ):
                            found.append(f"{path.relative_to(REPO)}:{sub.lineno}")
    assert found == []


def test_estimates_move_once_stamped_and_a_failure_says_why(settings):
    """One compare-and-set: only ``validating`` estimates move (a task's answer and the cleanup's
    failure of a lost one cannot both be recorded), ``finished_at`` is stamped, a failure carries
    its errors and a completion none."""
    rt = Runtime(settings)
    try:
        tenant, _ = create_tenant(rt.db, "a", now())
        made = int(now())
        with rt.db.write() as s:
            rows = [
                Estimate(tenant_id=tenant.id, input_file_id="file-x", endpoint="/v1/chat/completions",
                         completion_window="24h", price_multiplier=1.0, status=E.VALIDATING, created_at=made)
                for _ in range(3)
            ]  # fmt: skip
            s.add_all(rows)
            s.flush()
            done, lost, racing = (r.id for r in rows)
        errors = {"object": "list", "data": [{"code": "estimate_lost", "message": "lost", "line": None}]}
        with rt.db.write() as s:
            assert move_estimates(s, Estimate.id == done, to=E.COMPLETED, now=made + 5, result={"x": 1}) == 1
            assert (
                move_estimates(s, Estimate.id.in_([done, lost]), to=E.FAILED, now=made + 9, errors=errors)
                == 1
            )
            with pytest.raises(ValueError, match="needs errors"):
                move_estimates(s, Estimate.id == racing, to=E.FAILED, now=made + 9)
            with pytest.raises(ValueError, match="takes no errors"):
                move_estimates(s, Estimate.id == racing, to=E.COMPLETED, now=made + 9, errors=errors)
            with pytest.raises(ValueError, match="no estimate moves to"):
                move_estimates(s, Estimate.id == done, to=E.VALIDATING, now=made + 9)
        with rt.db.read() as s:
            got = {e.id: (e.status, e.finished_at, e.errors, e.result) for e in s.scalars(select(Estimate))}
        assert got == {
            done: (E.COMPLETED, made + 5, None, {"x": 1}),  # the later failure did not move it
            lost: (E.FAILED, made + 9, errors, None),
            racing: (E.VALIDATING, None, None, None),
        }
    finally:
        rt.db.dispose()
