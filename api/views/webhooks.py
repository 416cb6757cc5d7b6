"""Freight's own /v1 routes for a tenant's webhooks (OpenAI configures webhooks in its dashboard
and has no API for them): endpoints and their delivery logs. Views parse and serialize; every
decision is ``api.services.webhooks``'s."""

from __future__ import annotations

import time

from flask import Blueprint, Response, current_app, g, jsonify

from api.auth import require_tenant
from api.serializers import webhook_delivery_object, webhook_endpoint_object, webhook_list
from api.services import webhooks
from api.views.v1 import json_body
from storage.errors import ServiceError
from storage.runtime import Runtime

bp = Blueprint("webhooks", __name__, url_prefix="/v1")
FIELDS = frozenset({"url", "events"})


def rt() -> Runtime:
    return current_app.extensions["freight"]


@bp.post("/webhooks")
@require_tenant
def create_webhook() -> Response:
    body = json_body()
    if not isinstance(body, dict):
        raise ServiceError("invalid_request", "the request body must be a JSON object")
    unknown = sorted(str(k)[:40] for k in body if k not in FIELDS)
    if unknown:
        raise ServiceError("invalid_request", f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    events = body.get("events")
    if not isinstance(events, list):  # the CLI's comma-separated form is the CLI's alone
        raise ServiceError("invalid_request", "events must be a list of event types", param="events")
    endpoint = webhooks.add(rt(), g.tenant_id, body.get("url"), events, int(time.time()))
    return jsonify(webhook_endpoint_object(endpoint, show_secret=True))


@bp.get("/webhooks")
@require_tenant
def list_webhooks() -> Response:
    return jsonify(
        webhook_list([webhook_endpoint_object(e) for e in webhooks.list_endpoints(rt(), g.tenant_id)])
    )


@bp.get("/webhooks/<endpoint_id>")
@require_tenant
def get_webhook(endpoint_id: str) -> Response:
    return jsonify(webhook_endpoint_object(webhooks.get(rt(), g.tenant_id, endpoint_id)))


@bp.delete("/webhooks/<endpoint_id>")
@require_tenant
def delete_webhook(endpoint_id: str) -> Response:
    removed = webhooks.remove(rt(), g.tenant_id, endpoint_id, int(time.time()))
    return jsonify({"id": removed, "object": "webhook_endpoint", "deleted": True})


@bp.post("/webhooks/<endpoint_id>/disable")
@require_tenant
def disable_webhook(endpoint_id: str) -> Response:
    endpoint = webhooks.set_enabled(rt(), g.tenant_id, endpoint_id, False, int(time.time()))
    return jsonify(webhook_endpoint_object(endpoint))


@bp.post("/webhooks/<endpoint_id>/enable")
@require_tenant
def enable_webhook(endpoint_id: str) -> Response:
    endpoint = webhooks.set_enabled(rt(), g.tenant_id, endpoint_id, True, int(time.time()))
    return jsonify(webhook_endpoint_object(endpoint))


@bp.post("/webhooks/<endpoint_id>/rotate_secret")
@require_tenant
def rotate_webhook_secret(endpoint_id: str) -> Response:
    endpoint = webhooks.rotate_secret(rt(), g.tenant_id, endpoint_id, int(time.time()))
    return jsonify(webhook_endpoint_object(endpoint, show_secret=True))


@bp.get("/webhooks/<endpoint_id>/deliveries")
@require_tenant
def webhook_deliveries(endpoint_id: str) -> Response:
    log = webhooks.deliveries(rt(), g.tenant_id, endpoint_id=endpoint_id)
    return jsonify(webhook_list([webhook_delivery_object(d) for d in log]))


@bp.get("/batches/<batch_id>/webhook_deliveries")
@require_tenant
def batch_webhook_deliveries(batch_id: str) -> Response:
    log = webhooks.deliveries(rt(), g.tenant_id, batch_id=batch_id)
    return jsonify(webhook_list([webhook_delivery_object(d) for d in log]))
