import math
import random
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.cost import (
    DEFAULT_TOKEN_COSTS,
    ListPrice,
    PeriodWork,
    TokenCosts,
    TokenWork,
    apportion,
    charged_micros,
    cost_breakdown,
    engine_cost_micros,
    fit_token_costs,
    kv_reads,
    list_price_micros,
    per_million,
    work_weight,
)
from scheduler.sla import BatchOutcome, SlaSummary, SlaTier, admit, eta, parse_tiers, sla_met, sla_summary
from scheduler.utilization import Accelerator, ModelShape, mbu, mfu, model_flops, utilization_columns

# --- token work -------------------------------------------------------------------------------


def test_token_work_adds_field_wise_and_uncached_never_negative():
    a = TokenWork(prompt_tokens=100, cached_tokens=40, output_tokens=7, requests=1, kv_tokens_read=5)
    b = TokenWork(prompt_tokens=10, cached_tokens=0, output_tokens=3, requests=2, kv_tokens_read=1)
    assert a + b == TokenWork(110, 40, 10, 3, 6)
    assert sum([a, b], TokenWork()) == a + b
    assert (a + b).uncached_tokens == 70
    assert TokenWork(prompt_tokens=5, cached_tokens=9).uncached_tokens == 0


@pytest.mark.parametrize(("output", "expected"), [(0, 0), (1, 3), (2, 7), (-1, 0)])
def test_kv_reads_small_cases(output, expected):
    assert kv_reads(3, output) == expected


@given(st.integers(0, 500), st.integers(0, 200))
def test_kv_reads_matches_step_by_step_sum(prompt, output):
    assert kv_reads(prompt, output) == sum(prompt + i for i in range(output))


def test_work_weight_prices_each_kind_of_token():
    work = TokenWork(prompt_tokens=300, cached_tokens=200, output_tokens=90)
    assert work_weight(work, TokenCosts(prefill=2.0, cached=0.5, decode=3.0)) == 100 * 2 + 200 * 0.5 + 90 * 3
    assert work_weight(work, DEFAULT_TOKEN_COSTS) == pytest.approx(100 + 10 + 90)


# --- apportion --------------------------------------------------------------------------------

weights_st = st.dictionaries(
    st.text(min_size=1, max_size=4),
    st.floats(min_value=-10, max_value=1e6, allow_nan=False, allow_infinity=False),
    min_size=1,
    max_size=12,
)


@given(st.integers(0, 10**12), weights_st)
def test_apportion_sums_exactly_and_is_proportional_within_one(total, weights):
    shares = apportion(total, weights)
    assert list(shares) == list(weights)
    assert sum(shares.values()) == total
    assert all(s >= 0 for s in shares.values())
    positive = {k: Fraction(w) if w > 0 else Fraction(0) for k, w in weights.items()}
    whole = sum(positive.values())
    for k, share in shares.items():
        quota = total * positive[k] / whole if whole else Fraction(total, len(weights))
        assert abs(share - quota) < 1
        if whole and positive[k] == 0:
            assert share == 0  # a zero-weight key never gets a remainder unit


@given(st.integers(0, 10**6), weights_st, st.randoms(use_true_random=False))
def test_apportion_does_not_depend_on_insertion_order(total, weights, rnd):
    items = list(weights.items())
    rnd.shuffle(items)
    assert apportion(total, dict(items)) == apportion(total, weights)


def test_apportion_splits_equally_when_all_weights_are_zero_or_negative():
    assert apportion(10, {"c": 0.0, "a": 0.0, "b": 0.0}) == {"c": 3, "a": 4, "b": 3}
    assert apportion(5, {"x": -2.0, "y": 0.0}) == {"x": 3, "y": 2}


def test_apportion_breaks_ties_by_sorted_key():
    assert apportion(1, {"b": 1.0, "a": 1.0}) == {"b": 0, "a": 1}
    assert apportion(2, {3: 1.0, 1: 1.0, 2: 1.0}) == {3: 0, 1: 1, 2: 1}
    assert apportion(7, {"a": 1.0, "b": 2.0}) == {"a": 2, "b": 5}  # 2.33 / 4.67: b has the larger remainder


