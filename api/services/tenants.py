"""Tenants and API keys. Keys are shown once, at creation, and stored only as SHA-256 digests.
Operators revoke keys and disable tenants here (``freight tenant revoke-key`` / ``disable``); both
take effect at the next request, console sessions included."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from sqlalchemy import delete, select

from scheduler.budgets import BudgetState, dollars_to_micros
from storage import budgets
from storage.db import Database
from storage.errors import ServiceError
from storage.models import ApiKey, ConsoleSession, Tenant

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


def _tenant(s, name: str) -> Tenant:
    tenant = s.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise ServiceError("not_found", f"no tenant named {name!r}", param="name")
    return tenant


def create_key(db: Database, tenant_name: str, now: int) -> str:
    with db.write() as s:
        tenant = _tenant(s, tenant_name)
        if tenant.disabled_at is not None:
            raise ServiceError("conflict", f"tenant {tenant_name!r} is disabled", param="name")
        return _add_key(s, tenant.id, now)


@dataclass(frozen=True)
class KeyView:
    """A key as operators list it: never the key, only its first characters."""

    id: int
    prefix: str
    created_at: int
    revoked_at: int | None


def list_keys(db: Database, tenant_name: str) -> list[KeyView]:
    with db.read() as s:
        tenant = _tenant(s, tenant_name)
        rows = s.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant.id).order_by(ApiKey.id))
        return [KeyView(k.id, k.prefix, k.created_at, k.revoked_at) for k in rows]


def revoke_key(db: Database, key_id: int, now: int) -> tuple[str, KeyView]:
    """Revoke a key (the tenant's name and the key as it now is). Its console sessions are
    deleted with it; requests already past the key check finish."""
    with db.write() as s:
        key = s.get(ApiKey, key_id)
        if key is None:
            raise ServiceError("not_found", f"no API key with id {key_id}", param="key_id")
        if key.revoked_at is None:
            key.revoked_at = now
        s.execute(delete(ConsoleSession).where(ConsoleSession.key_id == key.id))
        name = s.scalar(select(Tenant.name).where(Tenant.id == key.tenant_id)) or ""
        return name, KeyView(key.id, key.prefix, key.created_at, key.revoked_at)


def disable_tenant(db: Database, name: str, now: int) -> Tenant:
    """From now on every key of the tenant is refused and its console sessions are gone; its drop
    folders are not scanned (``workers.dropfolders``) and its webhook deliveries end unsent
    (``workers.webhooks``). Its files and batches are kept (batches already running run on)."""
    with db.write() as s:
        tenant = _tenant(s, name)
        if tenant.disabled_at is None:
            tenant.disabled_at = now
        s.execute(delete(ConsoleSession).where(ConsoleSession.tenant_id == tenant.id))
        return tenant


def enable_tenant(db: Database, name: str) -> Tenant:
    """Undo ``disable_tenant``: the tenant's keys not revoked work again (its console users sign
    in again), its drop folders are scanned again and its endpoints hear of the batches that end
    from now on; deliveries ended while it was disabled stay ended."""
    with db.write() as s:
        tenant = _tenant(s, name)
        tenant.disabled_at = None
        return tenant


QUOTA_COLUMNS = ("quota_stored_bytes", "quota_open_batches", "quota_queued_requests")


def set_quota(db: Database, tenant_name: str, values: dict[str, str]) -> Tenant:
    """Set a tenant's own quotas: ``{column: "N" | "default"}``; N >= 0, 0 is unlimited,
    ``default`` follows FREIGHT_QUOTA_* again."""
    with db.write() as s:
        tenant = s.scalar(select(Tenant).where(Tenant.name == tenant_name))
        if tenant is None:
            raise ServiceError("not_found", f"no tenant named {tenant_name!r}", param="name")
        for column, text in values.items():
            if column not in QUOTA_COLUMNS:
                raise ValueError(column)
            if text.strip().lower() == "default":
                setattr(tenant, column, None)
            elif text.strip().isdigit():
                setattr(tenant, column, int(text))
            else:
                raise ServiceError(
                    "invalid_request",
                    f"{column} must be a whole number (0: unlimited) or 'default'",
                    param=column,
                )
    return tenant


def set_budget(
    db: Database, tenant_name: str, monthly: str | None, soft: bool | None, now: float
) -> tuple[Tenant, BudgetState | None]:
    """Set a tenant's monthly spend budget (``monthly``: dollars, or "none" to remove it; None
    keeps it) and whether it is soft (None keeps it); returns the tenant and this month's state."""
    with db.write() as s:
        tenant = _tenant(s, tenant_name)
        micros = tenant.budget_monthly_micros
        if monthly is not None:
            try:
                micros = None if monthly.strip().lower() == "none" else dollars_to_micros(monthly)
            except ValueError as exc:
                raise ServiceError("invalid_request", str(exc), param="monthly") from None
        if monthly is not None or soft is not None:
            budgets.set_budget(s, tenant, micros, bool(tenant.budget_soft) if soft is None else soft)
        state = budgets.budget_state(s, tenant, now)
    return tenant, state


def _add_key(s, tenant_id: str, now: int) -> str:
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    s.add(ApiKey(tenant_id=tenant_id, key_hash=hash_key(key), prefix=key[:10], created_at=now))
    return key


def authenticate(db: Database, key: str) -> str | None:
    """The tenant id a key belongs to, or None."""
    found = authenticate_key(db, key)
    return found[0] if found else None


def authenticate_key(db: Database, key: str) -> tuple[str, int] | None:
    """(tenant id, key id) of a key neither revoked nor of a disabled tenant, or None. The digest
    lookup is followed by a constant-time comparison, so response time does not depend on how
    much of a guessed key was right."""
    digest = hash_key(key)
    with db.read() as s:
        row = s.execute(
            select(ApiKey.key_hash, ApiKey.tenant_id, ApiKey.id)
            .join(Tenant, Tenant.id == ApiKey.tenant_id)
            .where(ApiKey.key_hash == digest, ApiKey.revoked_at.is_(None), Tenant.disabled_at.is_(None))
        ).first()
    if row is None or not hmac.compare_digest(row.key_hash, digest):
        return None
    return row.tenant_id, row.id
