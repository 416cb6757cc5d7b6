"""The arithmetic of a price before the run (scheduler/estimate.py): pure, no database or engine."""

from __future__ import annotations

import pytest

from scheduler.cost import ListPrice, kv_reads
from scheduler.estimate import (
    MIN_FIT_SAMPLES,
    UNKNOWN,
    EngineModel,
    History,
    PlanTotals,
    SampleMoments,
    engine_rate,
    fit_engine_model,
    summary,
    typical_output,
)
from scheduler.ordering import prompt_key
from tests.factories import TRUE_ENGINE, mixed_engine_samples

SHARED = list(range(1, 301))  # a 300-token system prompt
PROMPTS = [SHARED + [1000 + i] * 10 for i in range(3)]  # 310 tokens each, sorted by their last ids


def plan_totals(
    rows: list[tuple[bytes, int, int]], block_size: int, typical_output: float | None = None
) -> PlanTotals:
    """``(key, prompt_len, budget)`` rows in prefix-sorted order, summed as validation sums them."""
    totals = PlanTotals(block_size, typical_output)
    for key, prompt_len, budget in rows:
        totals.add(key, prompt_len, budget)
    return totals


def rows(budgets: list[int]) -> list[tuple[bytes, int, int]]:
    return [(prompt_key(ids, 1024), len(ids), b) for ids, b in zip(PROMPTS, budgets, strict=True)]


def test_cached_tokens_follow_the_sorted_plan_in_whole_blocks():
    totals = plan_totals(rows([4, 4, 4]), block_size=128)
    # the first shares nothing; each next shares the 300-token prefix: 2 whole 128-token blocks
    assert (totals.requests, totals.prompt_tokens, totals.cached_tokens) == (3, 930, 512)
    assert plan_totals(rows([4, 4, 4]), block_size=16).cached_tokens == 2 * 288
    # out of prefix order (a prompt of another prefix between them) the hits are lost
    other = (prompt_key([7] * 310, 1024), 310, 4)
    first, *rest = rows([4, 4, 4])
    mixed = [first, other, *rest]
    assert plan_totals(mixed, block_size=128).cached_tokens == 256


def test_a_shared_prompt_never_counts_its_last_token():
    same = [(prompt_key(SHARED[:256], 1024), 256, 1)] * 2
    # 256 shared tokens, but vLLM computes the last prompt token: one block, not two
    assert plan_totals(same, block_size=128).cached_tokens == 128


def test_output_bounds_cap_the_typical_figure_by_each_budget():
    totals = plan_totals(rows([4, 50, 50]), block_size=128, typical_output=10.4)
    assert totals.output_max == 104 and totals.output_typical == 4 + 10 + 10
    assert plan_totals(rows([4, 50, 50]), block_size=128).output_typical == 0
    totals = PlanTotals(128)
    totals.add(b"", 3, 5, exact=False)
    assert totals.lower_bound_requests == 1


def test_history_figures_need_data():
    assert typical_output(200, 10) == 20 and typical_output(5, 0) is None
    assert engine_rate(1000, 4.0) == 250 and engine_rate(0, 4.0) is None and engine_rate(10, 0.0) is None


def test_without_history_time_and_cost_are_unknown_and_the_list_price_is_exact():
    totals = plan_totals(rows([18, 18, 18]), block_size=128)
    history = History(window_seconds=86400, typical_output=None, tokens_per_second=None, engines=0)
    out = summary(totals, history, 1.0, 2.0, ListPrice(input=1.0, cached_input=0.5, output=2.0))
    assert out["eta_seconds"] == UNKNOWN and out["engine_seconds"] == UNKNOWN
    assert out["cost"]["total"] == UNKNOWN
    assert out["output_tokens"] == {"max": 54, "typical": None, "typical_per_request": None}
    assert out["cache_hit_rate"] == round(512 / 930, 4)
    # 418 uncached x $1 + 512 cached x $0.5 + 54 output x $2, per 1M tokens: 782 micro-dollars
    assert out["cost"]["list_price"] == {"low": 0.000782, "high": 0.000782}
    assert summary(totals, history, 1.0, 2.0, None)["cost"]["list_price"] is None


