"""The worker's elevator feed (scheduler/feed_order.py), as properties over any sequence of pushes
and pops: nothing is lost or duplicated, a sweep runs in key order, a request that arrives at or
past the prompt started last runs in the current sweep and one behind it in the next (so nothing
waits more than one sweep), each cache domain sweeping on its own; urgent requests overtake
everything waiting, and domains take turns of at most a quantum while another waits."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.feed_order import ElevatorFeed, gather_deadline

DOMAINS = ["", "t1", "t2"]
# ("push", domain, prompt, urgent) or ("pop",)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from(DOMAINS), st.integers(0, 20), st.booleans()),
        st.tuples(st.just("pop")),
    ),
    max_size=150,
)


def run(ops, quantum: int | None = 3):
    """Apply ``ops``, then drain. Keys are (domain, prompt, item number); the first two name the
    prompt, the first the domain. Returns each item's key and urgency, for every item the sweep of
    its domain it should run in by the rule (computed here from the prompt of its domain this test
    saw start last), and the pops as (item, its domain's sweep it ran in)."""
    feed: ElevatorFeed[int] = ElevatorFeed(prompt_fields=2, domain_fields=1, quantum=quantum)
    keys: dict[int, tuple[str, int, int]] = {}
    urgent: dict[int, bool] = {}
    expected: dict[int, int] = {}
    popped: list[tuple[int, int]] = []
    cursor: dict[str, tuple[str, int]] = {}  # per domain: its prompt started last
    for op in [*ops, *[("pop",)] * 200]:
        if op[0] == "push":
            item = len(keys)
            keys[item], urgent[item] = (op[1], op[2], item), op[3]
            domain = op[1]
            joins = domain in cursor and keys[item][:2] >= cursor[domain]
            expected[item] = feed.lane_sweeps((domain,)) + (0 if joins else 1)
            feed.push(keys[item], item, urgent=op[3])
        elif op[0] == "pop" and len(feed):
            item = feed.pop()
            popped.append((item, feed.lane_sweeps((keys[item][0],))))
            if not urgent[item]:
                cursor[keys[item][0]] = keys[item][:2]
    return keys, urgent, expected, popped


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
def test_at_or_past_the_prompt_started_last_runs_this_sweep_behind_it_the_next(ops) -> None:
    _, urgent, expected, popped = run(ops)
    for item, ran_in in popped:
        if not urgent[item]:
            assert ran_in == expected[item], (item, expected[item], ran_in)


@given(operations)
def test_a_sweep_runs_in_key_order(ops) -> None:
    """Within a sweep of a domain, every item runs after the lower ones."""
    keys, urgent, _, popped = run(ops)
    last: dict[tuple[str, int], tuple[str, int]] = {}
    for item, sweep in popped:
        if urgent[item]:
            continue
        lane = (keys[item][0], sweep)
        assert lane not in last or keys[item][:2] >= last[lane], (item, popped)
        last[lane] = keys[item][:2]


@given(operations)
def test_an_urgent_item_overtakes_everything_waiting(ops) -> None:
    feed: ElevatorFeed[int] = ElevatorFeed()
    waiting: dict[int, bool] = {}
    for n, op in enumerate(ops):
        if op[0] == "push":
            feed.push((op[1], op[2]), n, urgent=op[3])
            waiting[n] = op[3]
        elif op[0] == "pop" and len(feed):
            item = feed.pop()
            assert waiting.pop(item) or not any(waiting.values())


@given(operations, st.integers(1, 5))
def test_domains_take_turns_of_at_most_a_quantum_while_another_waits(ops, quantum) -> None:
    """While a domain has requests waiting, every other domain starts at most ``quantum`` requests
    before it gets its turn (urgent ones aside)."""
    feed: ElevatorFeed[int] = ElevatorFeed(prompt_fields=2, domain_fields=1, quantum=quantum)
    domain_of: dict[int, str] = {}
    waiting: dict[str, int] = {}
    overtaken: dict[str, int] = {}  # per waiting domain: requests of others started since its last
    for op in [*ops, *[("pop",)] * 200]:
        if op[0] == "push":
            item = len(domain_of)
            domain_of[item] = "" if op[3] else op[1]  # urgent items aside
            feed.push((op[1], op[2], item), item, urgent=op[3])
            if not op[3]:
                waiting[op[1]] = waiting.get(op[1], 0) + 1
                overtaken.setdefault(op[1], 0)
        elif op[0] == "pop" and len(feed):
            urgent_first = feed.urgent_waiting
            item = feed.pop()
            if urgent_first:
                continue
            domain = domain_of[item]
            waiting[domain] -= 1
            overtaken[domain] = 0
            for other, n in waiting.items():
                if other != domain and n:
                    overtaken[other] += 1
                    # at most every other domain's turn comes first, each of at most a quantum
                    assert overtaken[other] <= quantum * (len(DOMAINS) - 1), (other, overtaken)


def test_a_stream_of_one_domain_cannot_hold_another_back() -> None:
    """The case the turns exist for: tenant A's requests keep arriving ahead of its cursor; B's
    one request runs after at most a quantum of A's."""
    feed: ElevatorFeed[str] = ElevatorFeed(prompt_fields=2, domain_fields=1, quantum=4)
    for prompt in range(4):
        feed.push(("a", prompt, 0), f"a{prompt}")
    order = [feed.pop()]
    feed.push(("b", 0, 0), "b0")
    for prompt in range(4, 40):  # A's next packs, every prompt past its cursor
        feed.push(("a", prompt, 0), f"a{prompt}")
        order.append(feed.pop())
    assert "b0" in order[:6], order[:6]


def test_a_late_job_joins_its_prefix_mates_in_the_running_sweep() -> None:
    """The case this exists for: job B arrives while job A is half-way up the keys."""
    feed: ElevatorFeed[str] = ElevatorFeed(prompt_fields=2)
    for prompt in range(4):
        feed.push(("", prompt, 0), f"A{prompt}")
    order = [feed.pop(), feed.pop(), feed.pop()]  # A0, A1, A2 started
    for prompt in range(4):
        feed.push(("", prompt, 1), f"B{prompt}")
    order += [feed.pop() for _ in range(len(feed))]
    # B2 meets A2's prefix, B3 runs next to A3; B0 and B1 wait for the next sweep (with C's, D's...)
    assert order == ["A0", "A1", "A2", "B2", "A3", "B3", "B0", "B1"]
    assert feed.sweeps == 2


def test_a_late_request_of_the_running_prompt_joins_whatever_its_line() -> None:
    feed: ElevatorFeed[str] = ElevatorFeed(prompt_fields=2)
    feed.push(("", 5, 100), "A")  # line 100 of job A
    assert feed.pop() == "A"
    feed.push(("", 5, 3), "B")  # line 3 of job B: the same prompt, a lower line number
    feed.push(("", 4, 0), "C")  # a lower prompt, not running: next sweep
    assert feed.pop() == "B" and feed.sweeps == 1
    assert feed.pop() == "C" and feed.sweeps == 2


def test_removing_a_stopped_units_items() -> None:
    feed: ElevatorFeed[str] = ElevatorFeed()
    for i, name in enumerate(["a1", "b1", "a2", "b2"]):
        feed.push(("", i), name, urgent=name == "b2")
    assert feed.remove_if(lambda item: item.startswith("b")) == ["b2", "b1"]
    assert len(feed) == 2 and [feed.pop(), feed.pop()] == ["a1", "a2"]


def test_an_idle_engine_waits_for_known_batches_up_to_the_merge_window() -> None:
    # the pack said batches were validating: the merge window from the first request, whatever
    # the packs since
    assert gather_deadline(10.0, 11.5, True, merge_seconds=2.0, settle_seconds=0.3) == 12.0


def test_an_idle_engine_starts_once_packs_stop_coming() -> None:
    # nothing known to be validating: it starts settle_seconds after the last pack
    assert gather_deadline(10.0, 10.0, False, merge_seconds=2.0, settle_seconds=0.3) == 10.3
    assert gather_deadline(10.0, 10.4, False, merge_seconds=2.0, settle_seconds=0.3) == pytest.approx(10.7)


def test_the_settle_window_counts_from_the_newest_batchs_creation_when_the_pack_says_it() -> None:
    # a job alone whose validation took 1 s: a burst it belonged to would be validating by now
    assert gather_deadline(10.0, 10.0, False, merge_seconds=2.0, settle_seconds=0.3, newest_batch=9.0) == 10.0
    # one created 0.1 s before its pack came: the rest of the window
    assert gather_deadline(10.0, 10.0, False, 2.0, 0.3, newest_batch=9.9) == pytest.approx(10.2)
    # a pack after it says nothing newer: the window still counts from the creation, not the pack
    assert gather_deadline(10.0, 10.25, False, 2.0, 0.3, newest_batch=9.9) == pytest.approx(10.2)
    # batches validating: the merge window, whatever the creation
    assert gather_deadline(10.0, 10.0, True, 2.0, 0.3, newest_batch=5.0) == 12.0


def test_a_trickle_of_packs_cannot_hold_an_idle_engine() -> None:
    # a pack every 0.2 s would restart the settle window forever: the larger window caps it
    assert gather_deadline(10.0, 11.9, False, merge_seconds=2.0, settle_seconds=0.3) == 12.0
    assert gather_deadline(10.0, 14.0, False, merge_seconds=0.0, settle_seconds=3.0) == 13.0


@given(
    st.floats(0, 100),
    st.floats(0, 10),
    st.booleans(),
    st.floats(0, 60),
    st.floats(0, 60),
    st.none() | st.floats(0, 200),
)
def test_the_wait_is_bounded_and_windows_of_zero_are_off(first, pack_after, more, merge, settle, age) -> None:
    newest = None if age is None else first + pack_after - age  # created before its pack came
    start = gather_deadline(first, first + pack_after, more, merge, settle, newest)
    assert first <= start <= first + max(merge, settle)
    if newest is not None and not (more and merge > 0):  # never later than without the word
        assert start <= gather_deadline(first, first + pack_after, more, merge, settle)
    if settle == 0 and (merge == 0 or not more):
        assert start == first  # both waits off (or the only one on does not apply): at once


def test_a_turn_also_ends_after_its_time_while_another_domain_waits() -> None:
    """On a slow engine a quantum of requests runs long: the turn passes on after ``turn_seconds``
    from its first request as well, and not while no other domain waits."""
    now = [0.0]
    feed: ElevatorFeed[str] = ElevatorFeed(
        prompt_fields=2, domain_fields=1, quantum=1000, turn_seconds=5.0, clock=lambda: now[0]
    )
    for prompt in range(10):
        feed.push(("a", prompt, 0), f"a{prompt}")
    assert [feed.pop(), feed.pop()] == ["a0", "a1"]
    now[0] = 60.0  # A alone: its turn goes on however long it has held it
    assert feed.pop() == "a2"
    feed.push(("b", 0, 0), "b0")
    feed.push(("b", 1, 0), "b1")
    now[0] = 64.0  # A's turn began with a0 at 0 s: it is over, B has waited
    assert feed.pop() == "b0"
    now[0] = 68.0  # B's turn began at 64 s
    assert feed.pop() == "b1"
    assert feed.pop() == "a3"  # B ran dry: A's again
    now[0] = 72.9
    feed.push(("b", 2, 0), "b2")
    assert feed.pop() == "a4"  # A's new turn began at 68 s: under 5 s
    now[0] = 73.0
    assert feed.pop() == "b2"


def test_without_a_time_bound_the_turn_counts_requests_alone() -> None:
    now = [0.0]
    feed: ElevatorFeed[str] = ElevatorFeed(prompt_fields=2, domain_fields=1, quantum=3, clock=lambda: now[0])
    for prompt in range(5):
        feed.push(("a", prompt, 0), f"a{prompt}")
    feed.push(("b", 0, 0), "b0")
    now[0] = 1e6
    assert [feed.pop() for _ in range(4)] == ["a0", "a1", "a2", "b0"]
