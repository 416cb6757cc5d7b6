"""Webhook state in the database: the deliveries a batch's final transition records, and the one
compare-and-set move of a delivery's or an endpoint's status.

``record_events`` runs inside the transaction that makes a batch final
(``storage.lifecycle.finish_batch``), so the event is committed with the state or not at all: a
process that dies after the commit leaves pending deliveries the tick sends.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from scheduler.webhooks import SECRET_PREFIX, event_type
from storage.db import changed_rows
from storage.models import Batch, WebhookDelivery, WebhookEndpoint, new_id
from storage.status import (
    DELIVERY_TRANSITIONS,
    ENDPOINT_TRANSITIONS,
    DeliveryStatus,
    EndpointStatus,
    webhook_source,
)


def new_secret() -> str:
    """A signing secret: ``whsec_`` and 32 random bytes in base64 (Standard Webhooks' form)."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def record_events(s: Session, batch: Batch, now: int) -> int:
    """A pending delivery of the batch's final event to each active endpoint of its tenant that
    subscribes to it; returns how many."""
    kind = event_type(batch.status)
    if kind is None:
        return 0
    return record_event(s, batch.tenant_id, batch.id, kind, now)


def record_event(
    s: Session, tenant_id: str, subject_id: str, kind: str, now: int, data: dict[str, Any] | None = None
) -> int:
    """A pending delivery of one event of ``kind`` about ``subject_id`` (a batch's id; the tenant's
    own for a tenant's event, with its fields in ``data``) to each active endpoint of the tenant
    that subscribes to it; returns how many. One event id for all of them (the event is one)."""
    endpoints = s.scalars(
        select(WebhookEndpoint).where(
            WebhookEndpoint.tenant_id == tenant_id,
            WebhookEndpoint.status == EndpointStatus.ACTIVE,
            WebhookEndpoint.removed_at.is_(None),
        )
    ).all()
    wanted = [e for e in endpoints if kind in (e.events or ())]
    event_id = new_id("evt_")
    for endpoint in wanted:
        s.add(
            WebhookDelivery(
                endpoint_id=endpoint.id,
                tenant_id=tenant_id,
                batch_id=subject_id,  # the event's subject: data.id
                event_id=event_id,
                event_type=kind,
                created_at=now,
                status=DeliveryStatus.PENDING,
                status_at=now,
                attempts=0,
                next_attempt_at=float(now),
                data=data,
            )
        )
    return len(wanted)


def move_delivery(s: Session, delivery_id: int, to: str, now: int, **values: Any) -> bool:
    """Move a delivery to ``to`` from a state ``DELIVERY_TRANSITIONS`` allows, as one
    compare-and-set UPDATE; False if it was not in such a state."""
    sources = webhook_source(DELIVERY_TRANSITIONS, to)
    statement = (
        update(WebhookDelivery)
        .where(WebhookDelivery.id == delivery_id, WebhookDelivery.status.in_(sources))
        .values(status=to, status_at=now, **values)
    )
    return bool(changed_rows(s, statement))


def move_endpoint(s: Session, endpoint_id: str, to: str, now: int, reason: str | None = None) -> bool:
    """Enable or disable an endpoint (compare-and-set), recording when and, for a disabling, why;
    False if it already was in ``to``."""
    sources = webhook_source(ENDPOINT_TRANSITIONS, to)
    statement = (
        update(WebhookEndpoint)
        .where(WebhookEndpoint.id == endpoint_id, WebhookEndpoint.status.in_(sources))
        .values(status=to, status_at=now, disabled_reason=reason)
    )
    return bool(changed_rows(s, statement))
