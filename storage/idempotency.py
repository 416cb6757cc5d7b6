"""Idempotency keys: the rows behind ``Idempotency-Key`` on creates (the HTTP side is
``api/idempotency.py``; the periodic cleanup prunes them).

A key is claimed before its request runs (one row per tenant and key, inserted in its own
transaction, so of two requests racing with one key exactly one runs: the other finds the row
in flight), and completed with the request's digest and its answer once the request has made
what it makes. A key's life is ``KEY_SECONDS`` from its first use; after that it is as if never
sent. Completing or releasing a claim names its ``holder`` token, so a request that was taken
over never overwrites its successor's row.

A process can die between the create's commit and the answer's record. So the create notes what
it made on its key in its own transaction (``note_created``, one call in each create service,
under ``creating``, which the API sets around the view): the key is then ``created``, naming the
object, and a retry answers that object as it is now instead of making another (``Created``); such
a key is never taken over. A request whose process died before its create committed made nothing:
its key stays in flight, and after ``ABANDONED_SECONDS`` is taken over and the request runs again.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Final, Literal

from sqlalchemy import delete, select, tuple_, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from storage.db import Database, changed_rows
from storage.errors import ServiceError
from storage.models import IdempotencyKey

KEY_SECONDS = 24 * 3600  # a key answers its first answer this long after its first use (Stripe's)
# an in-flight key older than this lost its process (a request runs minutes at most: the largest
# /v1/files upload at a slow client's pace); the next request with it runs
ABANDONED_SECONDS = 15 * 60
IN_FLIGHT: Final = "in_flight"  # a status, and what ``claim`` answers for a key in flight
CREATED: Final = "created"  # the create committed; its answer is not recorded (yet)
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


@dataclass(frozen=True)
class Created:
    """The key's first request committed what it made, ``object_id`` (an OpenAI object whose
    ``object`` is ``kind``), but its answer is not recorded: its process died after the commit, or
    is answering now. ``request_digest`` is of the request's first ``digest_bytes`` body bytes
    (those read when the create committed; None: of the whole request)."""

    kind: str
    object_id: str
    request_digest: str
    digest_bytes: int | None


InFlight = Literal["in_flight"]


def claim(db: Database, tenant_id: str, key: str, now: float) -> Claim | Answer | Created | InFlight:
    """Claim ``key`` for a request of the tenant's: a ``Claim`` (run it), the ``Answer`` of the
    key's first request or the object it ``Created`` (a retry: compare the digests), or
    ``"in_flight"`` (another request with the key is running). A key past ``KEY_SECONDS``, or in
    flight past ``ABANDONED_SECONDS`` having made nothing, is replaced by this claim."""
    for attempt in range(2):
        try:
            with db.write() as s:
                return _claim(s, tenant_id, key, now)
        except IntegrityError:  # PostgreSQL: a concurrent claim inserted the row first
            if attempt:
                raise
    raise AssertionError("unreachable")


def _claim(s: Session, tenant_id: str, key: str, now: float) -> Claim | Answer | Created | InFlight:
    row = s.get(IdempotencyKey, (tenant_id, key), with_for_update=True)
    if row is not None and row.created_at > now - KEY_SECONDS:
        if row.status == DONE:
            assert row.request_digest is not None and row.response_status is not None
            return Answer(row.request_digest, row.response_status, row.response_body or "")
        if row.status == CREATED:  # never taken over: the object exists
            assert row.request_digest is not None and row.response_body is not None
            made = json.loads(row.response_body)
            return Created(made["object"], made["id"], row.request_digest, made["digest_bytes"])
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
    """Forget the claim: its request was refused or failed, so the key may run again. (A create
    that committed and then failed took back what it made, as a batch whose validation could not
    be sent is withdrawn; else it answered.)"""
    with db.write() as s:
        s.execute(delete(IdempotencyKey).where(*_held(tenant_id, key, claimed)))


def _held(tenant_id: str, key: str, claimed: Claim) -> tuple:
    return (
        IdempotencyKey.tenant_id == tenant_id,
        IdempotencyKey.key == key,
        IdempotencyKey.holder == claimed.holder,
        IdempotencyKey.status.in_((IN_FLIGHT, CREATED)),
    )


@dataclass(frozen=True)
class _Creating:
    tenant_id: str
    key: str
    claimed: Claim
    digest_so_far: Callable[[], tuple[str, int | None]]  # see ``Created.digest_bytes``


_creating: ContextVar[_Creating | None] = ContextVar("idempotency_creating", default=None)


@contextmanager
def creating(
    tenant_id: str, key: str, claimed: Claim, digest_so_far: Callable[[], tuple[str, int | None]]
) -> Iterator[None]:
    """While the claim's request runs: a create it makes is noted on its key (``note_created``).
    ``digest_so_far``: the request's digest over what its body has been read of, and how many
    body bytes that is (None: all of it)."""
    token = _creating.set(_Creating(tenant_id, key, claimed, digest_so_far))
    try:
        yield
    finally:
        _creating.reset(token)


def note_created(s: Session, kind: str, object_id: str) -> None:
    """In the transaction of a create that makes ``object_id`` (its OpenAI ``object`` is
    ``kind``): record it on the key of the request running it, if it came with one, so that the
    commit that makes the object also tells a retry what was made. A claim that was taken over
    meanwhile (a successor runs with the key) refuses the create: the transaction rolls back and
    nothing is made twice."""
    running = _creating.get()
    if running is None:  # no Idempotency-Key, or not a request (a drop folder, the console)
        return
    digest, digest_bytes = running.digest_so_far()
    made = json.dumps({"object": kind, "id": object_id, "digest_bytes": digest_bytes})
    noted = update(IdempotencyKey).where(*_held(running.tenant_id, running.key, running.claimed))
    if changed_rows(s, noted.values(status=CREATED, request_digest=digest, response_body=made)) != 1:
        raise ServiceError(
            "conflict",
            f"Idempotency-Key {running.key!r} was taken over by a later request while this one ran",
            param="Idempotency-Key",
            code="idempotency_key_in_use",
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