def test_with_history_eta_and_cost_follow_the_measured_rate_and_the_tier():
    totals = plan_totals(rows([50, 50, 4]), block_size=128, typical_output=10)
    assert (totals.output_typical, totals.output_max) == (24, 104)
    history = History(window_seconds=86400, typical_output=10, tokens_per_second=100.0, engines=2)
    out = summary(totals, history, 2.0, 3.6, None)
    # computed tokens: 418 uncached prompt + 24 (typical) or 104 (every budget) output, at 100/s
    assert out["engine_seconds"] == {"low": 4.42, "high": 5.22}
    assert out["eta_seconds"] == {"low": 2.2, "high": 2.6, "engines": 2}  # spread over 2 engines
    # 4.42 s at $3.6/h is 4,420 micro-dollars, x2 for the tier
    assert out["cost"]["total"] == pytest.approx({"low": 0.00884, "high": 0.01044})
    assert out["output_tokens"] == {"max": 104, "typical": 24, "typical_per_request": 10}
    assert out["history"] == {
        "window_seconds": 86400,
        "tokens_per_second": 100.0,
        "engines": 2,
        "seconds_per_million": None,  # no fitted model: the one rate
    }
    # a rate with no engine running now still gives an ETA, as if one engine took it
    alone = summary(totals, History(86400, 10, 100.0, 0), 1.0, 0.0, None)
    assert alone["eta_seconds"]["engines"] == 1 and alone["cost"]["total"] == {"low": 0.0, "high": 0.0}


def moments(samples: list[tuple[float, float, float, float]]) -> SampleMoments:
    """(uncached prompt tokens, output tokens, KV reads, busy seconds) per sample, summed as the
    database sums them (workers.estimates.engine_sample_sums)."""
    xx = tuple(tuple(sum(x[i] * x[j] for x in samples) for j in range(3)) for i in range(3))
    xy = tuple(sum(x[i] * x[3] for x in samples) for i in range(3))
    return SampleMoments(len(samples), xx, xy)  # type: ignore[arg-type]


def test_the_fit_recovers_the_engine_model_from_samples_of_mixed_work():
    fit = fit_engine_model(moments(mixed_engine_samples(30)))
    assert fit is not None
    for got, want in (
        (fit.prefill, TRUE_ENGINE.prefill),
        (fit.decode, TRUE_ENGINE.decode),
        (fit.kv_read, TRUE_ENGINE.kv_read),
    ):
        assert got == pytest.approx(want, rel=1e-6)


def test_the_fit_needs_enough_samples_that_tell_the_terms_apart():
    assert fit_engine_model(moments(mixed_engine_samples(MIN_FIT_SAMPLES - 1))) is None
    # one mix only, scaled: every term moves with the others; nothing to tell them apart by
    same = [(1000.0 * i, 500.0 * i, 90_000.0 * i, 0.5 * i) for i in range(1, 20)]
    assert fit_engine_model(moments(same)) is None
    assert fit_engine_model(moments([(0.0, 10.0 * i, 100.0 * i, 1.0 * i) for i in range(1, 20)])) is None


def test_a_negative_kv_term_falls_back_to_prefill_and_decode():
    """KV reads that make the fit say 'more reads, less time' are not believed: the two-term fit."""
    no_kv = EngineModel(prefill=2e-4, decode=5e-4, kv_read=0.0)
    samples = [(u, o, k, no_kv.seconds(u, o, 0) - 1e-8 * k) for u, o, k, _ in mixed_engine_samples(30)]
    fit = fit_engine_model(moments(samples))
    assert fit is not None and fit.kv_read == 0.0 and fit.prefill > 0 and fit.decode > 0


def test_a_fitted_model_prices_the_files_own_mix():
    totals = plan_totals(rows([50, 50, 4]), block_size=128, typical_output=10)
    # each request's decode steps read its whole 310-token prompt plus what it wrote so far
    assert totals.kv_reads_max == 2 * kv_reads(310, 50) + kv_reads(310, 4)
    assert totals.kv_reads_typical == 2 * kv_reads(310, 10) + kv_reads(310, 4)
    history = History(86400, 10, 100.0, 2, model=TRUE_ENGINE)
    out = summary(totals, history, 1.0, 3.6, None)
    low = TRUE_ENGINE.seconds(418, 24, totals.kv_reads_typical)
    high = TRUE_ENGINE.seconds(418, 104, totals.kv_reads_max)
    assert out["engine_seconds"] == {"low": round(low, 3), "high": round(high, 3)}
    assert out["history"]["seconds_per_million"] == {
        "uncached_input_tokens": 150.0,
        "output_tokens": 300.0,
        "kv_entries_read": 0.4,
    }
