"""The engine worker's cost meter: exact shares of busy time and cost, with a fake clock."""

from hypothesis import given
from hypothesis import strategies as st

from scheduler.cost import TokenWork, engine_cost_micros
from workers.cost_meter import CostMeter, UnitMeter


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def work(prompt=100, cached=0, output=10):
    return TokenWork(prompt, cached, output, 1, 0)


def test_a_period_is_split_by_weighted_tokens_and_sums_exactly():
    meter = CostMeter(price_per_hour=3.6, period_seconds=100, clock=Clock())  # $0.001 per second
    a, b = UnitMeter(), UnitMeter()
    meter.busy(2.0)
    meter.finished(1, a, work(prompt=300, output=0))
    meter.finished(2, b, work(prompt=100, output=0))
    meter.close()
    assert a.engine_us + b.engine_us == 2_000_000
    assert (a.engine_us, b.engine_us) == (1_500_000, 500_000)  # 3:1 by prefill tokens
    assert a.cost_micros + b.cost_micros == 2000 and a.cost_micros == 1500
    assert sum(a.parts.values()) == a.cost_micros and a.parts["input"] == a.cost_micros
    assert a.work.prompt_tokens == 300


def test_a_unit_settled_with_no_time_left_still_counts_its_work():
    meter = CostMeter(price_per_hour=3600, period_seconds=100, clock=Clock())
    a = UnitMeter()
    meter.finished(1, a, work(prompt=50))
    meter.close()  # no busy time since the last close: the work is settled, with no share
    assert a.work.prompt_tokens == 50 and a.engine_us == 0


def test_busy_time_with_nothing_finished_carries_to_the_next_period():
    meter = CostMeter(price_per_hour=3600, period_seconds=100, clock=Clock())  # $1 per second
    a = UnitMeter()
    meter.busy(1.0)
    meter.close()  # nothing finished: nobody to give it to
    assert a.engine_us == 0
    meter.busy(1.0)
    meter.finished(7, a, work())
    meter.close()
    assert a.engine_us == 2_000_000 and a.cost_micros == 2_000_000


def test_a_period_is_due_on_the_clock():
    clock = Clock()
    meter = CostMeter(price_per_hour=3600, period_seconds=5, clock=clock)
    meter.busy(1.0)
    assert not meter.due
    clock.t = 5.0
    assert meter.due
    meter.close()
    assert not meter.due


@given(
    st.lists(
        st.tuples(
            st.floats(0, 3, allow_nan=False),  # busy seconds before the event
            st.integers(0, 4),  # unit index
            st.integers(0, 2000),  # prompt
            st.integers(0, 2000),  # output
            st.booleans(),  # close after it
        ),
        max_size=40,
    ),
    st.sampled_from([0.0, 0.1, 2.5, 98.32]),
)
def test_everything_given_out_sums_to_the_busy_time_and_its_cost(events, price):
    meter = CostMeter(price_per_hour=price, period_seconds=1e9, clock=Clock())
    units = [UnitMeter() for _ in range(5)]
    busy_us = 0
    for seconds, i, prompt, output, close in events:
        meter.busy(seconds)
        busy_us += round(seconds * 1e6)
        meter.finished(i, units[i], TokenWork(prompt, prompt // 2, output, 1, 0))
        if close:
            meter.close()
    meter.close()  # every event finished something, so nothing is left over
    assert sum(u.engine_us for u in units) == busy_us
    assert sum(u.cost_micros for u in units) == engine_cost_micros(busy_us / 1e6, price)
    for u in units:
        assert sum(u.parts.values()) == u.cost_micros
