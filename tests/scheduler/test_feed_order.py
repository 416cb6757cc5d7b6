"""The worker's elevator feed (scheduler/feed_order.py), as properties over any sequence of pushes,
pops and finishes: nothing is lost or duplicated, a sweep runs in key order, a request that
arrives at or past the sweep's trailing edge (the prompt started last, or a lower one still
running) runs in the current sweep and one behind it in the next (so nothing waits more than one
sweep), urgent requests overtake everything waiting, and cache domains never interleave within a
sweep of requests that finish as they start."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler.feed_order import ElevatorFeed

# ("push", domain, prompt, urgent), ("pop",) or ("finish", which of the running items)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from(["", "t1", "t2"]), st.integers(0, 20), st.booleans()),
        st.tuples(st.just("pop")),
        st.tuples(st.just("finish"), st.integers(0, 1000)),
    ),
    max_size=150,
)


def run(ops, finish_at_once: bool = False):
    """Apply ``ops``, then drain. Keys are (domain, prompt, item number); the first two name the
    prompt. Returns each item's key and urgency, for every item the sweep counter when it was
    pushed and the sweep it should run in by the rule (computed here from the items this test
    saw start and not finish), and the pops as (item, sweep it ran in).

    ``finish_at_once``: every item finishes as soon as it starts (nothing holds the edge back)."""
    feed: ElevatorFeed[int] = ElevatorFeed(prompt_fields=2)
    keys: dict[int, tuple[str, int, int]] = {}
    urgent: dict[int, bool] = {}
    expected: dict[int, int] = {}
    popped: list[tuple[int, int]] = []
    running: list[int] = []  # started, not finished, not urgent
    cursor: tuple[str, int] | None = None

    def finish(i: int) -> None:
        item = running.pop(i % len(running))
        feed.done(keys[item])

    for op in [*ops, *[("pop",)] * 200]:
        if op[0] == "push":
            item = len(keys)
            keys[item], urgent[item] = (op[1], op[2], item), op[3]
            prompt = keys[item][:2]
            edge = None if cursor is None else min([cursor, *(keys[r][:2] for r in running)])
            joins = edge is None or prompt >= edge
            expected[item] = feed.sweeps + (0 if joins and cursor is not None else 1)
            feed.push(keys[item], item, urgent=op[3])
        elif op[0] == "pop" and len(feed):
            item = feed.pop()
            popped.append((item, feed.sweeps))
            if not urgent[item]:
                cursor = keys[item][:2]
                running.append(item)
                if finish_at_once:
                    finish(-1)
        elif op[0] == "finish" and running:
            finish(op[1])
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


@given(operations, st.booleans())
def test_at_or_past_the_trailing_edge_runs_this_sweep_behind_it_the_next(ops, at_once) -> None:
    _, urgent, expected, popped = run(ops, finish_at_once=at_once)
    for item, ran_in in popped:
        if not urgent[item]:
            assert ran_in == expected[item], (item, expected[item], ran_in)


@given(operations)
def test_a_sweep_runs_in_key_order_while_nothing_holds_the_edge_back(ops) -> None:
    """Within a sweep, every item runs after the lower ones (requests finishing as they start)."""
    keys, urgent, _, popped = run(ops, finish_at_once=True)
    last: dict[int, tuple[str, int]] = {}
    for item, sweep in popped:
        if urgent[item]:
            continue
        assert sweep not in last or keys[item][:2] >= last[sweep], (item, popped)
        last[sweep] = keys[item][:2]


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


@given(operations)
def test_domains_do_not_interleave_within_a_sweep(ops) -> None:
    keys, urgent, _, popped = run(ops, finish_at_once=True)
    sweeps: dict[int, list[str]] = {}
    for item, sweep in popped:
        if not urgent[item]:
            sweeps.setdefault(sweep, []).append(keys[item][0])
    for domains in sweeps.values():
        runs = [d for i, d in enumerate(domains) if i == 0 or d != domains[i - 1]]
        assert len(runs) == len(set(runs)), domains


def test_a_late_job_joins_its_prefix_mates_in_the_running_sweep() -> None:
    """The case this exists for: job B arrives while job A is half-way up the keys."""
    feed: ElevatorFeed[str] = ElevatorFeed(prompt_fields=2)
    for prompt in range(4):
        feed.push(("", prompt, 0), f"A{prompt}")
    order = [feed.pop(), feed.pop(), feed.pop()]  # A0, A1, A2 started
    feed.done(("", 0, 0))  # A0 finished; A1 and A2 still hold their prefixes in the KV cache
    for prompt in range(4):
        feed.push(("", prompt, 1), f"B{prompt}")
    order += [feed.pop() for _ in range(len(feed))]
    # B1 meets A1's prefix while A1 still runs, B2 A2's; B0 waits for the next sweep
    assert order == ["A0", "A1", "A2", "B1", "B2", "A3", "B3", "B0"]
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
