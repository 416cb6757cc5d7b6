"""bench.freight_runner.engine_samples_kv: KV-aware admission's report of a benchmark run (issue
#51 part 6), read from the engine_samples rows the stack's watcher wrote over the run's window, on
both databases."""

from __future__ import annotations

from bench.freight_runner import engine_samples_kv
from storage.models import EngineSample


def _sample(
    started_at: float, preemptions: int | None, planned: int | None, prompt: int, cached: int
) -> EngineSample:
    return EngineSample(
        worker="w", model="demo", started_at=started_at, seconds=5.0, steps=10, running_mean=4.0,
        waiting_mean=0.0, max_num_seqs=8, prompt_tokens=prompt, cached_tokens=cached, output_tokens=10,
        requests=4, preemptions=preemptions, planned_cached_tokens=planned,
    )  # fmt: skip


def test_the_runs_preemptions_and_hit_rate_gap_to_plan(runtime) -> None:
    url = runtime.settings.database_url
    assert engine_samples_kv(url, 100.0, 120.0) is None  # no rows yet
    with runtime.db.write() as s:
        s.add_all([
            _sample(98.0, 0, 800, 1000, 790),  # overlaps the window's start: counted whole
            _sample(103.0, 2, 1600, 2000, 1500),
            _sample(108.0, None, None, 1000, 900),  # admission by count, not counted: no plan
            _sample(200.0, 7, 0, 1000, 0),  # another run's
        ])  # fmt: skip
    report = engine_samples_kv(url, 100.0, 120.0)
    # planned 2400 of 3000 prompt tokens, measured 2290: 80% against 76.33%
    assert report == {
        "preemptions": 2,
        "planned_hit_pct": 80.0,
        "measured_hit_pct": 76.33,
        "hit_rate_gap_points": 3.67,
    }
    with runtime.db.write() as s:
        s.add(_sample(300.0, None, None, 1000, 10))
    # a core in its own process counts none and admission by count plans none: both unknown
    assert engine_samples_kv(url, 299.0, 301.0) == {
        "preemptions": None,
        "planned_hit_pct": None,
        "measured_hit_pct": None,
        "hit_rate_gap_points": None,
    }


def test_the_scheduler_report_holds_the_worst_repeat_to_the_kv_targets() -> None:
    from bench import scheduler as bs

    def run(preemptions: int | None, gap: float | None) -> dict:
        return {"kv_report": {"preemptions": preemptions, "hit_rate_gap_points": gap}}

    freight = {"output_tok_s": 9.0, "repeats": [run(0, 0.4), run(0, 1.6), run(None, None)]}
    counted_nothing = {"output_tok_s": 9.0, "kv_report": None}
    results = {
        "long_prefix": {"tight": {"freight": freight}, "default": {"freight": freight}},
        "shared_prefix": {"tight": {"freight": counted_nothing}},
        "request_rate": {"tight": {"freight": freight}},  # no shared prefix: no KV report
    }
    ratios = bs.compute_ratios(results, {}, {})
    assert (
        ratios["long_prefix_tight_kv"]["preemptions"],
        ratios["long_prefix_tight_kv"]["kv_plan_gap_points"],
    ) == (
        0,
        1.6,
    )
    assert "preemptions" not in ratios["long_prefix"] and "preemptions" not in ratios["request_rate_tight_kv"]
    targets = bs.evaluate_targets(ratios)
    assert targets["long_prefix_tight_kv.preemptions"]["pass"] is True
    assert targets["long_prefix_tight_kv.kv_plan_gap_points"]["pass"] is False  # 1.6 points over plan
    assert targets["shared_prefix_tight_kv.preemptions"]["pass"] is None  # not counted: not measured
    assert {f"{name}_tight_kv.preemptions" for name in bs.KV_REPORT_WORKLOADS} <= set(targets)
