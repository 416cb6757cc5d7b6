"""GET /metrics through Flask's test client over a database seeded through the ORM, on SQLite and
PostgreSQL, read back with prometheus_client's own parser."""

from __future__ import annotations

import re
import time
from dataclasses import replace
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from api.services.tenants import create_tenant
from storage.models import Batch, EngineSample, StoredFile, WorkUnit
from storage.runtime import Runtime

TOKEN = "scrape-token"
CHANGELOG = Path(__file__).resolve().parents[2] / "docs" / "changelog.md"


def add_batch(s, tenant_id: str, model: str | None, status: str, **columns):
    f = StoredFile(
        tenant_id=tenant_id, purpose="batch", filename="in.jsonl", bytes=1, object_key="k", created_at=0
    )
    s.add(f)
    s.flush()
    b = Batch(
        tenant_id=tenant_id, endpoint="/v1/chat/completions", model=model, input_file_id=f.id,
        completion_window="24h", status=status, created_at=0, expires_at=0, **columns,
    )  # fmt: skip
    s.add(b)
    s.flush()
    return b


def add_unit(s, batch: Batch, seq: int, status: str) -> None:
    s.add(
        WorkUnit(
            batch_id=batch.id,
            seq=seq,
            model=batch.model,
            shard_key="x",
            first_line=0,
            n_requests=1,
            status=status,
        )
    )


def sample(worker: str, started_at: float, **columns) -> EngineSample:
    values = dict(
        worker=worker, model="demo", started_at=started_at, seconds=5.0, steps=10, running_mean=8.0,
        waiting_mean=0.0, max_num_seqs=64, prompt_tokens=0, cached_tokens=0, output_tokens=0, requests=0,
    )  # fmt: skip
    return EngineSample(**{**values, **columns})


def seed(rt: Runtime, now: int) -> None:
    alpha, _ = create_tenant(rt.db, "alpha", now)
    beta, _ = create_tenant(rt.db, "beta", now)
    a, b = alpha.id, beta.id
    with rt.db.write() as s:
        running = add_batch(
            s,
            a,
            "demo",
            "in_progress",
            request_total=100,
            request_completed=30,
            request_failed=5,
            at_risk_since=now,
        )
        add_batch(
            s, b, "demo", "in_progress", request_total=50, cost_micros=9_000_000
        )  # not final: no charge
        # finished while at risk: the flag stays, but it no longer counts
        done = add_batch(
            s, a, "demo", "completed", request_total=10, request_completed=9, at_risk_since=now - 500,
            completed_at=now - 100, sla_met=True, cost_micros=3001, price_multiplier=1.5,
        )  # fmt: skip
        add_batch(
            s, a, "demo", "expired", request_total=10, expired_at=now - 200, sla_met=False,
            cost_micros=1003, price_multiplier=1.5,
        )  # fmt: skip
        add_batch(s, a, "demo", "completed", completed_at=now - 90_000, sla_met=True)  # over a day ago
        add_batch(s, b, "other", "completed", completed_at=now - 10, sla_met=True, cost_micros=2_000_000)
        add_batch(s, b, None, "failed", failed_at=now - 5)  # failed validation: no model, no verdict
        add_batch(s, b, "demo", "validating")
        for seq, status in enumerate(["running", "queued", "queued", "pending"]):
            add_unit(s, running, seq, status)
        add_unit(s, done, 0, "done")
        s.add_all(
            [
                # w1: an older sample, then the latest one, which the gauges show
                sample(
                    "w1",
                    now - 60,
                    running_mean=64.0,
                    prompt_tokens=10,
                    output_tokens=10,
                    cost_micros=1500,
                    mfu=0.9,
                    preemptions=2,  # an inline engine core counts vLLM's preemptions
                ),
                sample(
                    "w1",
                    now - 10,
                    running_mean=24.0,
                    prompt_tokens=1000,
                    cached_tokens=250,
                    output_tokens=500,
                    cost_micros=2500,
                    mfu=0.3,
                    preemptions=1,
                ),
                # w2: its latest sample ended over 5 minutes ago
                sample(
                    "w2",
                    now - 400,
                    prompt_tokens=7,
                    cached_tokens=7,
                    output_tokens=3,
                    cost_micros=1,
                    mfu=0.5,
                    mbu=0.6,
                ),
                sample(
                    "w3", now - 30, model="other", seconds=2.0, prompt_tokens=0, output_tokens=40, mbu=0.7
                ),
            ]
        )


