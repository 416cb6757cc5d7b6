"""Spend budgets per tenant (issue #52 part 3), on SQLite and PostgreSQL with a real Redis: set with
``freight tenant budget``, the warning at 80% (a ``tenant.budget_warning`` webhook event recorded
by the dispatcher's tick, delivered signed to a real HTTP receiver, once a month, and the /metrics
gauges), the 403 ``budget_exceeded`` at 100% while the batches already accepted keep running, a
soft budget that only warns, and the dry run's verdict on whether a batch fits what is left.

Spend is put on batches as the engine workers' metering leaves it (``cost_micros`` and the tier's
multiplier on the batch row), since no engine runs here."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from api.app import create_app
from api.services import webhooks as hooks
from api.services.tenants import create_tenant
from scheduler.budgets import month_of
from scheduler.cost import charged_micros
from storage.budgets import spent_micros
from storage.models import Batch, Tenant, WebhookDelivery
from storage.runtime import Runtime
from tests import webhook_receiver
from tests.api.test_estimates import add_history, document_lines, estimated
from tests.factories import cli_on, http_create, http_upload, upload_and_create
from tests.webhook_receiver import Receiver, verify
from workers.dispatcher import tick
from workers.webhooks import deliver

TOKEN = "scrape-token"


@pytest.fixture
def settings(settings):
    """A priced deployment ($3.60 an engine hour), webhooks to the test's receiver on 127.0.0.1."""
    return dataclasses.replace(
        settings, instance_price_per_hour=3.6, webhook_allow_private_targets=True, metrics_token=TOKEN
    )


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = webhook_receiver.start()
    yield r
    r.server.shutdown()
    r.server.server_close()


@pytest.fixture
def alpha(runtime) -> tuple[str, dict]:
    tenant, key = create_tenant(runtime.db, "alpha", int(time.time()))
    return tenant.id, {"Authorization": f"Bearer {key}"}


def spend(
    runtime: Runtime, tenant_id: str, dollars: float, *, multiplier: float = 1.0, at: int | None = None
) -> str:
    """A batch of the tenant (created ``at``, default now) charged ``dollars`` so far: engine cost
    x the tier's multiplier, as metering leaves it on a batch whose units ran."""
    batch_id = upload_and_create(runtime, tenant_id, [{"custom_id": "x", "method": "POST",
                                 "url": "/v1/chat/completions", "body": {"model": "demo", "messages": []}}]).id  # fmt: skip
    with runtime.db.write() as s:
        b = s.get(Batch, batch_id)
        b.status = "in_progress"
        b.cost_micros, b.price_multiplier = round(dollars * 1e6 / multiplier), multiplier
        if at is not None:
            b.created_at = at
    return batch_id


def budget(runtime: Runtime, *args: str) -> str:
    result = cli_on(runtime, "tenant", "budget", "alpha", *args)
    assert result.exit_code == 0, result.output
    return result.output


def scrape(client) -> dict[str, float]:
    response = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200
    return {
        s.name: s.value
        for family in text_string_to_metric_families(response.get_data(as_text=True))
        for s in family.samples
        if s.name.startswith("freight_tenant_budget") and s.labels == {"tenant": "alpha"}
    }


def test_a_hard_budget_refuses_new_batches_once_spent_and_running_ones_go_on(runtime, alpha):
    tenant_id, headers = alpha
    client = create_app(runtime=runtime).test_client()
    assert "no budget" in budget(runtime)
    shown = budget(runtime, "--monthly", "10")
    assert "$10.00 a month, hard" in shown and f"{month_of(time.time()).key}: $0.00 spent" in shown
    # last month's spend counts for last month only
    spend(runtime, tenant_id, 50.0, at=month_of(time.time()).start - 3600)
    running = spend(runtime, tenant_id, 9.99, multiplier=2.0)  # $4.995 engine cost at a x2 tier
    file_id = http_upload(client, headers).get_json()["id"]
    assert http_create(client, headers, file_id).status_code == 200  # $9.99 of $10: still under
    with runtime.db.write() as s:
        s.get(Batch, running).cost_micros += 5_000  # its next unit's cost, x2: $10.00 spent
    refused = http_create(client, headers, file_id)
    assert refused.status_code == 403
    error = refused.get_json()["error"]
    assert error["code"] == "budget_exceeded" and error["type"] == "invalid_request_error"
    assert (
        "monthly budget of tenant alpha is $10.00" in error["message"]
        and "$10.00 is spent" in error["message"]
    )
    # the running batch is untouched: it finishes and is charged in full, past the budget
    with runtime.db.read() as s:
        assert s.get(Batch, running).status == "in_progress"
        assert len(s.scalars(select(Batch).where(Batch.tenant_id == tenant_id)).all()) == 3
    # soft: the operator lets it run over; new batches are made again
    assert "soft (warns only)" in budget(runtime, "--soft")
    assert http_create(client, headers, file_id).status_code == 200
    # hard again and raised: room again
    budget(runtime, "--hard", "--monthly", "20")
    assert http_create(client, headers, file_id).status_code == 200
    # removed: no limit
    assert "no budget" in budget(runtime, "--monthly", "none")
    for bad in ("-5", "0", "lots", "1e13"):
        result = cli_on(runtime, "tenant", "budget", "alpha", "--monthly", bad)
        assert result.exit_code != 0 and "budget" in result.output, bad


