"""The tenant's validation chunk slots (scheduler/chunk_window.py): never more sent than the room
or than a batch has waiting, every slot used while a chunk waits, and each slot to the batch with
the fewest in flight."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler.chunk_window import share_slots

batches = st.lists(st.tuples(st.integers(0, 10), st.integers(0, 20)), max_size=6).map(
    lambda rows: [(f"b{i}", sent, waiting) for i, (sent, waiting) in enumerate(rows)]
)


@given(st.integers(-2, 30), batches)
def test_slots_are_bounded_used_and_levelled(room, rows) -> None:
    shares = share_slots(room, rows)
    waiting = {b: w for b, _, w in rows}
    assert all(0 < n <= waiting[b] for b, n in shares.items())
    assert sum(shares.values()) == min(max(room, 0), sum(waiting.values()))  # no slot left idle
    after = {b: sent + shares.get(b, 0) for b, sent, _ in rows}
    # levelled: a batch given a slot never ends with more in flight than one that still has
    # chunks waiting ends with, plus one
    for b in shares:
        for other, _, w in rows:
            if w > shares.get(other, 0):
                assert after[b] <= after[other] + 1, (b, other, shares)


def test_a_batch_that_arrives_late_gets_the_slots_that_come_free() -> None:
    # the first batch holds all 8; one of its chunks ends: the newcomer takes the slot
    assert share_slots(1, [("first", 7, 50), ("late", 0, 50)]) == {"late": 1}
    # until both hold the same, then the earlier batch first
    assert share_slots(3, [("first", 5, 50), ("late", 3, 50)]) == {"first": 1, "late": 2}


def test_a_lone_batch_takes_every_slot() -> None:
    assert share_slots(8, [("only", 0, 100)]) == {"only": 8}
    assert share_slots(8, [("only", 0, 3)]) == {"only": 3}
    assert share_slots(0, [("only", 0, 3)]) == {}
