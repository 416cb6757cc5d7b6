"""Webhooks, the decisions: which events a batch's end makes, what a delivery's body and
signature are (Standard Webhooks), when a failed attempt is tried again, and which addresses a
delivery may connect to.

Pure functions; ``storage/webhooks.py`` records deliveries with the batch's final transition and
``workers/webhooks.py`` sends them.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from scheduler.special_addresses import is_public

# OpenAI's batch event types, by the batch state that makes them
EVENT_OF_STATUS = {
    "completed": "batch.completed",
    "failed": "batch.failed",
    "cancelled": "batch.cancelled",
    "expired": "batch.expired",
}
# a tenant's spend reached FREIGHT_BUDGET_WARNING_RATIO of its monthly budget (scheduler/budgets.py):
# its data's id is the tenant's, with the budget's figures when it was recorded
BUDGET_WARNING = "tenant.budget_warning"
EVENT_TYPES = (*EVENT_OF_STATUS.values(), BUDGET_WARNING)
SECRET_PREFIX = "whsec_"
MAX_URL_LENGTH = 2048
# seconds after the previous attempt (the first is at once): Standard Webhooks' schedule, about
# 27 hours from the first attempt to the last; a delivery whose attempts are all spent has failed
RETRY_SCHEDULE = (5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0)
ATTEMPTS = 1 + len(RETRY_SCHEDULE)


class WebhookConfigError(ValueError):
    """A URL or event list an endpoint cannot have; the message says why (a 400 to the tenant)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def event_type(status: str) -> str | None:
    """The event a batch's final state makes (None for any other state)."""
    return EVENT_OF_STATUS.get(status)


def parse_events(events: object) -> tuple[str, ...]:
    """The event types an endpoint subscribes to: a non-empty list (or comma-separated string) of
    OpenAI's batch event types, each once, in the canonical order."""
    if isinstance(events, str):
        events = [part.strip() for part in events.split(",") if part.strip()]
    if not isinstance(events, list | tuple) or not events:
        raise WebhookConfigError(
            f"events must be a non-empty list of event types: {', '.join(EVENT_TYPES)}", "events"
        )
    unknown = [e for e in events if not isinstance(e, str) or e not in EVENT_TYPES]
    if unknown:
        shown = ", ".join(repr(e)[:60] for e in unknown[:3])
        raise WebhookConfigError(f"unknown event type(s) {shown}; known: {', '.join(EVENT_TYPES)}", "events")
    return tuple(e for e in EVENT_TYPES if e in events)


def check_url(url: object) -> str:
    """An endpoint's URL: http or https, a host, no credentials or fragment, at most 2,048
    characters. Where the host points is checked at each delivery (``address_allowed``), since
    DNS can change between now and then."""
    if not isinstance(url, str) or not url:
        raise WebhookConfigError("url must be a non-empty string", "url")
    if len(url) > MAX_URL_LENGTH or not url.isascii() or any(ord(c) < 33 or ord(c) == 127 for c in url):
        raise WebhookConfigError(
            f"url must be at most {MAX_URL_LENGTH} ASCII characters (punycode host names, %-escaped paths),"
            " without spaces or control characters",
            "url",
        )
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise WebhookConfigError(f"url is not a valid URL: {exc}", "url") from None
    if parts.scheme not in ("http", "https"):
        raise WebhookConfigError("url must start with https:// or http://", "url")
    if not parts.hostname:
        raise WebhookConfigError("url must name a host", "url")
    if parts.username is not None or parts.password is not None:
        raise WebhookConfigError("url must not hold credentials (user:password@)", "url")
    if parts.fragment:
        raise WebhookConfigError("url must not have a #fragment", "url")
    if port == 0:
        raise WebhookConfigError("url's port must be from 1 to 65535", "url")
    return url


def address_allowed(address: str, allow_private: bool) -> bool:
    """May a delivery connect to this IP address? Only globally routable ones
    (``scheduler.special_addresses``: none of the IANA special-purpose blocks, loopback, private,
    link-local such as cloud metadata at 169.254.169.254, shared, documentation, NAT64 local use,
    site-local, multicast among them; an IPv4 address carried in IPv6, IPv4-mapped, NAT64, 6to4
    or Teredo, judged as that IPv4 address), unless the operator allows private targets
    (FREIGHT_WEBHOOK_ALLOW_PRIVATE_TARGETS): then all but multicast and unspecified ones."""
    if not allow_private:
        return is_public(address)
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    return not ip.is_multicast and not ip.is_unspecified


def retry_delay(attempts: int) -> float | None:
    """Seconds from an attempt that failed to the next, after ``attempts`` attempts (1 or more);
    None when they are spent."""
    if attempts < 1 or attempts > len(RETRY_SCHEDULE):
        return None
    return RETRY_SCHEDULE[attempts - 1]


def event_body(
    event_id: str, type_: str, created_at: int, batch_id: str, data: Mapping[str, Any] | None = None
) -> bytes:
    """OpenAI's event shape, as the exact bytes that are signed and sent; ``data`` adds fields
    after the subject's id (a budget event's figures; a batch event has none)."""
    event = {
        "id": event_id,
        "object": "event",
        "type": type_,
        "created_at": created_at,
        "data": {"id": batch_id, **(data or {})},
    }
    return json.dumps(event, separators=(",", ":")).encode()


def secret_key(secret: str) -> bytes:
    """The HMAC key of a ``whsec_<base64>`` secret."""
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX))


def signature(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """Standard Webhooks' ``webhook-signature``: ``v1,`` and the base64 HMAC-SHA256, under the
    secret's key, of ``id.timestamp.body``."""
    signed = f"{message_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret_key(secret), signed, hashlib.sha256).digest()).decode()


def signing_secrets(
    secret: str, previous: str | None, previous_until: int | None, now: float
) -> tuple[str, ...]:
    """The secrets a delivery is signed with: the endpoint's, and the one a rotation replaced
    while its grace lasts (until ``previous_until``, epoch seconds), so a receiver still checking
    the old secret keeps verifying until it switches."""
    if previous and previous_until is not None and now < previous_until:
        return (secret, previous)
    return (secret,)


def headers(secrets: str | Sequence[str], message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The delivery's headers; ``webhook-signature`` holds one ``v1,`` signature per secret,
    space-separated (Standard Webhooks: a receiver accepts the message if any one verifies)."""
    keys = (secrets,) if isinstance(secrets, str) else tuple(secrets)
    return {
        "content-type": "application/json",
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(signature(k, message_id, timestamp, body) for k in keys),
    }
