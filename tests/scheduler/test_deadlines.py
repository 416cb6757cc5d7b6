from hypothesis import given
from hypothesis import strategies as st

from scheduler.deadlines import BatchLoad, Sample, assess, eta_moved, measured_rates, seconds_needed


def test_rates_are_busy_time_rates_summed_over_workers():
    samples = [
        Sample("w1", "m", started_at=950, seconds=10, requests=100),
        Sample("w1", "m", started_at=970, seconds=10, requests=100),  # w1: 10 req/s
        Sample("w2", "m", started_at=990, seconds=5, requests=25),  # w2: 5 req/s
        Sample("w1", "m", started_at=100, seconds=10, requests=9999),  # outside the window
        Sample("w1", "other", started_at=990, seconds=4, requests=8),
    ]
    assert measured_rates(samples, now=1000, window=600) == {"m": 15.0, "other": 2.0}


def test_no_samples_means_no_rate_and_no_risk():
    verdicts = assess([BatchLoad("b", "m", deadline=1010, remaining=10**6)], {}, now=1000, urgent_slack=5)
    assert verdicts == {"b": (False, False)}
    assert seconds_needed(100, None) == 0.0


def test_at_risk_counts_the_work_ahead_by_deadline():
    loads = [
        BatchLoad("early", "m", deadline=1100, remaining=500),
        BatchLoad("late", "m", deadline=1120, remaining=500),
    ]
    verdicts = assess(loads, {"m": 10.0}, now=1000, urgent_slack=30)
    # early: 50 s of work, 100 s left -> fine but not urgent; late: 100 s of work, 120 s left -> urgent
    assert verdicts == {"early": (False, False), "late": (True, False)}
    verdicts = assess(loads, {"m": 5.0}, now=1000, urgent_slack=30)
    assert verdicts == {"early": (True, False), "late": (True, True)}


def test_other_models_work_is_not_ahead():
    loads = [
        BatchLoad("a", "m1", deadline=1100, remaining=10_000),
        BatchLoad("b", "m2", deadline=1200, remaining=10),
    ]
    assert assess(loads, {"m1": 1.0, "m2": 1.0}, now=1000, urgent_slack=0)["b"] == (False, False)


@given(st.lists(st.tuples(st.integers(1000, 5000), st.integers(0, 10_000)), min_size=1, max_size=20),
       st.floats(0.1, 1000))  # fmt: skip
def test_risk_is_monotone_in_deadline_order(specs, rate):
    loads = [BatchLoad(f"b{i}", "m", d, r) for i, (d, r) in enumerate(specs)]
    verdicts = assess(loads, {"m": rate}, now=1000, urgent_slack=60)
    for load in loads:
        urgent, risk = verdicts[load.batch_id]
        hopeless = load.deadline <= 1000 or load.deadline - 1000 - load.remaining / rate < 0
        assert urgent != hopeless if risk else not (urgent and hopeless)  # at risk: urgent unless hopeless
        ahead = sum(o.remaining for o in loads if (o.deadline, o.batch_id) < (load.deadline, load.batch_id))
        assert risk == (load.deadline - 1000 - (ahead + load.remaining) / rate < 0)


def test_etas_run_each_models_batches_earliest_deadline_first():
    from scheduler.deadlines import etas

    loads = [
        BatchLoad("late", "m", deadline=2000, remaining=100),
        BatchLoad("soon", "m", deadline=1000, remaining=50),
        BatchLoad("other", "n", deadline=500, remaining=10),
        BatchLoad("done", "m", deadline=100, remaining=0),
    ]
    finish = etas(loads, {"m": 10.0}, now=0.0)
    assert finish["soon"] == 5.0  # 50 requests at 10/s
    assert finish["late"] == 15.0  # behind "soon": 150 requests
    assert finish["done"] == 0.0  # nothing left: now
    assert finish["other"] is None  # no measured rate for model n yet


def test_a_batch_that_cannot_make_its_deadline_even_alone_is_not_urgent():
    """Issue #19, section 3: hurrying a hopeless batch only makes the others late."""
    loads = [
        BatchLoad("hopeless", "m", deadline=1010, remaining=1000),  # 100 s of work, 10 s left
        BatchLoad("past", "m", deadline=990, remaining=1),
        BatchLoad("tight", "m", deadline=1200, remaining=100),  # 10 s of work (+100 s ahead), 200 s left
    ]
    verdicts = assess(loads, {"m": 10.0}, now=1000, urgent_slack=900)
    assert verdicts == {"hopeless": (False, True), "past": (False, True), "tight": (True, False)}


def test_an_eta_is_rewritten_only_once_it_moves_past_its_jitter():
    now = 1_000
    assert eta_moved(None, 2_000, now) and eta_moved(2_000, None, now) and not eta_moved(None, None, now)
    assert not eta_moved(2_000, 2_004, now)  # within 5 s
    assert not eta_moved(4_600, 4_660, now)  # an hour out: within 2% of it
    assert eta_moved(4_600, 4_700, now)
    assert eta_moved(1_010, 1_016, now)  # close to now, 5 s is what counts
