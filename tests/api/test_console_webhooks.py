"""The console's webhooks page: add an endpoint (its secret shown on that page only), refuse a bad
one with the reason, disable, enable and remove it, list the latest deliveries; beta sees nothing of
alpha's and cannot change it; a hostile URL is escaped."""

from __future__ import annotations

import pytest

from api.services import webhooks
from api.services.tenants import create_tenant
from tests.api.test_console import CSRF, EVIL, sign_in
from tests.conftest import now
from tests.factories import chat_line, upload_and_create
from workers.task_policy import fail_validation


@pytest.fixture
def keys(runtime):
    return {
        "a": create_tenant(runtime.db, "alpha", now())[1],
        "b": create_tenant(runtime.db, "beta", now())[1],
    }


def token(client) -> str:
    return CSRF.search(client.get("/console/webhooks").get_data(as_text=True)).group(1)  # type: ignore[union-attr]


def test_the_webhooks_page_adds_disables_and_lists_deliveries(app, keys, runtime):
    alpha = app.test_client()
    sign_in(alpha, keys["a"])
    page = alpha.get("/console/webhooks").get_data(as_text=True)
    assert "No webhook endpoints yet." in page and 'href="/console/webhooks"' in page
    added = alpha.post(
        "/console/webhooks",
        data={"csrf_token": token(alpha), "url": "https://hooks.example.com/x", "events": ["batch.failed"]},
    )
    body = added.get_data(as_text=True)
    assert added.status_code == 200 and 'id="secret">whsec_' in body
    [endpoint] = webhooks.list_endpoints(runtime, webhooks.tenant_id_of(runtime, "alpha"))
    assert endpoint.secret in body and endpoint.events == ["batch.failed"]
    assert endpoint.secret not in alpha.get("/console/webhooks").get_data(as_text=True)  # once

    refused = alpha.post(
        "/console/webhooks", data={"csrf_token": token(alpha), "url": f"https://h.example.com/{EVIL}", "events": ["batch.nope"]}
    )  # fmt: skip
    text = refused.get_data(as_text=True)
    assert refused.status_code == 400 and "must be at most" in text and EVIL not in text
    no_csrf = alpha.post(
        "/console/webhooks", data={"url": "https://h.example.com/", "events": ["batch.failed"]}
    )
    assert (
        no_csrf.status_code in (400, 403) and len(webhooks.list_endpoints(runtime, endpoint.tenant_id)) == 1
    )

    # a delivery shows in the log
    batch_id = upload_and_create(runtime, endpoint.tenant_id, [chat_line("r0", "hi")]).id
    assert fail_validation(runtime, "boom", batch_id)
    page = alpha.get("/console/webhooks").get_data(as_text=True)
    assert batch_id in page and "batch.failed" in page and "pending" in page
    job = alpha.get(f"/console/jobs/{batch_id}").get_data(as_text=True)  # and on the job's page
    assert 'id="webhook-deliveries"' in job and endpoint.id in job

    # beta: sees none of it, cannot disable it (not found, as a made-up id)
    beta = app.test_client()
    sign_in(beta, keys["b"])
    assert endpoint.id not in beta.get("/console/webhooks").get_data(as_text=True)
    stranger = beta.post(f"/console/webhooks/{endpoint.id}/disable", data={"csrf_token": token(beta)})
    assert stranger.status_code == 404
    assert webhooks.get(runtime, endpoint.tenant_id, endpoint.id).status == "active"

    disabled = alpha.post(f"/console/webhooks/{endpoint.id}/disable", data={"csrf_token": token(alpha)})
    assert disabled.status_code == 302
    page = alpha.get("/console/webhooks").get_data(as_text=True)
    assert "disabled by its tenant" in page and f'id="enable-{endpoint.id}"' in page
    alpha.post(f"/console/webhooks/{endpoint.id}/enable", data={"csrf_token": token(alpha)})
    assert webhooks.get(runtime, endpoint.tenant_id, endpoint.id).status == "active"
    assert (
        alpha.post(f"/console/webhooks/{endpoint.id}/explode", data={"csrf_token": token(alpha)}).status_code
        == 404
    )
    alpha.post(f"/console/webhooks/{endpoint.id}/remove", data={"csrf_token": token(alpha)})
    assert webhooks.list_endpoints(runtime, endpoint.tenant_id) == []
