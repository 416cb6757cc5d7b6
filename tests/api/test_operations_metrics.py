"""The /metrics gauges the shipped alert rules read (api/services/operations_metrics.py and
freight_dependency_up), over a database seeded through the ORM, on SQLite and PostgreSQL."""

from __future__ import annotations

import time

from api.services.tenants import create_tenant
from api.services.webhooks import DISABLED_BY_TENANT
from storage import tick_clock
from storage.models import Tenant, WebhookEndpoint, WorkUnit
from tests.api.test_metrics import add_batch, metrics_app, named, sample, scrape, value


def add_endpoint(s, tenant_id: str, status: str, reason: str | None = None) -> None:
    s.add(
        WebhookEndpoint(
            tenant_id=tenant_id, url="https://example.com/hook", events=["batch.completed"],
            secret="whsec_x", status=status, status_at=0, disabled_reason=reason, created_at=0,
        )
    )  # fmt: skip


def add_unit(s, batch, seq: int, status: str, **columns) -> None:
    s.add(
        WorkUnit(
            batch_id=batch.id, seq=seq, model=batch.model, shard_key="x", first_line=0, n_requests=4,
            status=status, **columns,
        )
    )  # fmt: skip


def test_operations_gauges(runtime) -> None:
    now = int(time.time())
    lease = runtime.settings.lease_seconds
    alpha, _ = create_tenant(runtime.db, "alpha", now)
    beta, _ = create_tenant(runtime.db, "beta", now)
    with runtime.db.write() as s:
        s.get(Tenant, beta.id).quota_queued_requests = 10
        s.get(Tenant, beta.id).quota_open_batches = 0  # unlimited: no limit series
        running = add_batch(s, beta.id, "demo", "in_progress", request_total=12)
        # w1 runs a unit (fresh heartbeat, claim token "<worker>:<incarnation>:<nonce>"); one
        # unit was claimed three times; one's worker went silent four leases ago
        add_unit(s, running, 0, "running", worker="w1:123-ab:cd", heartbeat_at=now, attempts=3)
        add_unit(s, running, 1, "running", worker="w9:1-x:y", heartbeat_at=now - 4 * lease, attempts=1)
        add_unit(s, running, 2, "queued", attempts=0)
        # a worker of "other" seen only through its recent engine sample
        s.add(sample("w3", now - 10, model="other"))
        add_batch(s, alpha.id, "demo", "validating").created_at = now - 120
        add_batch(s, alpha.id, "demo", "finalizing", finalizing_at=now - 60).created_at = now - 900
        # the last hour's final lines of demo: 30 completed, 10 failed; an older batch is out
        add_batch(
            s, alpha.id, "demo", "completed", request_completed=30, request_failed=5, completed_at=now - 60
        )
        add_batch(s, alpha.id, "demo", "failed", request_completed=0, request_failed=5, failed_at=now - 30)
        add_batch(s, alpha.id, "demo", "completed", request_failed=100, completed_at=now - 7200)
        add_endpoint(s, alpha.id, "active")
        add_endpoint(s, alpha.id, "disabled", "5 attempts failed: HTTP 500")
        add_endpoint(s, beta.id, "disabled", DISABLED_BY_TENANT)
        tick_clock.record_tick(s, now - 7.5)
    m = scrape(metrics_app(runtime).test_client())

    assert value(m, "freight_engine_workers", model="demo") == 1  # w1; w9 is silent
    assert value(m, "freight_engine_workers", model="other") == 1
    assert value(m, "freight_unit_redeliveries", model="demo") == 2
    assert value(m, "freight_unreclaimed_units", model="demo") == 1
    assert value(m, "freight_dispatcher_last_tick_timestamp_seconds") == now - 7.5
    assert value(m, "freight_request_error_ratio", model="demo") == 10 / 40
    assert value(m, "freight_waiting_since_timestamp_seconds", status="validating") == now - 120
    assert value(m, "freight_waiting_since_timestamp_seconds", status="finalizing") == now - 60
    assert value(m, "freight_webhook_endpoints", tenant="alpha", state="active") == 1
    assert value(m, "freight_webhook_endpoints", tenant="alpha", state="disabled_failing") == 1
    assert value(m, "freight_webhook_endpoints", tenant="alpha", state="disabled_by_tenant") == 0
    assert value(m, "freight_webhook_endpoints", tenant="beta", state="disabled_by_tenant") == 1
    assert value(m, "freight_webhook_endpoints", tenant="beta", state="disabled_failing") == 0
    # beta's unfinished units ask for 12 requests (4 each) against its own limit of 10
    assert value(m, "freight_tenant_quota_used", tenant="beta", quota="queued_requests") == 12
    assert value(m, "freight_tenant_quota_limit", tenant="beta", quota="queued_requests") == 10
    assert value(m, "freight_tenant_quota_used", tenant="beta", quota="open_batches") == 1
    assert (
        "freight_tenant_quota_limit",
        frozenset({"tenant": "beta", "quota": "open_batches"}.items()),
    ) not in m
    assert value(m, "freight_tenant_quota_limit", tenant="alpha", quota="open_batches") == (
        runtime.settings.quota_open_batches
    )
    assert value(m, "freight_tenant_quota_used", tenant="alpha", quota="open_batches") == 2
    # the readiness probe's checks: the test database and store answer
    assert value(m, "freight_dependency_up", dependency="database") == 1
    assert value(m, "freight_dependency_up", dependency="object_store") == 1
    assert set(named(m, "freight_dependency_up")) == {
        frozenset({"dependency": d}.items()) for d in ("database", "broker", "object_store")
    }


def test_operations_gauges_of_an_empty_database(runtime) -> None:
    m = scrape(metrics_app(runtime).test_client())
    # the configured model reads 0 workers (so "queued and no worker" can compare), nothing waits
    assert value(m, "freight_engine_workers", model="demo") == 0
    assert value(m, "freight_unit_redeliveries", model="demo") == 0
    assert named(m, "freight_waiting_since_timestamp_seconds") == {}
    assert named(m, "freight_dispatcher_last_tick_timestamp_seconds") == {}  # no tick yet
    assert named(m, "freight_request_error_ratio") == {} and named(m, "freight_webhook_endpoints") == {}