def test_apportion_edge_cases():
    assert apportion(0, {}) == {}
    assert apportion(0, {"a": 1.0}) == {"a": 0}
    with pytest.raises(ValueError, match="no keys"):
        apportion(1, {})
    with pytest.raises(ValueError, match="negative"):
        apportion(-1, {"a": 1.0})
    with pytest.raises(ValueError, match="finite"):
        apportion(1, {"a": math.inf})


# --- fitting token costs ----------------------------------------------------------------------


def _synthetic(costs: TokenCosts, n: int, seed: int = 7) -> list[PeriodWork]:
    rnd = random.Random(seed)
    periods = []
    for _ in range(n):
        cached = rnd.randint(0, 50_000)
        work = TokenWork(
            prompt_tokens=cached + rnd.randint(0, 40_000),
            cached_tokens=cached,
            output_tokens=rnd.randint(0, 20_000),
        )
        periods.append(PeriodWork(work_weight(work, costs), work))
    return periods


def test_fit_recovers_known_coefficients_from_exact_data():
    true = TokenCosts(prefill=2e-4, cached=1e-5, decode=8e-4)
    fit = fit_token_costs(_synthetic(true, 20), fallback=DEFAULT_TOKEN_COSTS)
    for name in ("prefill", "cached", "decode"):
        assert getattr(fit, name) == pytest.approx(getattr(true, name), rel=1e-6)


def test_fit_keeps_a_zero_cached_cost():
    true = TokenCosts(prefill=3e-4, cached=0.0, decode=9e-4)
    fit = fit_token_costs(_synthetic(true, 20, seed=3), fallback=DEFAULT_TOKEN_COSTS)
    assert fit.cached == pytest.approx(0.0, abs=1e-12)
    assert fit.prefill == pytest.approx(3e-4, rel=1e-6)
    assert fit.decode == pytest.approx(9e-4, rel=1e-6)


def test_fit_clamps_a_negative_unconstrained_coefficient_to_zero():
    # Seconds fall as cached tokens rise: plain least squares would give cached < 0.
    true = TokenCosts(prefill=2e-4, cached=0.0, decode=8e-4)
    periods = [
        PeriodWork(p.seconds - 1e-6 * p.work.cached_tokens, p.work) for p in _synthetic(true, 20, seed=5)
    ]
    fit = fit_token_costs(periods, fallback=DEFAULT_TOKEN_COSTS)
    assert fit != DEFAULT_TOKEN_COSTS
    assert fit.cached == 0.0
    assert fit.prefill > 0 and fit.decode > 0


def test_fit_falls_back_with_too_few_busy_periods():
    fallback = TokenCosts(prefill=1.0, cached=0.1, decode=2.0)
    periods = _synthetic(TokenCosts(2e-4, 1e-5, 8e-4), 8)
    assert fit_token_costs(periods[:7], fallback) is fallback
    idle = [PeriodWork(0.0, periods[0].work)]
    assert fit_token_costs(periods[:7] + idle, fallback) is fallback
    assert fit_token_costs(periods, fallback) is not fallback
    assert fit_token_costs(periods, fallback, min_periods=9) is fallback


def test_fit_falls_back_on_singular_or_degenerate_data():
    fallback = TokenCosts(prefill=1.0, cached=0.1, decode=2.0)
    no_cache = [
        PeriodWork(
            p.seconds, TokenWork(prompt_tokens=p.work.uncached_tokens, output_tokens=p.work.output_tokens)
        )
        for p in _synthetic(TokenCosts(2e-4, 0.0, 8e-4), 20)
    ]
    assert fit_token_costs(no_cache, fallback) is fallback
    # Time explained by cached tokens alone: prefill and decode both fit to 0.
    only_cached = [
        PeriodWork(1e-5 * p.work.cached_tokens, p.work) for p in _synthetic(TokenCosts(1, 1, 1), 20)
    ]
    assert fit_token_costs(only_cached, fallback) is fallback


period_st = st.builds(
    PeriodWork,
    seconds=st.floats(min_value=0, max_value=1e4, allow_nan=False),
    work=st.builds(
        lambda uncached, cached, output: TokenWork(uncached + cached, cached, output),
        st.integers(0, 10**5),
        st.integers(0, 10**5),
        st.integers(0, 10**5),
    ),
)


