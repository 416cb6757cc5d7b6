"""The worker's elevator feed (scheduler/feed_order.py), as properties over any sequence of pushes
and pops: nothing is lost or duplicated, a sweep runs in key order, a request that arrives ahead
of the cursor runs in the current sweep and one that arrives behind it in the next (so nothing
waits more than one sweep), urgent requests overtake everything waiting, and cache domains never
interleave within a sweep."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler.feed_order import ElevatorFeed

# ("push", domain, key, urgent) or ("pop",)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from(["", "t1", "t2"]), st.integers(0, 20), st.booleans()),
        st.tuples(st.just("pop")),
    ),
    max_size=120,
)


def run(ops):
    """Apply ``ops``, then drain; each pop as (item, key, urgent, sweep it ran in), and for every
    item the sweep that was running when it was pushed and whether it went ahead of the cursor."""
    feed: ElevatorFeed[int] = ElevatorFeed()
    keys: dict[int, tuple[str, int]] = {}
    urgent: dict[int, bool] = {}
    pushed: dict[int, tuple[int, bool]] = {}  # item -> (sweep at push, ahead of the cursor)
    popped: list[tuple[int, tuple[str, int], bool, int]] = []
    sweep, cursor = 0, None

    def pop() -> None:
        nonlocal sweep, cursor
        item = feed.pop()
        if not urgent[item]:
            if cursor is not None and keys[item] < cursor:
                sweep += 1  # the elevator went back to the bottom
            cursor = keys[item]
        popped.append((item, keys[item], urgent[item], sweep))

    for op in [*ops, *[("pop",)] * 200]:
        if op[0] == "push":
            item = len(keys)
            keys[item], urgent[item] = (op[1], op[2]), op[3]
            pushed[item] = (sweep, cursor is None or keys[item] >= cursor)
            feed.push(keys[item], item, urgent=op[3])
        elif len(feed):
            pop()
    return keys, urgent, pushed, popped


@given(operations)
def test_every_item_is_popped_exactly_once(ops) -> None:
    keys, _, _, popped = run(ops)
    assert sorted(p[0] for p in popped) == sorted(keys)


@given(st.lists(st.tuples(st.sampled_from(["", "t1"]), st.integers(0, 50), st.booleans()), max_size=80))
def test_what_is_waiting_runs_urgent_first_then_in_key_order(pushes) -> None:
    feed: ElevatorFeed[int] = ElevatorFeed()
    for i, (domain, key, urgent) in enumerate(pushes):
        feed.push((domain, key), i, urgent=urgent)
    order = [feed.pop() for _ in pushes]
    expected = sorted(range(len(pushes)), key=lambda i: (not pushes[i][2], pushes[i][:2], i))
    assert order == expected


@given(operations)
def test_ahead_of_the_cursor_runs_this_sweep_behind_it_the_next(ops) -> None:
    _, _, pushed, popped = run(ops)
    for item, _, is_urgent, ran_in in popped:
        if is_urgent:
            continue
        sweep_at_push, ahead = pushed[item]
        assert ran_in == (sweep_at_push if ahead else sweep_at_push + 1), (item, pushed[item], ran_in)


@given(operations)
def test_an_urgent_item_overtakes_everything_waiting(ops) -> None:
    feed: ElevatorFeed[int] = ElevatorFeed()
    waiting: dict[int, bool] = {}
    for n, op in enumerate(ops):
        if op[0] == "push":
            feed.push((op[1], op[2]), n, urgent=op[3])
            waiting[n] = op[3]
        elif len(feed):
            item = feed.pop()
            assert waiting.pop(item) or not any(waiting.values())


@given(operations)
def test_domains_do_not_interleave_within_a_sweep(ops) -> None:
    _, _, _, popped = run(ops)
    sweeps: dict[int, list[str]] = {}
    for _, (domain, _), is_urgent, sweep in popped:
        if not is_urgent:
            sweeps.setdefault(sweep, []).append(domain)
    for domains in sweeps.values():
        runs = [d for i, d in enumerate(domains) if i == 0 or d != domains[i - 1]]
        assert len(runs) == len(set(runs)), domains


def test_a_late_job_joins_its_prefix_mates_in_the_running_sweep() -> None:
    """The case this exists for: job B arrives while job A is half-way up the keys."""
    feed: ElevatorFeed[str] = ElevatorFeed()
    for prompt in range(4):
        feed.push(("", prompt), f"A{prompt}")
    order = [feed.pop(), feed.pop()]  # A0, A1 started
    for prompt in range(4):
        feed.push(("", prompt), f"B{prompt}")
    order += [feed.pop() for _ in range(len(feed))]
    # B1 meets A1's prefix while it is cached; B0 waits for the next sweep
    assert order == ["A0", "A1", "B1", "A2", "B2", "A3", "B3", "B0"]


def test_removing_a_stopped_units_items() -> None:
    feed: ElevatorFeed[str] = ElevatorFeed()
    for i, name in enumerate(["a1", "b1", "a2", "b2"]):
        feed.push(("", i), name, urgent=name == "b2")
    assert feed.remove_if(lambda item: item.startswith("b")) == ["b2", "b1"]
    assert len(feed) == 2 and [feed.pop(), feed.pop()] == ["a1", "a2"]
