"""Console sessions kept on the server.

A signed cookie alone cannot be taken back: until it expires, a copy of it works, whatever the
user or the operator did. So the cookie carries only a random token, and the session is the row
that token names (``console_sessions``, keyed by the token's SHA-256). Sign-out deletes the row;
a revoked key or a disabled tenant fails the check at the next request; the row's ``expires_at``
bounds its life whatever the cookie says. A tenant has at most FREIGHT_MAX_SESSIONS_PER_TENANT
live sessions: a sign-in past that ends its oldest.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import delete, select

from storage.db import Database
from storage.models import ApiKey, ConsoleSession, Tenant

MAX_TOKEN_CHARS = 100


@dataclass(frozen=True)
class SignedIn:
    tenant_id: str
    tenant_name: str


def _row_id(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def start(
    db: Database, tenant_id: str, key_id: int, now: int, lifetime_seconds: int, max_sessions: int = 20
) -> str:
    """A new session of the tenant signed in with ``key_id``; returns the cookie's token. The
    tenant's expired rows are deleted on the way, and past ``max_sessions`` live ones
    (FREIGHT_MAX_SESSIONS_PER_TENANT) its oldest end, so a tenant's rows never outgrow that many
    however often it signs in (300 sign-ins in 1.8 s left 301 rows before). Sign-ins of one tenant
    take its row's lock first, so racing ones each count the others' rows."""
    token = secrets.token_urlsafe(32)
    row_id = _row_id(token)
    with db.write() as s:
        s.get(Tenant, tenant_id, with_for_update={"key_share": True})
        s.execute(
            delete(ConsoleSession).where(
                ConsoleSession.tenant_id == tenant_id, ConsoleSession.expires_at <= now
            )
        )
        s.add(
            ConsoleSession(
                id=row_id,
                tenant_id=tenant_id,
                key_id=key_id,
                created_at=now,
                expires_at=now + lifetime_seconds,
            )
        )
        s.flush()
        # at most max_sessions + 1 rows (the cap held before this one): the oldest go, never the
        # new one; sign-ins within one second are ordered by the database as it returns them
        older = s.scalars(
            select(ConsoleSession.id)
            .where(ConsoleSession.tenant_id == tenant_id, ConsoleSession.id != row_id)
            .order_by(ConsoleSession.created_at.desc())
        ).all()
        ended = older[max(max_sessions, 1) - 1 :]
        if ended:
            s.execute(delete(ConsoleSession).where(ConsoleSession.id.in_(ended)))
    return token


def resume(db: Database, token: object, now: int) -> SignedIn | None:
    """Who the session of ``token`` belongs to, while it has not expired, been signed out, lost
    its key or its tenant; else None."""
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_CHARS:
        return None
    with db.read() as s:
        row = s.execute(
            select(Tenant.id, Tenant.name)
            .join(ConsoleSession, ConsoleSession.tenant_id == Tenant.id)
            .join(ApiKey, ApiKey.id == ConsoleSession.key_id)
            .where(
                ConsoleSession.id == _row_id(token),
                ConsoleSession.expires_at > now,
                ApiKey.revoked_at.is_(None),
                Tenant.disabled_at.is_(None),
            )
        ).first()
    return SignedIn(row.id, row.name) if row else None


def end(db: Database, token: object) -> None:
    """Sign-out: the session's row goes, so a kept copy of the cookie is worth nothing."""
    if isinstance(token, str) and token and len(token) <= MAX_TOKEN_CHARS:
        with db.write() as s:
            s.execute(delete(ConsoleSession).where(ConsoleSession.id == _row_id(token)))
