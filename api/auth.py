"""Bearer-key authentication for /v1 (every view runs as exactly one tenant), and the guard of
``/metrics``.

A request's key is checked once: the rate limiter (which needs the tenant to pick its bucket)
and the view share the answer through ``g``.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable
from functools import wraps
from typing import Any

from flask import current_app, g, request

from api.services.tenants import authenticate
from storage.errors import ServiceError
from storage.settings import Settings

MAX_KEY_CHARS = 200


def _check_header() -> str | tuple[str, str, str]:
    """The tenant id of the request's key, or the (kind, message, code) of the 401 to answer."""
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if not header:
        return ("unauthorized", "Missing API key: send 'Authorization: Bearer <key>'.", "missing_api_key")
    key = key.strip()
    if scheme.lower() != "bearer" or not key or len(key) > MAX_KEY_CHARS or "\x00" in key:
        return ("unauthorized", "Malformed Authorization header: expected 'Bearer <key>'.", "invalid_api_key")
    tenant_id = authenticate(current_app.extensions["freight"].db, key)
    if tenant_id is None:
        return ("unauthorized", "Incorrect API key provided.", "invalid_api_key")
    return tenant_id


def _answer() -> str | tuple[str, str, str]:
    if "auth" not in g:
        g.auth = _check_header()
    return g.auth


def tenant_or_none() -> str | None:
    """The request's tenant, or None when its key is missing, malformed or wrong."""
    answer = _answer()
    return answer if isinstance(answer, str) else None


def require_tenant(view: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(view)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        answer = _answer()
        if not isinstance(answer, str):
            kind, message, code = answer
            raise ServiceError(kind, message, code=code)
        g.tenant_id = answer
        return view(*args, **kwargs)

    return wrapped


def check_metrics_access(settings: Settings) -> None:
    """``/metrics`` names tenants and their spend: with ``FREIGHT_METRICS_TOKEN`` set it wants that
    token as a bearer key; without one it answers loopback clients only (a scraper on the host)."""
    if settings.metrics_token:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        sent = token.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(sent, settings.metrics_token.encode()):
            raise ServiceError(
                "unauthorized",
                "GET /metrics needs 'Authorization: Bearer <metrics token>'.",
                code="invalid_api_key",
            )
        return
    try:
        loopback = ipaddress.ip_address(request.remote_addr or "").is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ServiceError(
            "forbidden",
            "GET /metrics answers loopback clients only; set FREIGHT_METRICS_TOKEN to scrape it from elsewhere.",
            code="metrics_forbidden",
        )
