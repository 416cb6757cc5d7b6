from hypothesis import given
from hypothesis import strategies as st

from scheduler.planning import PendingUnit, RunningUnit, plan_enqueue, plan_redelivery


def unit(uid, model="m", deadline=100, created=0, seq=0):
    return PendingUnit(uid, model, deadline, created, seq)


def test_earliest_deadline_first_then_file_order():
    pending = [unit(1, deadline=300, seq=0), unit(2, deadline=100, seq=1), unit(3, deadline=100, seq=0)]
    assert [u.unit_id for u in plan_enqueue(pending, {}, depth=3)] == [3, 2, 1]


def test_depth_is_per_model_and_counts_already_queued():
    pending = [unit(i, model="a", seq=i) for i in range(5)] + [
        unit(10 + i, model="b", seq=i) for i in range(5)
    ]
    chosen = plan_enqueue(pending, {"a": 3}, depth=4)
    assert [u.unit_id for u in chosen if u.model == "a"] == [0]
    assert [u.unit_id for u in chosen if u.model == "b"] == [10, 11, 12, 13]


@given(
    st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 50), st.integers(0, 5)), max_size=40),
    st.integers(0, 6),
    st.dictionaries(st.sampled_from("abc"), st.integers(0, 8)),
)
def test_never_exceeds_depth_and_respects_deadlines(specs, depth, queued):
    pending = [unit(i, model=m, deadline=d, seq=s) for i, (m, d, s) in enumerate(specs)]
    chosen = plan_enqueue(pending, queued, depth)
    for model in "abc":
        picked = [u for u in chosen if u.model == model]
        assert len(picked) <= max(0, depth - queued.get(model, 0))
        left = [u for u in pending if u.model == model and u not in picked]
        if picked and left:  # nothing left behind is more urgent than what was picked
            assert max(u.deadline for u in picked) <= min(u.deadline for u in left)


def test_redelivery_after_lease_and_give_up_after_attempts():
    running = [
        RunningUnit(1, "m", heartbeat_at=95.0, attempts=1),  # fresh
        RunningUnit(2, "m", heartbeat_at=10.0, attempts=1),  # stale
        RunningUnit(3, "m", heartbeat_at=None, attempts=1),  # never beat
        RunningUnit(4, "m", heartbeat_at=10.0, attempts=3),  # stale, out of attempts
    ]
    retry, give_up = plan_redelivery(running, now=100.0, lease_seconds=30, max_attempts=3)
    assert [u.unit_id for u in retry] == [2, 3]
    assert [u.unit_id for u in give_up] == [4]
