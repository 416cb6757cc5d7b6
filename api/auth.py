"""Bearer-key authentication for /v1 (every view runs as exactly one tenant), the console's
server-side session check, and the guard of ``/metrics``.

A request's key is checked once: the rate limiter (which needs the tenant to pick its bucket)
and the view share the answer through ``g``.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from functools import wraps
from typing import Any

from flask import current_app, g, request, session

from api.services import sessions
from api.services.sessions import SignedIn
from api.services.tenants import authenticate
from storage.errors import ServiceError
from storage.settings import Settings, metrics_port

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


def console_session() -> SignedIn | None:
    """The console session the request's cookie names, checked on the server once per request
    (the rate limiter and the console's guard share the answer through ``g``)."""
    if "console_session" not in g:
        token = session.get("sid")
        g.console_session = sessions.resume(current_app.extensions["freight"].db, token, int(time.time()))
    return g.console_session


def on_metrics_listener(settings: Settings) -> bool:
    """Whether the request came in on FREIGHT_METRICS_BIND's listener. ``SERVER_PORT`` is the
    port of the socket the server accepted it on (gunicorn and werkzeug take it from the listener,
    not from the Host header), so a client cannot claim it."""
    port = metrics_port(settings.metrics_bind) if settings.metrics_bind else None
    return port is not None and request.environ.get("SERVER_PORT") == str(port)


def check_metrics_access(settings: Settings) -> None:
    """``/metrics`` names tenants and their spend. On the main listener it wants
    ``FREIGHT_METRICS_TOKEN`` as a bearer key, whoever asks: behind a reverse proxy on the same
    host every client looks like loopback, so the address proves nothing. On the separate
    listener of ``FREIGHT_METRICS_BIND`` (a private interface) the token is wanted if one is set."""
    if not settings.metrics_token:
        if on_metrics_listener(settings):
            return
        raise ServiceError(
            "forbidden",
            "GET /metrics needs FREIGHT_METRICS_TOKEN to be set (then 'Authorization: Bearer <token>'), "
            "or is served on the listener of FREIGHT_METRICS_BIND.",
            code="metrics_forbidden",
        )
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    sent = token.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() != "bearer" or not hmac.compare_digest(sent, settings.metrics_token.encode()):
        raise ServiceError(
            "unauthorized",
            "GET /metrics needs 'Authorization: Bearer <metrics token>'.",
            code="invalid_api_key",
        )