@given(st.lists(period_st, min_size=1, max_size=30))
def test_fit_never_negative_and_is_the_nnls_optimum(periods):
    fallback = TokenCosts(prefill=1.0, cached=0.05, decode=1.0)
    fit = fit_token_costs(periods, fallback, min_periods=1)
    x = (fit.prefill, fit.cached, fit.decode)
    assert all(v >= 0 and math.isfinite(v) for v in x)
    if fit is fallback:
        return
    busy = [p for p in periods if p.seconds > 0]
    rows = [(p.work.uncached_tokens, p.work.cached_tokens, p.work.output_tokens) for p in busy]
    residual = [sum(c * r[j] for j, c in enumerate(x)) - p.seconds for r, p in zip(rows, busy, strict=True)]
    # KKT: the gradient A^T(Ax - y) is ~0 where x > 0 and >= ~0 where x == 0.
    scale = sum(abs(r[j]) for r in rows for j in range(3)) * (sum(abs(p.seconds) for p in busy) + 1)
    for j in range(3):
        grad = sum(r[j] * e for r, e in zip(rows, residual, strict=True))
        assert grad >= -1e-7 * scale
        if x[j] > 0:
            assert abs(grad) <= 1e-7 * scale


# --- money ------------------------------------------------------------------------------------


def test_engine_cost_micros():
    assert engine_cost_micros(3600, 2.0) == 2_000_000
    assert engine_cost_micros(1.0, 3.6) == 1000
    assert engine_cost_micros(0, 5.0) == 0
    assert engine_cost_micros(1.125, 1.0) == 313  # exactly 312.5: half up, not to even
    with pytest.raises(ValueError, match="seconds"):
        engine_cost_micros(-1, 2.0)
    with pytest.raises(ValueError, match="price_per_hour"):
        engine_cost_micros(1, math.nan)


def test_cost_breakdown_by_engine_time_of_each_kind():
    work = TokenWork(prompt_tokens=300, cached_tokens=200, output_tokens=90)
    # weights 100, 200 * 0.05 = 10, 90 -> 500 / 50 / 450 of 1000
    assert cost_breakdown(1000, work, DEFAULT_TOKEN_COSTS) == {
        "input": 500,
        "cached_input": 50,
        "output": 450,
    }


@given(
    st.integers(0, 10**10),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.floats(0, 10),
    st.floats(0, 10),
    st.floats(0, 10),
)
def test_cost_breakdown_sums_to_cost(cost, uncached, cached, output, prefill, cached_cost, decode):
    work = TokenWork(uncached + cached, cached, output)
    parts = cost_breakdown(cost, work, TokenCosts(prefill, cached_cost, decode))
    assert set(parts) == {"input", "cached_input", "output"}
    assert sum(parts.values()) == cost
    assert all(v >= 0 for v in parts.values())


def test_per_million():
    assert per_million(2_000_000, 1_000_000) == 2.0  # $2 for 1M tokens
    assert per_million(500, 1000) == 0.5
    assert per_million(5, 0) is None


def test_list_price_micros():
    work = TokenWork(prompt_tokens=1_000_000, cached_tokens=400_000, output_tokens=100_000)
    price = ListPrice(input=2.5, cached_input=1.25, output=10.0)
    assert list_price_micros(work, price) == 1_500_000 + 500_000 + 1_000_000
    assert list_price_micros(TokenWork(output_tokens=1), ListPrice(0, 0, 0.5)) == 1  # 0.5 rounds up
    assert list_price_micros(TokenWork(output_tokens=1), ListPrice(0, 0, 0.49)) == 0


# --- utilisation ------------------------------------------------------------------------------


def test_mfu_hand_computed():
    model = ModelShape(parameters=7_000_000_000, bytes_per_parameter=2, kv_bytes_per_token=131_072)
    acc = Accelerator(peak_flops=1e15, memory_bandwidth=3e12, memory_bytes=80 * 2**30)
    work = TokenWork(prompt_tokens=1500, cached_tokens=500, output_tokens=500)  # 1000 + 500 computed
    assert model_flops(work, model) == 2 * 7e9 * 1500
    assert mfu(work, 2.0, model, acc) == pytest.approx(2.1e13 / 2e15)
    assert mfu(work, 0.0, model, acc) is None
    assert mfu(work, 1.0, model, Accelerator(0.0, 3e12, 1)) is None


