"""A tenant's webhook endpoints and their delivery log: the one set of use cases the /v1/webhooks
routes, the console's page and ``freight webhooks`` call.

Everything is scoped to the calling tenant: another tenant's endpoint or batch is "not found",
exactly as one that does not exist. The URL and the event list are the tenant's input: checked
here (``scheduler.webhooks``), each refusal a 400 naming the field; where the URL's host points is
checked again at every delivery (``workers.webhooks``).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from scheduler.webhooks import WebhookConfigError, address_allowed, check_url, parse_events
from storage.errors import ServiceError
from storage.leases import WEBHOOK_ENDPOINT_LEASE
from storage.models import Batch, Tenant, WebhookDelivery, WebhookEndpoint
from storage.runtime import Runtime
from storage.status import DeliveryStatus, EndpointStatus
from storage.webhooks import move_delivery, move_endpoint, new_secret

DISABLED_BY_TENANT = "disabled by its tenant"
MAX_LISTED_DELIVERIES = 100


def tenant_id_of(rt: Runtime, name: str) -> str:
    """A tenant's id by its name (the operator's CLI names tenants)."""
    with rt.db.read() as s:
        tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == name))
    if tenant_id is None:
        raise ServiceError("not_found", f"no tenant named {name!r}", param="tenant")
    return tenant_id


def add(rt: Runtime, tenant_id: str, url: object, events: object, now: int) -> WebhookEndpoint:
    """A new active endpoint; its ``secret`` is in the returned row, to be shown this once (the
    table holds it sealed when a secrets key is configured)."""
    try:
        checked = check_url(url)
        wanted = parse_events(events)
    except WebhookConfigError as exc:
        raise ServiceError("invalid_request", str(exc), param=exc.param) from None
    host = urlsplit(checked).hostname or ""
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None and not address_allowed(str(literal), rt.settings.webhook_allow_private_targets):
        raise ServiceError(
            "invalid_request",
            "url must point at a public address (private, loopback and link-local ones are refused)",
            param="url",
        )
    with rt.db.write() as s:
        count = s.scalar(
            select(func.count())
            .select_from(WebhookEndpoint)
            .where(WebhookEndpoint.tenant_id == tenant_id, WebhookEndpoint.removed_at.is_(None))
        )
        if (count or 0) >= rt.settings.webhook_max_endpoints:
            raise ServiceError(
                "invalid_request",
                f"a tenant may have at most {rt.settings.webhook_max_endpoints} webhook endpoints;"
                " remove one first",
                code="too_many_webhooks",
            )
        secret = new_secret()
        endpoint = WebhookEndpoint(
            tenant_id=tenant_id,
            url=checked,
            events=list(wanted),
            secret=rt.secrets.seal(secret),
            status=EndpointStatus.ACTIVE,
            status_at=now,
            created_at=now,
        )
        s.add(endpoint)
    endpoint.secret = secret  # the detached row: the caller shows the secret, the table keeps it sealed
    return endpoint


def list_endpoints(rt: Runtime, tenant_id: str) -> list[WebhookEndpoint]:
    with rt.db.read() as s:
        return list(
            s.scalars(
                select(WebhookEndpoint)
                .where(WebhookEndpoint.tenant_id == tenant_id, WebhookEndpoint.removed_at.is_(None))
                .order_by(WebhookEndpoint.created_at.desc(), WebhookEndpoint.id.desc())
            )
        )


def get(rt: Runtime, tenant_id: str, endpoint_id: str) -> WebhookEndpoint:
    with rt.db.read() as s:
        return _own(s, tenant_id, endpoint_id)


def set_enabled(rt: Runtime, tenant_id: str, endpoint_id: str, enabled: bool, now: int) -> WebhookEndpoint:
    """Disable an endpoint (its pending deliveries wait), or enable it (they resume, the ones
    whose retry time has passed at the next tick)."""
    with rt.db.write() as s:
        _own(s, tenant_id, endpoint_id)
        if enabled:
            move_endpoint(s, endpoint_id, EndpointStatus.ACTIVE, now)
        else:
            move_endpoint(s, endpoint_id, EndpointStatus.DISABLED, now, DISABLED_BY_TENANT)
        return _own(s, tenant_id, endpoint_id)


def rotate_secret(rt: Runtime, tenant_id: str, endpoint_id: str, now: int) -> WebhookEndpoint:
    """A new signing secret, returned this once. For FREIGHT_WEBHOOK_SECRET_GRACE_SECONDS the
    deliveries carry a signature under the replaced secret too, so the receiver can switch at its
    own pace; a second rotation within the grace drops the first secret at once (two at most)."""
    grace = rt.settings.webhook_secret_grace_seconds
    with rt.db.write() as s:
        endpoint = _own(s, tenant_id, endpoint_id)
        s.refresh(endpoint, with_for_update=True)  # two rotations at once: one after the other
        endpoint.previous_secret = endpoint.secret if grace > 0 else None
        endpoint.previous_secret_until = now + grace if grace > 0 else None
        secret = new_secret()
        endpoint.secret = rt.secrets.seal(secret)  # type: ignore[assignment]
    endpoint.secret = secret  # the detached row: the caller shows the secret, the table keeps it sealed
    return endpoint


def remove(rt: Runtime, tenant_id: str, endpoint_id: str, now: int) -> str:
    """Stop sending to an endpoint for good; its pending deliveries end ``failed``. Its log stays."""
    with rt.db.write() as s:
        endpoint = _own(s, tenant_id, endpoint_id)
        endpoint.removed_at = now
        pending = s.scalars(
            select(WebhookDelivery.id).where(
                WebhookDelivery.endpoint_id == endpoint_id, WebhookDelivery.status == DeliveryStatus.PENDING
            )
        ).all()
        for delivery_id in pending:
            move_delivery(s, delivery_id, DeliveryStatus.FAILED, now, last_error="endpoint removed")
        WEBHOOK_ENDPOINT_LEASE.revoke(s, [endpoint_id])  # an attempt in flight to it holds it no more
    return endpoint_id


def deliveries(
    rt: Runtime, tenant_id: str, *, batch_id: str | None = None, endpoint_id: str | None = None
) -> list[WebhookDelivery]:
    """The delivery log of one batch or one endpoint, newest first (at most 100)."""
    with rt.db.read() as s:
        query = select(WebhookDelivery).where(WebhookDelivery.tenant_id == tenant_id)
        if batch_id is not None:
            if s.scalar(select(Batch.id).where(Batch.id == batch_id, Batch.tenant_id == tenant_id)) is None:
                raise ServiceError("not_found", f"No such Batch object: {batch_id}", param="batch_id")
            query = query.where(WebhookDelivery.batch_id == batch_id)
        if endpoint_id is not None:
            _own(s, tenant_id, endpoint_id)
            query = query.where(WebhookDelivery.endpoint_id == endpoint_id)
        return list(s.scalars(query.order_by(WebhookDelivery.id.desc()).limit(MAX_LISTED_DELIVERIES)))


def recent_deliveries(rt: Runtime, tenant_id: str) -> list[WebhookDelivery]:
    """The tenant's latest deliveries, all endpoints (the console's page)."""
    return deliveries(rt, tenant_id)


def _own(s: Session, tenant_id: str, endpoint_id: str) -> WebhookEndpoint:
    endpoint = s.get(WebhookEndpoint, endpoint_id)
    if endpoint is None or endpoint.tenant_id != tenant_id or endpoint.removed_at is not None:
        raise ServiceError(
            "not_found", f"No such Webhook endpoint object: {endpoint_id}", param="endpoint_id"
        )
    return endpoint