def test_the_warning_at_80_percent_is_one_signed_event_a_month_and_a_metric(runtime, alpha, receiver):
    tenant_id, _ = alpha
    hook = hooks.add(
        runtime, tenant_id, receiver.url("/budget"), "tenant.budget_warning,batch.completed", int(time.time())
    )
    budget(runtime, "--monthly", "100")
    client = create_app(runtime=runtime).test_client()
    spend(runtime, tenant_id, 79.99)
    assert tick(runtime, time.time()).budget_warnings == []
    figures = scrape(client)
    assert figures["freight_tenant_budget_dollars"] == 100.0
    assert figures["freight_tenant_budget_spent_dollars"] == pytest.approx(79.99)
    assert figures["freight_tenant_budget_used_ratio"] == pytest.approx(0.7999)

    spend(runtime, tenant_id, 0.01)  # $80.00: 80%
    assert tick(runtime, time.time()).budget_warnings == [tenant_id]
    assert tick(runtime, time.time()).budget_warnings == []  # once a month
    assert scrape(client)["freight_tenant_budget_used_ratio"] == pytest.approx(0.8)
    with runtime.db.read() as s:
        [delivery] = s.scalars(select(WebhookDelivery).where(WebhookDelivery.tenant_id == tenant_id)).all()
        assert s.get(Tenant, tenant_id).budget_warned_period == month_of(time.time()).key
    assert deliver(runtime, delivery.id, time.time()) == "delivered"
    [got] = receiver.at("/budget")
    assert verify(hook.secret, got.headers, got.body)
    event = json.loads(got.body)
    assert event["type"] == "tenant.budget_warning" and event["object"] == "event"
    assert event["data"] == {
        "id": tenant_id,
        "object": "tenant.budget",
        "tenant": "alpha",
        "period": month_of(time.time()).key,
        "monthly_usd": 100.0,
        "spent_usd": 80.0,
        "used_ratio": 0.8,
        "soft": False,
    }
    # a raised budget warns again when spend reaches 80% of it
    budget(runtime, "--monthly", "110")
    assert tick(runtime, time.time()).budget_warnings == []
    spend(runtime, tenant_id, 8.0)
    assert tick(runtime, time.time()).budget_warnings == [tenant_id]
    # an endpoint that did not subscribe to the budget event gets none
    with runtime.db.read() as s:
        assert {d.endpoint_id for d in s.scalars(select(WebhookDelivery))} == {hook.id}


def test_the_dry_run_says_whether_the_batch_fits_what_is_left(runtime, alpha):
    tenant_id, headers = alpha
    client = create_app(runtime=runtime).test_client()
    file_id = http_upload(client, headers, document_lines(max_tokens=50)).get_json()["id"]
    add_history(runtime, tenant_id, file_id)
    e = estimated(client, runtime, headers, file_id)["estimate"]
    assert "budget" not in e  # no budget, no block
    low, high = e["cost"]["total"]["low"], e["cost"]["total"]["high"]
    assert 0 < low < high

    def verdict(monthly: float, spent: float) -> dict:
        budget(runtime, "--monthly", str(monthly))
        with runtime.db.write() as s:
            for b in s.scalars(
                select(Batch).where(Batch.tenant_id == tenant_id, Batch.id != "batch_history")
            ):
                s.delete(b)
        if spent:
            spend(runtime, tenant_id, spent)
        return estimated(client, runtime, headers, file_id)["estimate"]["budget"]

    roomy = verdict(10.0, 1.0)
    assert roomy == {"period": month_of(time.time()).key, "monthly_usd": 10.0, "spent_usd": 1.0,
                     "remaining_usd": 9.0, "soft": False, "fits": True}  # fmt: skip
    # less left than even the typical output costs
    assert verdict(10.0, 10.0 - low / 2)["fits"] is False
    # between the two ends: it depends on how much the requests write
    between = verdict(10.0, 10.0 - (low + high) / 2)
    assert between["fits"] is None and low < between["remaining_usd"] < high


def test_the_databases_sum_is_each_batchs_charge_summed(runtime, alpha):
    """spent_micros sums in SQL what charged_micros rounds per batch (half up), ties included."""
    tenant_id, _ = alpha
    costs = [(1, 0.5), (3, 0.5), (5, 1.5), (999_999, 0.75), (7, 2.0), (12_345, 1.1), (10, 0.9), (333, 1.0)]
    ids = [spend(runtime, tenant_id, 0.0) for _ in costs]
    with runtime.db.write() as s:
        for batch_id, (cost, multiplier) in zip(ids, costs, strict=True):
            b = s.get(Batch, batch_id)
            b.cost_micros, b.price_multiplier = cost, multiplier
    with runtime.db.read() as s:
        assert spent_micros(s, tenant_id, month_of(time.time())) == sum(
            charged_micros(c, m) for c, m in costs
        )
