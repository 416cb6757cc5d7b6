import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from storage.status import (
    STAMP,
    TRANSITIONS,
    UNIT_TRANSITIONS,
    BatchStatus,
    IllegalTransition,
    IllegalUnitMove,
    UnitStatus,
    transition,
    unit_sources,
)

REPO = Path(__file__).resolve().parents[2]


def batch(status: str, expires_at: int = 1000) -> SimpleNamespace:
    return SimpleNamespace(
        status=status, expires_at=expires_at, sla_met=None, **{col: None for col in STAMP.values()}
    )


def test_happy_path_stamps_each_state_once():
    b = batch("validating")
    for i, target in enumerate(
        [BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.COMPLETED], start=1
    ):
        transition(b, target, now=100 + i)
    assert b.status == "completed"
    assert (b.in_progress_at, b.finalizing_at, b.completed_at) == (101, 102, 103)
    assert b.failed_at is None and b.cancelled_at is None


@pytest.mark.parametrize("terminal", [s for s in BatchStatus if s.is_terminal])
def test_terminal_states_admit_no_transition(terminal):
    for target in BatchStatus:
        with pytest.raises(IllegalTransition):
            transition(batch(terminal.value), target, now=1)


def test_illegal_transition_changes_nothing():
    b = batch("in_progress")
    with pytest.raises(IllegalTransition, match="in_progress to completed"):
        transition(b, BatchStatus.COMPLETED, now=5)
    assert b.status == "in_progress" and b.completed_at is None


def test_every_non_terminal_state_reaches_a_terminal_state():
    for start in BatchStatus:
        seen, frontier = set(), {start}
        while frontier:
            state = frontier.pop()
            seen.add(state)
            frontier |= TRANSITIONS[state] - seen
        assert any(s.is_terminal for s in seen)


def test_cancel_and_expiry_paths():
    b = batch("in_progress")
    transition(b, BatchStatus.CANCELLING, 10)
    transition(b, BatchStatus.CANCELLED, 11)
    assert (b.cancelling_at, b.cancelled_at) == (10, 11)
    e = batch("in_progress")
    transition(e, BatchStatus.FINALIZING, 20)
    transition(e, BatchStatus.EXPIRED, 21)
    assert e.expired_at == 21


def test_final_states_record_the_sla_verdict():
    def run(path, now, expires_at=1000):
        b = batch("validating", expires_at)
        for target in path:
            transition(b, target, now)
        return b.sla_met

    S = BatchStatus
    assert run([S.IN_PROGRESS, S.FINALIZING, S.COMPLETED], now=1000) is True
    assert run([S.IN_PROGRESS, S.FINALIZING, S.COMPLETED], now=1001) is False  # late
    assert run([S.IN_PROGRESS, S.FINALIZING, S.EXPIRED], now=1000) is False
    assert run([S.IN_PROGRESS, S.FINALIZING, S.FAILED], now=10) is False
    assert run([S.IN_PROGRESS, S.CANCELLING, S.CANCELLED], now=10) is None  # stopped by its owner
    assert run([S.FAILED], now=10) is None  # an invalid file never ran


# -- work units ----------------------------------------------------------------------------------

U = UnitStatus
# every unit move Freight makes, and where
UNIT_MOVES = {
    (U.PENDING, U.QUEUED),  # dispatcher.enqueue_units: packed and sent
    (U.QUEUED, U.PENDING),  # dispatcher.requeue_lost: the pack message was lost
    (U.PENDING, U.RUNNING),  # unit_claims.claim_unit
    (U.QUEUED, U.RUNNING),  # unit_claims.claim_unit
    (U.RUNNING, U.DONE),  # unit_recorder (unit_claims.record_unit)
    (U.RUNNING, U.PENDING),  # unit_claims.release_unit at shutdown; dispatcher.redeliver_stale
    (U.RUNNING, U.FAILED),  # dispatcher.redeliver_stale: lost too often
    (U.PENDING, U.SKIPPED),  # lifecycle.stop_batch: cancelled or expired
    (U.QUEUED, U.SKIPPED),  # lifecycle.stop_batch
}


def test_every_unit_move_the_code_makes_is_allowed():
    for current, target in UNIT_MOVES:
        assert unit_sources(current, target) == (current,)
    assert {(a, b) for a, targets in UNIT_TRANSITIONS.items() for b in targets} == UNIT_MOVES


def _status(node: ast.expr) -> list[str]:
    """``UnitStatus.X`` or a tuple/list of them, as values."""
    if isinstance(node, ast.Tuple | ast.List):
        return [s for elt in node.elts for s in _status(elt)]
    assert isinstance(node, ast.Attribute), ast.unparse(node)
    return [getattr(UnitStatus, node.attr)]


def _moves_in_source() -> set[tuple[str, str]]:
    """The (from, to) of every ``move_units(...)``, ``move_units_by_id(...)`` and
    ``unit_sources(...)`` call in the code, and of every lease keeper's (``UNIT_LEASE.take(...,
    from_=..., to=...)``: storage/leases.py moves a unit's status with its lease)."""
    found = set()
    for folder in ("storage", "workers", "api"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                if isinstance(node.func, ast.Attribute) and node.func.attr in ("take", "release", "revoke"):
                    kw = {k.arg: k.value for k in node.keywords}
                    sources, target = kw.get("from_"), kw.get("to")
                elif not isinstance(node.func, ast.Name):
                    continue
                elif node.func.id in ("move_units", "move_units_by_id"):
                    kw = {k.arg: k.value for k in node.keywords}
                    sources, target = kw.get("from_"), kw.get("to")
                elif node.func.id == "unit_sources" and len(node.args) == 2:
                    sources, target = node.args
                else:
                    continue
                if sources is None or target is None or not isinstance(target, ast.Attribute):
                    continue  # the definition's own pass-through
                found |= {(s, t) for s in _status(sources) for t in _status(target)}
    return found


def test_the_moves_in_the_source_are_the_listed_ones():
    assert _moves_in_source() == UNIT_MOVES


@pytest.mark.parametrize(
    ("current", "target"),
    [(U.PENDING, U.DONE), (U.QUEUED, U.FAILED), (U.RUNNING, U.QUEUED), (U.RUNNING, U.SKIPPED),
     (U.PENDING, U.PENDING), ("unknown", U.PENDING)],
)  # fmt: skip
def test_a_disallowed_unit_move_raises(current, target):
    with pytest.raises(IllegalUnitMove, match=f"from {current} to {target}"):
        unit_sources(current, target)
    with pytest.raises(IllegalUnitMove):  # one bad source spoils the move
        unit_sources((U.PENDING, U.QUEUED, current), target)


def test_a_unit_move_needs_a_source():
    with pytest.raises(ValueError):
        unit_sources((), U.SKIPPED)


@pytest.mark.parametrize("terminal", UnitStatus.FINISHED)
def test_finished_units_have_no_exits(terminal):
    assert UNIT_TRANSITIONS[terminal] == frozenset()
    for target in UNIT_TRANSITIONS:
        with pytest.raises(IllegalUnitMove):
            unit_sources(terminal, target)


def test_every_open_unit_can_finish():
    assert set(UNIT_TRANSITIONS) - set(UnitStatus.FINISHED) == {U.PENDING, U.QUEUED, U.RUNNING}
    for start in UNIT_TRANSITIONS:
        seen, frontier = set(), {start}
        while frontier:
            state = frontier.pop()
            seen.add(state)
            frontier |= UNIT_TRANSITIONS[state] - seen
        assert seen & set(UnitStatus.FINISHED)