def test_mbu_hand_computed():
    model = ModelShape(parameters=1_000_000_000, bytes_per_parameter=2, kv_bytes_per_token=100_000)
    acc = Accelerator(peak_flops=1e15, memory_bandwidth=3e12, memory_bytes=80 * 2**30)
    work = TokenWork(kv_tokens_read=1_000_000)
    # 100 steps * 2e9 bytes of weights + 1e6 * 1e5 bytes of KV = 3e11 bytes in 1 s of 3e12 B/s
    assert mbu(100, work, 1.0, model, acc) == pytest.approx(0.1)
    assert mbu(100, work, 0.5, model, acc) == pytest.approx(0.2)
    assert mbu(100, work, -1.0, model, acc) is None
    assert mbu(100, work, 1.0, model, Accelerator(1e15, 0.0, 1)) is None


def test_utilization_columns_of_a_unit_or_sample():
    """What the recorder writes on a unit and the watcher on a sample: both estimates with the
    model size they assume; all None when the model's shape is unknown."""
    model = ModelShape(parameters=1_000_000_000, bytes_per_parameter=2, kv_bytes_per_token=100_000)
    acc = Accelerator(peak_flops=1e15, memory_bandwidth=3e12, memory_bytes=80 * 2**30)
    work = TokenWork(prompt_tokens=1000, output_tokens=500, kv_tokens_read=1_000_000)
    assert utilization_columns(work, 1.0, 100, model, acc) == {
        "model_parameters": 1_000_000_000,
        "bytes_per_parameter": 2,
        "mfu": mfu(work, 1.0, model, acc),
        "mbu": pytest.approx(0.1),
    }
    assert set(utilization_columns(work, 1.0, 100, None, acc).values()) == {None}


# --- SLA tiers and admission ------------------------------------------------------------------


def test_parse_tiers_good():
    assert parse_tiers("1h:2,4h:1.5,24h:1,7d:0.75") == (
        SlaTier("1h", 3600, 2.0),
        SlaTier("4h", 14_400, 1.5),
        SlaTier("24h", 86_400, 1.0),
        SlaTier("7d", 604_800, 0.75),
    )
    assert parse_tiers(" 24h , 90s: 3 ,30m,1.5h:1") == (
        SlaTier("24h", 86_400, 1.0),
        SlaTier("90s", 90, 3.0),
        SlaTier("30m", 1800, 1.0),
        SlaTier("1.5h", 5400, 1.0),
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no SLA tiers"),
        ("   ", "no SLA tiers"),
        ("1x:2", "'1x:2': bad duration"),
        ("h:2", "'h:2': bad duration"),
        ("0s", "'0s': bad duration"),
        ("-1h", "'-1h': bad duration"),
        ("1h,", "'': bad duration"),
        ("1h:abc", "'1h:abc': multiplier 'abc'"),
        ("1h:", "'1h:': multiplier ''"),
        ("1h:0", "'1h:0': multiplier"),
        ("1h:-1", "'1h:-1': multiplier"),
        ("1h:inf", "'1h:inf': multiplier"),
        ("1h:nan", "'1h:nan': multiplier"),
        ("1h:2,24h,1h:3", "'1h:3': duplicate window"),
        ("24h:1,1d:0.5", r"'1d:0.5': duplicate window \(same as '24h'\)"),
    ],
)
def test_parse_tiers_bad(text, message):
    with pytest.raises(ValueError, match=message):
        parse_tiers(text)


def test_eta():
    assert eta(10, 20, 5.0, now=1000.0) == 1006.0
    assert eta(10, -5, 5.0, now=1000.0) == 1002.0
    assert eta(10, 0, None, now=1000.0) is None
    assert eta(10, 0, 0.0, now=1000.0) is None
    assert eta(0, 50, None, now=1000.0) == 1000.0


