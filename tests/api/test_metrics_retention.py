"""/metrics after the cleanup pruned old ``engine_samples`` rows: the counters (busy seconds,
engine cost, tokens) are the same as before, read from the sums kept in ``engine_sample_totals``
plus the rows kept; the worker gauges still come from the latest samples."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import func, select

from storage.models import EngineSample, EngineSampleTotal
from tests.api.test_metrics import metrics_app, named, sample, scrape, value
from workers import cleanup

DAY = 86400
COUNTERS = ("freight_engine_busy_seconds_total", "freight_engine_cost_dollars_total")


def test_counters_survive_pruning(runtime):
    t = time.time()
    with runtime.db.write() as s:
        for i in range(1200):  # old: more than one pruning pass (cleanup.PASS_ROWS) of them
            worker = "w1" if i % 3 else "w2"
            s.add(sample(worker, t - 3 * DAY + i, seconds=1.5, cost_micros=7, prompt_tokens=10,
                         cached_tokens=4, output_tokens=3, requests=1))  # fmt: skip
        s.add(sample("w1", t - 30, seconds=5.0, cost_micros=11, prompt_tokens=100, cached_tokens=25,
                     output_tokens=50, requests=2))  # fmt: skip
    client = metrics_app(runtime).test_client()
    before = scrape(client)
    assert value(before, "freight_tokens_total", worker="w1", model="demo", kind="prompt") == 800 * 10 + 100

    report = cleanup.run(runtime, t)
    assert report.samples_pruned == 1200
    with runtime.db.read() as s:
        assert s.scalar(select(func.count()).select_from(EngineSample)) == 1  # the recent one
        totals = {r.worker: r for r in s.scalars(select(EngineSampleTotal))}
    assert totals["w1"].samples == 800 and totals["w2"].samples == 400
    assert totals["w1"].seconds == pytest.approx(800 * 1.5) and totals["w2"].cost_micros == 400 * 7

    after = scrape(client)
    for name in COUNTERS:
        for worker in ("w1", "w2"):
            assert value(after, name, worker=worker, model="demo") == pytest.approx(
                value(before, name, worker=worker, model="demo")
            )
    for worker in ("w1", "w2"):
        for name, labels in (
            ("freight_tokens_total", {"kind": "prompt"}),
            ("freight_tokens_total", {"kind": "output"}),
            ("freight_cached_prompt_tokens_total", {}),
        ):
            assert value(after, name, worker=worker, model="demo", **labels) == value(
                before, name, worker=worker, model="demo", **labels
            )
    assert value(after, "freight_cached_prompt_tokens_total", worker="w2", model="demo") == 400 * 4
    # the latest sample still drives the gauges
    assert value(after, "freight_worker_cache_hit_ratio", worker="w1", model="demo") == 0.25

    assert cleanup.run(runtime, t).samples_pruned == 0  # a second pass adds nothing twice
    assert scrape(client) == after


def test_the_preemptions_counter_survives_pruning_and_leaves_out_what_was_not_counted(runtime):
    """freight_engine_preemptions_total (issue #51 part 6): the samples' counts, pruned or kept;
    a worker whose engine core runs in its own process counts none, and has no series rather than
    a 0 that would claim none happened."""
    t = time.time()
    with runtime.db.write() as s:
        for i in range(600):  # old: more than one pruning pass of them
            s.add(sample("inline", t - 3 * DAY + i, preemptions=i % 2))  # 300 preemptions
            s.add(sample("process", t - 3 * DAY + i, preemptions=None))
        s.add(sample("inline", t - 30, preemptions=4))
        s.add(sample("process", t - 30, preemptions=None))
        s.add(sample("fresh", t - 30, preemptions=0))  # counted: none happened
    client = metrics_app(runtime).test_client()
    expected = {
        frozenset({"worker": "inline", "model": "demo"}.items()): 304,
        frozenset({"worker": "fresh", "model": "demo"}.items()): 0,
    }
    assert named(scrape(client), "freight_engine_preemptions_total") == expected
    assert cleanup.run(runtime, t).samples_pruned == 1200
    with runtime.db.read() as s:
        totals = {r.worker: r.preemptions for r in s.scalars(select(EngineSampleTotal))}
    assert totals == {"inline": 300, "process": None}
    assert named(scrape(client), "freight_engine_preemptions_total") == expected