def scrape(client) -> dict[tuple[str, frozenset], float]:
    response = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.get_data(as_text=True))
        for s in family.samples
    }


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def named(samples, name: str) -> dict[frozenset, float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def metrics_app(runtime):
    """The app as a scraper meets it: /metrics wants the metrics token (tests/api/test_metrics_access.py)."""
    return create_app(replace(runtime.settings, metrics_token=TOKEN), runtime)


@pytest.fixture
def client(runtime):
    return metrics_app(runtime).test_client()


def test_metrics(runtime, client):
    now = int(time.time())
    seed(runtime, now)
    m = scrape(client)

    assert value(m, "freight_batches", status="in_progress", model="demo") == 2
    assert value(m, "freight_batches", status="completed", model="demo") == 2
    assert value(m, "freight_batches", status="expired", model="demo") == 1
    assert value(m, "freight_batches", status="cancelled", model="demo") == 0  # listed, at 0
    assert value(m, "freight_batches", status="failed", model="-") == 1
    assert value(m, "freight_batches", status="completed", model="other") == 1
    assert sum(named(m, "freight_batches").values()) == 8

    assert value(m, "freight_queue_requests", model="demo") == (100 - 30 - 5) + 50
    assert value(m, "freight_queue_requests", model="other") == 0
    assert value(m, "freight_batches_at_risk", model="demo") == 1  # the completed one is not
    assert value(m, "freight_work_units", model="demo", status="queued") == 2
    assert value(m, "freight_work_units", model="demo", status="running") == 1
    assert value(m, "freight_work_units", model="demo", status="done") == 1
    assert value(m, "freight_work_units", model="demo", status="failed") == 0

    # worker gauges (0-1, so _ratio): w1's latest sample only; w2's is stale; NULL mfu/mbu are left out
    assert value(m, "freight_worker_batch_fill_ratio", worker="w1", model="demo") == 24 / 64
    assert value(m, "freight_worker_cache_hit_ratio", worker="w1", model="demo") == 0.25
    assert value(m, "freight_worker_mfu_ratio", worker="w1", model="demo") == 0.3
    assert value(m, "freight_worker_mbu_ratio", worker="w3", model="other") == 0.7
    workers = {
        dict(labels)["worker"]
        for (name, labels) in m
        if name.startswith("freight_worker_")
    }  # fmt: skip
    assert workers == {"w1", "w3"}
    assert set(named(m, "freight_worker_mfu_ratio")) == {frozenset({"worker": "w1", "model": "demo"}.items())}
    assert set(named(m, "freight_worker_mbu_ratio")) == {
        frozenset({"worker": "w3", "model": "other"}.items())
    }
    assert set(named(m, "freight_worker_cache_hit_ratio")) == {
        frozenset({"worker": "w1", "model": "demo"}.items())
    }

    # counters over every sample, the stale one included
    assert value(m, "freight_engine_busy_seconds_total", worker="w1", model="demo") == 10.0
    assert value(m, "freight_engine_busy_seconds_total", worker="w2", model="demo") == 5.0
    assert value(m, "freight_engine_cost_dollars_total", worker="w1", model="demo") == 4000 / 1e6
    assert value(m, "freight_engine_cost_dollars_total", worker="w2", model="demo") == 1 / 1e6
    assert value(m, "freight_tokens_total", worker="w1", model="demo", kind="prompt") == 1010
    assert value(m, "freight_tokens_total", worker="w2", model="demo", kind="prompt") == 7
    assert value(m, "freight_tokens_total", worker="w1", model="demo", kind="output") == 510
    assert value(m, "freight_tokens_total", worker="w3", model="other", kind="output") == 40
    assert value(m, "freight_cached_prompt_tokens_total", worker="w1", model="demo") == 250
    assert value(m, "freight_cached_prompt_tokens_total", worker="w2", model="demo") == 7
    # counted by w1's engine only: w2's and w3's samples did not count them (a core of its own)
    assert named(m, "freight_engine_preemptions_total") == {
        frozenset({"worker": "w1", "model": "demo"}.items()): 3
    }
    # cached tokens are part of the prompt ones: they have a counter of their own, and a sum over
    # kind is every token once (1017 prompt + 513 output of demo, not + 257 cached again)
    assert {dict(labels)["kind"] for labels in named(m, "freight_tokens_total")} == {"prompt", "output"}
    demo = [v for labels, v in named(m, "freight_tokens_total").items() if dict(labels)["model"] == "demo"]
    assert sum(demo) == 1017 + 513

    # charged per final batch: 3001 x 1.5 -> 4502, 1003 x 1.5 -> 1505; running batches are not charged
    assert value(m, "freight_batch_cost_dollars_total", tenant="alpha", model="demo") == 6007 / 1e6
    assert value(m, "freight_batch_cost_dollars_total", tenant="beta", model="other") == 2.0
    assert len(named(m, "freight_batch_cost_dollars_total")) == 2

    assert value(m, "freight_sla_batches_total", tenant="alpha", model="demo", met="true") == 2
    assert value(m, "freight_sla_batches_total", tenant="alpha", model="demo", met="false") == 1
    assert value(m, "freight_sla_batches_total", tenant="beta", model="other", met="true") == 1
    assert len(named(m, "freight_sla_batches_total")) == 3
    # the last 24 h: one met, one missed (the met one a day ago is out)
    assert value(m, "freight_sla_attainment_ratio", tenant="alpha", model="demo") == 0.5
    assert value(m, "freight_sla_attainment_ratio", tenant="beta", model="other") == 1.0
    assert len(named(m, "freight_sla_attainment_ratio")) == 2


def test_metrics_of_an_empty_database_and_per_app_registries(runtime, client):
    m = scrape(client)
    # the configured model is listed at 0 before any batch arrives; nothing else has series yet
    assert value(m, "freight_queue_requests", model="demo") == 0
    assert value(m, "freight_batches", status="in_progress", model="demo") == 0
    assert named(m, "freight_worker_batch_fill_ratio") == {} and named(m, "freight_tokens_total") == {}
    # a second app registers its own collector; the process-wide default registry has none
    other = metrics_app(runtime).test_client()
    assert scrape(other) == m
    assert prometheus_client.REGISTRY.get_sample_value("freight_queue_requests", {"model": "demo"}) is None


def test_metric_names_follow_prometheus_conventions_and_the_old_ones_are_gone(runtime, client):
    """Every family has series (the seed covers them all); the changelog's table of old -> new
    names is what operators go by, so it is read here: no old name (or old label value) is served,
    every new one is."""
    seed(runtime, int(time.time()))
    response = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    families = list(text_string_to_metric_families(response.get_data(as_text=True)))
    served = {s.name for f in families for s in f.samples}
    for f in families:
        names = {s.name for s in f.samples}
        assert "per_second" not in f.name and "_rate" not in f.name, f.name
        if f.type == "counter":
            assert names == {f"{f.name}_total"}, names
        if f.name.endswith("_ratio"):
            assert f.type == "gauge" and all(0 <= s.value <= 1 for s in f.samples), f.name

    rows = re.findall(
        r"^\| `(freight_\w+)(\{[^`]*\})?` \| (?:`(freight_\w+)`|\(removed\)) \|", CHANGELOG.read_text(), re.M
    )
    assert len(rows) == 7, rows
    for old, selector, new in rows:
        if selector:  # a label value that became its own metric
            label, _, wanted = selector.strip("{}").partition("=")
            assert not [
                s
                for f in families
                for s in f.samples
                if s.name == old and s.labels.get(label) == wanted.strip('"')
            ]
        else:
            assert old not in served
        assert not new or new in served, new