@pytest.mark.parametrize(
    ("finished_at", "status", "expected"),
    [
        (None, "in_progress", None),
        (900.0, "completed", True),
        (1000.0, "completed", True),
        (1000.5, "completed", False),
        (900.0, "failed", False),
        (900.0, "expired", False),
        (900.0, "cancelled", None),
    ],
)
def test_sla_met(finished_at, status, expected):
    assert sla_met(finished_at, 1000.0, status) is expected


def test_admit_each_policy():
    deadline = 1_700_000_000.0  # 2023-11-14T22:13:20Z
    late = deadline + 3600
    for policy in ("off", "warn", "refuse"):
        assert admit(None, deadline, policy, "24h") == admit(deadline, deadline, policy, "24h")
        assert admit(None, deadline, policy, "24h").accept
        assert admit(deadline - 1, deadline, policy, "24h").warning is None
    off = admit(late, deadline, "off", "24h")
    assert off.accept and off.warning is None
    warn = admit(late, deadline, "warn", "24h")
    assert warn.accept
    assert "2023-11-14T23:13:20Z" in warn.warning and "2023-11-14T22:13:20Z" in warn.warning
    refuse = admit(late, deadline, "refuse", "24h")
    assert not refuse.accept
    assert refuse.warning.startswith("batch would finish at 2023-11-14T23:13:20Z, after its 24h deadline")
    assert "2023-11-14T22:13:20Z" in refuse.warning and "longer completion_window" in refuse.warning
    with pytest.raises(ValueError, match="'bogus'"):
        admit(None, deadline, "bogus", "24h")


# --- SLA summary ------------------------------------------------------------------------------


def _outcome(tenant, model, status, finished_at, deadline=1000.0, requests=10):
    return BatchOutcome(tenant, model, finished_at, sla_met(finished_at, deadline, status), requests)


def test_sla_summary_groups_and_totals():
    outcomes = [
        _outcome("t2", "m", "completed", 500.0, requests=100),
        _outcome("t1", "m", "completed", 999.0, requests=30),
        _outcome("t1", "m", "completed", 1500.0, requests=40),  # late
        _outcome("t1", "m", "failed", 800.0),
        _outcome("t1", "a", "expired", 1000.0),
        _outcome("t1", "m", "in_progress", None),  # not final: left out
        _outcome("t1", "m", "cancelled", 900.0),  # no verdict: left out
        _outcome("t1", "m", "completed", 7200.0),  # finished at `until`: outside [since, until)
        _outcome("t9", "m", "completed", -1.0),  # before `since`
    ]
    rows = sla_summary(outcomes, since=0.0, until=7200.0)  # two hours
    assert rows == [
        SlaSummary(
            "t1",
            "a",
            batches=1,
            met=0,
            attainment=0.0,
            goodput_batches_per_hour=0.0,
            goodput_requests_per_hour=0.0,
        ),
        SlaSummary("t1", "m", 3, 1, 1 / 3, goodput_batches_per_hour=0.5, goodput_requests_per_hour=15.0),
        SlaSummary("t2", "m", 1, 1, 1.0, goodput_batches_per_hour=0.5, goodput_requests_per_hour=50.0),
        SlaSummary("*", "*", 5, 2, 0.4, goodput_batches_per_hour=1.0, goodput_requests_per_hour=65.0),
    ]


def test_sla_summary_empty_window_and_bad_window():
    assert sla_summary([], since=0.0, until=3600.0) == [SlaSummary("*", "*", 0, 0, None, 0.0, 0.0)]
    with pytest.raises(ValueError, match="until"):
        sla_summary([], since=10.0, until=10.0)


@given(st.integers(0, 10**12), st.sampled_from([0.5, 0.75, 1.0, 1.5, 2.0, 3.0]))
def test_charged_micros_is_cost_times_multiplier_rounded_half_up(cost, multiplier):
    from fractions import Fraction

    exact = Fraction(cost) * Fraction(multiplier)
    charged = charged_micros(cost, multiplier)
    assert abs(Fraction(charged) - exact) <= Fraction(1, 2)
    assert charged_micros(3, 1.5) == 5  # 4.5 rounds up
