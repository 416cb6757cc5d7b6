"""Tenants and API keys. Keys are shown once, at creation, and stored only as SHA-256 digests."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

from sqlalchemy import select

from storage.db import Database
from storage.errors import ServiceError
from storage.models import ApiKey, Tenant

KEY_PREFIX = "fk-"
# a tenant's name reaches reports (CSV, spreadsheets), metric labels, logs, the console and shell
# arguments: letters, digits, "." "_" "-", starting with a letter or digit (never "-" or "=")
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def create_tenant(db: Database, name: str, now: int) -> tuple[Tenant, str]:
    name = name.strip()
    if not TENANT_NAME.fullmatch(name):
        raise ServiceError(
            "invalid_request",
            "tenant name must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit",
            param="name",
        )
    with db.write() as s:
        if s.scalar(select(Tenant).where(Tenant.name == name)) is not None:
            raise ServiceError("conflict", f"tenant {name!r} already exists", param="name")
        tenant = Tenant(name=name, created_at=now)
        s.add(tenant)
        s.flush()
        key = _add_key(s, tenant.id, now)
    return tenant, key


def create_key(db: Database, tenant_name: str, now: int) -> str:
    with db.write() as s:
        tenant = s.scalar(select(Tenant).where(Tenant.name == tenant_name))
        if tenant is None:
            raise ServiceError("not_found", f"no tenant named {tenant_name!r}", param="name")
        return _add_key(s, tenant.id, now)


def _add_key(s, tenant_id: str, now: int) -> str:
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    s.add(ApiKey(tenant_id=tenant_id, key_hash=hash_key(key), prefix=key[:10], created_at=now))
    return key


def authenticate(db: Database, key: str) -> str | None:
    """The tenant id a key belongs to, or None. The digest lookup is followed by a constant-time
    comparison, so response time does not depend on how much of a guessed key was right."""
    digest = hash_key(key)
    with db.read() as s:
        row = s.execute(
            select(ApiKey.key_hash, ApiKey.tenant_id).where(
                ApiKey.key_hash == digest, ApiKey.revoked_at.is_(None)
            )
        ).first()
    if row is None or not hmac.compare_digest(row.key_hash, digest):
        return None
    return row.tenant_id
