"""The console's webhooks page: the signed-in tenant's endpoints (add, disable, enable, remove)
and their latest deliveries, through the service /v1/webhooks calls (``api.services.webhooks``).

Its routes are on the console's blueprint, so its session check, CSRF check and error pages apply.
A new endpoint's secret is shown on the page that answers the form, once: never in a flash
message (Flask keeps those in the cookie) nor on any later page.
"""

from __future__ import annotations

import time

from flask import flash, g, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue

from api.errors import status_of
from api.services import webhooks
from api.views.console import bp, rt
from scheduler.webhooks import EVENT_TYPES
from storage.errors import ServiceError


def _page(created: object = None, error: str | None = None, status: int = 200) -> tuple[str, int]:
    chosen = request.form.getlist("events") if request.method == "POST" else list(EVENT_TYPES)
    page = render_template(
        "console/webhooks.html",
        endpoints=webhooks.list_endpoints(rt(), g.tenant_id),
        deliveries=webhooks.recent_deliveries(rt(), g.tenant_id)[:50],
        event_types=EVENT_TYPES,
        chosen={"url": request.form.get("url", "") if error else "", "events": chosen},
        created=created,
        error=error,
    )
    return page, status


@bp.get("/webhooks")
def webhooks_page() -> tuple[str, int]:
    return _page()


@bp.post("/webhooks")
def webhooks_add() -> tuple[str, int]:
    try:
        created = webhooks.add(
            rt(), g.tenant_id, request.form.get("url", ""), request.form.getlist("events"), int(time.time())
        )
    except ServiceError as exc:
        return _page(error=exc.message, status=status_of(exc))
    return _page(created=created)


@bp.post("/webhooks/<endpoint_id>/<action>")
def webhooks_change(endpoint_id: str, action: str) -> ResponseReturnValue:
    now = int(time.time())
    if action == "remove":
        webhooks.remove(rt(), g.tenant_id, endpoint_id, now)
        flash(f"Removed webhook endpoint {endpoint_id}.")
    elif action in ("disable", "enable"):
        endpoint = webhooks.set_enabled(rt(), g.tenant_id, endpoint_id, action == "enable", now)
        flash(f"Webhook endpoint {endpoint.id} is {endpoint.status}.")
    else:
        raise ServiceError("not_found", "There is no such page.")
    return redirect(url_for(".webhooks_page"))
