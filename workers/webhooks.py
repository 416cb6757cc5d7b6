"""Webhook deliveries: attempt one (task ``freight.deliver_webhook``), and send the due ones.

A delivery is recorded pending with its batch's final transition (``storage.webhooks``); the task
that made the batch final sends it after the commit (``send_due``), and the dispatcher's tick sends
whatever is due and not in flight (a first attempt whose message was lost, a retry whose time has
come), so a lost message or a dead process only delays it: at least once.

An attempt holds two time leases (their keepers in ``storage.leases``, the claim's time their
token): the delivery's (one attempt of it at a time) and its endpoint's (one attempt per endpoint
at a time, and FREIGHT_WEBHOOK_TENANT_CONCURRENCY per tenant, so a tenant's slow or failing
receivers hold that many threads of the webhook role, never the pool: the other tenants'
deliveries go on). One tenant's claims are serialized on its row, so two workers cannot
both take its last place. When an attempt ends it sends the next due ones.

The receiver is a tenant's input: the host is resolved, every address checked and the connection
made to the checked address (``workers.outbound_http``, shared with image URLs). Lookups are counted
per tenant too (FREIGHT_WEBHOOK_TENANT_CONCURRENCY of one tenant's at once in a process, those that
outlived their attempt included), so a tenant whose DNS hangs waits for its own; redirects are not
followed, the whole attempt is cut off at FREIGHT_WEBHOOK_TIMEOUT_SECONDS, and at most 64 KiB of
the response is read.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from scheduler.webhooks import event_body, headers, retry_delay, signing_secrets
from storage.leases import WEBHOOK_DELIVERY_LEASE, WEBHOOK_ENDPOINT_LEASE
from storage.models import Tenant, WebhookDelivery, WebhookEndpoint
from storage.runtime import Runtime
from storage.status import DeliveryStatus, EndpointStatus
from storage.webhooks import move_delivery, move_endpoint
from workers.outbound_http import Call, send

log = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 64 * 1024  # of a receiver's answer, read and dropped
USER_AGENT = "Freight-Webhooks/1"
TENANT_DISABLED = "not sent: its tenant is disabled"
PRIVATE_SETTING = "FREIGHT_WEBHOOK_ALLOW_PRIVATE_TARGETS"


def lease_seconds(rt: Runtime) -> float:
    """How long an attempt may hold its leases: its time limit twice, and a margin (seconds)."""
    return rt.settings.webhook_timeout_seconds * 2 + 5


# -- sending ----------------------------------------------------------------------------------


def send_due(rt: Runtime, now: float, batch_id: str | None = None) -> list[int]:
    """Send a task for each endpoint's earliest due delivery (of ``batch_id`` only, if given) that
    no attempt holds and no task was sent for within a lease; returns their ids."""
    first = (
        select(func.min(WebhookDelivery.id))
        .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
        .where(
            WebhookDelivery.status == DeliveryStatus.PENDING,
            WebhookDelivery.next_attempt_at <= now,
            WebhookEndpoint.status == EndpointStatus.ACTIVE,
            WebhookEndpoint.removed_at.is_(None),
            WEBHOOK_ENDPOINT_LEASE.free(now, lease_seconds(rt)),
        )
        .group_by(WebhookDelivery.endpoint_id)
    )
    if batch_id is not None:
        first = first.where(WebhookDelivery.batch_id == batch_id)
    with rt.db.read() as s:  # every tick asks: a write transaction only when there is something
        candidates = [i for i in s.scalars(first.limit(1000)) if i is not None]
    sent = mark_sent(rt, candidates, now) if candidates else []
    for delivery_id in sent:
        rt.queue.deliver_webhook(delivery_id, expires=now + lease_seconds(rt))
    return sent


def mark_sent(rt: Runtime, candidates: list[int], now: float) -> list[int]:
    """Record a task as sent for each candidate still due and not sent within a lease; returns
    those. A compare-and-set, so of two senders one sends; and it asks again what the read asked
    (pending, due), because an attempt may have ended between the read and this write: a sender
    that read the delivery before an attempt delivered it (or put off its retry) would otherwise
    send a task for nothing, or mark a retry as sent and hold it back a lease past its time."""
    free = now - lease_seconds(rt)
    sent = []
    with rt.db.write() as s:
        for delivery_id in candidates:
            changed = s.execute(
                update(WebhookDelivery)
                .where(
                    WebhookDelivery.id == delivery_id,
                    WebhookDelivery.status == DeliveryStatus.PENDING,
                    WebhookDelivery.next_attempt_at <= now,
                    or_(WebhookDelivery.sent_at.is_(None), WebhookDelivery.sent_at < free),
                    WEBHOOK_DELIVERY_LEASE.free(now, lease_seconds(rt)),
                )
                .values(sent_at=now)
            ).rowcount  # type: ignore[attr-defined]
            if changed:
                sent.append(delivery_id)
    return sent


def send_due_quietly(rt: Runtime, batch_id: str | None = None) -> None:
    """``send_due`` after a commit that may have made deliveries: a failure is only logged, the
    tick sends them instead."""
    try:
        send_due(rt, time.time(), batch_id)
    except Exception:
        log.warning("sending webhook deliveries failed; the next tick does it", exc_info=True)


# -- one attempt ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Attempt:
    endpoint_id: str
    url: str
    secrets: tuple[str, ...]  # the endpoint's, and during a rotation's grace the replaced one
    event_id: str
    body: bytes
    attempts: int  # before this one
    first_at: int  # the event's time: the retry schedule runs from it
    batch_id: str  # whose event: the attempt's log line carries it (storage/logs.py)
    tenant_id: str  # whose endpoint: its host lookups are counted against it


def deliver(rt: Runtime, delivery_id: int, now: float) -> str | None:
    """One attempt of a due delivery; returns its outcome (``delivered``, ``retry``, ``failed``)
    or None when it was not attempted (not due, in flight, its endpoint busy or disabled, or its
    tenant disabled: then the delivery is failed without an attempt)."""
    attempt = _claim(rt, delivery_id, now)
    if attempt is None:
        return None
    status, error = post(
        attempt.url,
        headers(attempt.secrets, attempt.event_id, int(time.time()), attempt.body),
        attempt.body,
        rt.settings.webhook_timeout_seconds,
        rt.settings.webhook_allow_private_targets,
        tenant=attempt.tenant_id,
        tenant_lookups=rt.settings.webhook_tenant_concurrency,
    )
    outcome = _record(rt, delivery_id, attempt, now, status, error)
    log.info("webhook delivery %d (%s) to endpoint %s: %s%s", delivery_id, attempt.event_id,
             attempt.endpoint_id, outcome, f" ({error})" if error else "",
             extra={"batch_id": attempt.batch_id})  # fmt: skip
    send_due_quietly(rt)  # this endpoint's next one, now that it is free
    return outcome


def _claim(rt: Runtime, delivery_id: int, now: float) -> _Attempt | None:
    free = now - lease_seconds(rt)
    with rt.db.write() as s:
        tenant_id = s.scalar(select(WebhookDelivery.tenant_id).where(WebhookDelivery.id == delivery_id))
        if tenant_id is None:
            return None
        # the tenant's row first, FOR NO KEY UPDATE: one tenant's claims run one after another, so
        # each counts the attempts in flight after the previous claim committed and the cap is
        # exact on PostgreSQL too (SQLite's write transactions are serial already). NO KEY, so a
        # batch ending meanwhile still inserts deliveries that reference the tenant; first, so the
        # lock order is validation's (the tenant before any webhook row): no deadlock
        tenant = s.get(Tenant, tenant_id, with_for_update={"key_share": True})
        delivery = s.get(WebhookDelivery, delivery_id, with_for_update=True)
        if (
            delivery is None
            or delivery.status != DeliveryStatus.PENDING
            or delivery.next_attempt_at > now
            or (delivery.lease_at is not None and delivery.lease_at >= free)
        ):
            return None
        if tenant is None or tenant.disabled_at is not None:
            # a disabled tenant hears nothing from Freight while disabled: its deliveries end here,
            # with the reason in their log, rather than wait for an enabling that may never come
            # (`freight tenant enable`: the batches that end after it are delivered again)
            move_delivery(
                s, delivery_id, DeliveryStatus.FAILED, int(now), last_error=TENANT_DISABLED, sent_at=None
            )
            return None
        endpoint = s.get(WebhookEndpoint, delivery.endpoint_id, with_for_update=True)
        if (
            endpoint is None
            or endpoint.status != EndpointStatus.ACTIVE
            or endpoint.removed_at is not None
            or (endpoint.busy_at is not None and endpoint.busy_at >= free)
            or _tenant_in_flight(s, endpoint.tenant_id, free) >= rt.settings.webhook_tenant_concurrency
        ):
            # pending until the endpoint is enabled again, or an attempt in flight to it (or to
            # another of its tenant's) sends the next when it ends: this task's send no longer
            # counts, so that one sends it at once
            delivery.sent_at = None
            return None
        # both leases were seen free under the rows' locks: these compare-and-sets take them
        for keeper, row_id in ((WEBHOOK_DELIVERY_LEASE, delivery_id), (WEBHOOK_ENDPOINT_LEASE, endpoint.id)):
            if not keeper.take(s, row_id, now, now=now, lease_seconds=lease_seconds(rt)):
                raise RuntimeError(f"{keeper.column} of {row_id}: seen free under its lock, yet taken")
        return _Attempt(
            endpoint.id,
            endpoint.url,
            signing_secrets(
                rt.secrets.open(endpoint.secret) or "",
                rt.secrets.open(endpoint.previous_secret),
                endpoint.previous_secret_until,
                now,
            ),
            delivery.event_id,
            event_body(
                delivery.event_id, delivery.event_type, delivery.created_at, delivery.batch_id, delivery.data
            ),
            delivery.attempts,
            delivery.created_at,
            delivery.batch_id,
            endpoint.tenant_id,
        )


def _tenant_in_flight(s: Session, tenant_id: str, free: float) -> int:
    """Attempts in flight to the tenant's endpoints; exact when the caller holds the tenant's row
    lock (``_claim``), which a racing claim of the same tenant waits for."""
    return (
        s.scalar(
            select(func.count())
            .select_from(WebhookEndpoint)
            .where(WebhookEndpoint.tenant_id == tenant_id, WebhookEndpoint.busy_at >= free)
        )
        or 0
    )


def _record(
    rt: Runtime, delivery_id: int, attempt: _Attempt, now: float, status: int | None, error: str | None
) -> str:
    attempts = attempt.attempts + 1
    seen = {
        "attempts": attempts,
        "last_attempt_at": time.time(),
        "last_status_code": status,
        "last_error": error,
        "sent_at": None,
    }
    with rt.db.write() as s:
        # the claim's time is both leases' token: an attempt whose lease ran out and was taken over
        # gives back neither, and still records its outcome (the status moves are compare-and-set)
        WEBHOOK_ENDPOINT_LEASE.release(s, attempt.endpoint_id, now)
        WEBHOOK_DELIVERY_LEASE.release(s, delivery_id, now)
        if error is None:
            move_delivery(s, delivery_id, DeliveryStatus.DELIVERED, int(now), **seen)
            return DeliveryStatus.DELIVERED
        if status == 410:  # Gone: the receiver says it will never take one; retrying is abuse
            move_delivery(s, delivery_id, DeliveryStatus.FAILED, int(now), **seen)
            reason = (f"the receiver answered 410 Gone to event {attempt.event_id}: disabled at once, "
                      "its other deliveries wait until it is enabled again")  # fmt: skip
            if move_endpoint(s, attempt.endpoint_id, EndpointStatus.DISABLED, int(now), reason):
                log.warning("webhook endpoint %s disabled: %s", attempt.endpoint_id, reason)
            return DeliveryStatus.FAILED
        delay = retry_delay(attempts)
        if delay is not None:
            s.execute(
                update(WebhookDelivery)
                .where(WebhookDelivery.id == delivery_id, WebhookDelivery.status == DeliveryStatus.PENDING)
                .values(next_attempt_at=now + delay, **seen)
            )
            return "retry"
        move_delivery(s, delivery_id, DeliveryStatus.FAILED, int(now), **seen)
        hours = (now - attempt.first_at) / 3600
        reason = (f"event {attempt.event_id} could not be delivered: {attempts} attempts over {hours:.1f} h "
                  f"failed, the last with: {error}")  # fmt: skip
        if move_endpoint(s, attempt.endpoint_id, EndpointStatus.DISABLED, int(now), reason):
            log.warning("webhook endpoint %s disabled: %s", attempt.endpoint_id, reason)
        return DeliveryStatus.FAILED


# -- the HTTP call ----------------------------------------------------------------------------


def post(
    url: str,
    sent: dict[str, str],
    body: bytes,
    timeout: float,
    allow_private: bool,
    tenant: str = "",
    tenant_lookups: int = 2,
) -> tuple[int | None, str | None]:
    """POST ``body`` to ``url``: (HTTP status or None, None on a 2xx else why it failed). The whole
    call, resolving included, ends within ``timeout`` seconds (``workers.outbound_http``), and at
    most ``tenant_lookups`` of ``tenant``'s host lookups run at once in this process, so a tenant
    whose DNS hangs waits for its own lookups only."""
    call = Call(
        timeout,
        MAX_RESPONSE_BYTES,
        allow_private,
        PRIVATE_SETTING,
        USER_AGENT,
        refuse_larger=False,
        tenant=tenant,
        tenant_lookups=tenant_lookups,
    )
    try:
        answer = send("POST", url, call, sent, body)
    except TimeoutError:
        return None, f"no answer within {timeout:g} s (FREIGHT_WEBHOOK_TIMEOUT_SECONDS)"
    except OSError as exc:
        return None, str(exc)[:500]
    if 200 <= answer.status < 300:
        return answer.status, None
    return answer.status, f"HTTP {answer.status}"
