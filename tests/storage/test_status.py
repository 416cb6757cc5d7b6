from types import SimpleNamespace

import pytest

from storage.status import STAMP, TRANSITIONS, BatchStatus, IllegalTransition, transition


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
