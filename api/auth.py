"""Bearer-key authentication for /v1: every view runs as exactly one tenant."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from flask import current_app, g, request

from api.errors import ServiceError
from api.services.tenants import authenticate


def require_tenant(view: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(view)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if not header:
            raise ServiceError(
                "unauthorized", "Missing API key: send 'Authorization: Bearer <key>'.", code="missing_api_key"
            )
        key = key.strip()
        if scheme.lower() != "bearer" or not key or len(key) > 200:
            raise ServiceError(
                "unauthorized",
                "Malformed Authorization header: expected 'Bearer <key>'.",
                code="invalid_api_key",
            )
        tenant_id = authenticate(current_app.extensions["freight"].db, key)
        if tenant_id is None:
            raise ServiceError("unauthorized", "Incorrect API key provided.", code="invalid_api_key")
        g.tenant_id = tenant_id
        return view(*args, **kwargs)

    return wrapped
