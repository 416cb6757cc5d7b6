"""Idempotency keys: the rows behind ``Idempotency-Key`` on creates (the HTTP side is
``api/idempotency.py``; the periodic cleanup prunes them).

A key is claimed before its request runs (one row per tenant and key, inserted in its own
transaction, so of two requests racing with one key exactly one runs: the other finds the row
in flight), and completed with the request's digest and its answer once the request has made
what it makes. A key's life is ``KEY_SECONDS`` from its first use; after that it is as if never
sent. A request whose process died leaves its key in flight: after ``ABANDONED_SECONDS`` the key
is taken over and the request runs again. Completing or releasing a claim names its ``holder``
token, so a request that was taken over never overwrites its successor's row.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Final, Literal

from sqlalchemy import delete, select, tuple_, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from storage.db import Database, changed_rows
from storage.models import IdempotencyKey

KEY_SECONDS = 24 * 3600  # a key answers its first answer this long after its first use (Stripe's)
# an in-flight key older than this lost its process (a request runs minutes at most: the largest
# /v1/files upload at a slow client's pace); the next request with it runs
ABANDONED_SECONDS = 15 * 60
IN_FLIGHT: Final = "in_flight"  # a status, and what ``claim`` answers for a key in flight
DONE: Final = "done"


@dataclass(frozen=True)
class Answer:
    """What the key's first request answered, and the digest of that request."""

    request_digest: str
    status: int
    body: str


@dataclass(frozen=True)
class Claim:
    """The key is this request's to run; ``holder`` names the claim when it completes or releases."""

    holder: str


InFlight = Literal["in_flight"]


def claim(db: Database, tenant_id: str, key: str, now: float) -> Claim | Answer | InFlight:
    """Claim ``key`` for a request of the tenant's: a ``Claim`` (run it), the ``Answer`` of the
    key's first request (a retry: compare the digests), or ``"in_flight"`` (another request with
    the key is running). A key past ``KEY_SECONDS``, or in flight past ``ABANDONED_SECONDS``, is
    replaced by this claim."""
    for attempt in range(2):
        try:
            with db.write() as s:
                return _claim(s, tenant_id, key, now)
        except IntegrityError:  # PostgreSQL: a concurrent claim inserted the row first
            if attempt:
                raise
    raise AssertionError("unreachable")


def _claim(s: Session, tenant_id: str, key: str, now: float) -> Claim | Answer | InFlight:
    row = s.get(IdempotencyKey, (tenant_id, key), with_for_update=True)
    if row is not None and row.created_at > now - KEY_SECONDS:
        if row.status == DONE:
            assert row.request_digest is not None and row.response_status is not None
            return Answer(row.request_digest, row.response_status, row.response_body or "")
        if row.created_at > now - ABANDONED_SECONDS:
            return IN_FLIGHT
    if row is not None:
        s.delete(row)
        s.flush()
    holder = secrets.token_hex(16)
    s.add(IdempotencyKey(tenant_id=tenant_id, key=key, status=IN_FLIGHT, holder=holder, created_at=now))
    s.flush()
    return Claim(holder)


def complete(
    db: Database, tenant_id: str, key: str, claimed: Claim, digest: str, answer_status: int, body: str
) -> bool:
    """Record the answer of the claim's request; False if the claim was taken over meanwhile."""
    with db.write() as s:
        return (
            changed_rows(
                s,
                update(IdempotencyKey)
                .where(*_held(tenant_id, key, claimed))
                .values(
                    status=DONE, request_digest=digest, response_status=answer_status, response_body=body
                ),
            )
            == 1
        )


def release(db: Database, tenant_id: str, key: str, claimed: Claim) -> None:
    """Forget the claim: its request made nothing (it was refused or failed), so the key may run again."""
    with db.write() as s:
        s.execute(delete(IdempotencyKey).where(*_held(tenant_id, key, claimed)))


def _held(tenant_id: str, key: str, claimed: Claim) -> tuple:
    return (
        IdempotencyKey.tenant_id == tenant_id,
        IdempotencyKey.key == key,
        IdempotencyKey.holder == claimed.holder,
        IdempotencyKey.status == IN_FLIGHT,
    )


def prune(s: Session, now: float, limit: int) -> int:
    """Delete up to ``limit`` keys past ``KEY_SECONDS`` (done or abandoned); how many went."""
    old = (
        select(IdempotencyKey.tenant_id, IdempotencyKey.key)
        .where(IdempotencyKey.created_at <= now - KEY_SECONDS)
        .order_by(IdempotencyKey.created_at)
        .limit(limit)
    )
    rows = s.execute(old).all()
    if not rows:
        return 0
    key_pairs = [(tenant_id, key) for tenant_id, key in rows]
    return changed_rows(
        s,
        delete(IdempotencyKey)
        .where(tuple_(IdempotencyKey.tenant_id, IdempotencyKey.key).in_(key_pairs))
        .execution_options(synchronize_session=False),
    )
