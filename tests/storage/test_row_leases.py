"""The lease helper (storage/leases.py) on each database Freight supports: of two claims racing
exactly one wins, a lease that ran out can be taken over, and a holder whose lease was taken over
can neither renew nor release it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from storage.db import Database
from storage.leases import release_lease, renew_lease, take_lease
from storage.models import DropFolder, Tenant

LEASE = 30.0
T0 = 1_000_000.0


@pytest.fixture
def db(database_url: str) -> Iterator[Database]:
    database = Database(database_url)
    yield database
    database.dispose()


@pytest.fixture
def folder_id(db: Database) -> str:
    with db.write() as s:
        tenant = Tenant(name="a", created_at=int(T0))
        s.add(tenant)
        s.flush()
        folder = DropFolder(
            tenant_id=tenant.id, bucket="b", prefix="p", endpoint="/v1/chat/completions",
            completion_window="24h", created_at=int(T0),
        )  # fmt: skip
        s.add(folder)
        s.flush()
        return folder.id


def take(db: Database, folder_id: str, now: float, *extra) -> bool:
    with db.write() as s:
        return take_lease(
            s, DropFolder, folder_id, "scan_lease_at", now, *extra, now=now, lease_seconds=LEASE
        )


def lease_of(db: Database, folder_id: str) -> float | None:
    with db.read() as s:
        folder = s.get(DropFolder, folder_id)
        assert folder is not None
        return folder.scan_lease_at


def test_of_claims_racing_exactly_one_wins(db, folder_id):
    racers = 4
    start = threading.Barrier(racers)
    won: list[bool] = []

    def claim(i: int) -> None:
        start.wait()
        won.append(take(db, folder_id, T0 + i / 1000))

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(won) == [False] * (racers - 1) + [True]
    assert lease_of(db, folder_id) is not None


def test_a_held_lease_is_refused_and_an_expired_one_taken_over(db, folder_id):
    assert take(db, folder_id, T0)
    assert not take(db, folder_id, T0 + LEASE)  # not yet run out
    assert take(db, folder_id, T0 + LEASE + 1)  # ran out: taken over
    assert lease_of(db, folder_id) == T0 + LEASE + 1


def test_extra_conditions_must_hold(db, folder_id):
    assert not take(db, folder_id, T0, DropFolder.removed_at.is_not(None))
    assert lease_of(db, folder_id) is None
    assert take(db, folder_id, T0, DropFolder.removed_at.is_(None))


def test_a_stale_token_renews_and_releases_nothing(db, folder_id):
    assert take(db, folder_id, T0)
    assert take(db, folder_id, T0 + LEASE + 1)  # another holder took the lease over
    with db.write() as s:
        assert not renew_lease(s, DropFolder, folder_id, "scan_lease_at", T0, T0 + 40)
        assert not release_lease(s, DropFolder, folder_id, "scan_lease_at", T0, last_error="x")
    assert lease_of(db, folder_id) == T0 + LEASE + 1
    with db.read() as s:
        assert s.get(DropFolder, folder_id).last_error is None
    # the holder's own token does renew, then release
    with db.write() as s:
        assert renew_lease(s, DropFolder, folder_id, "scan_lease_at", T0 + LEASE + 1, T0 + LEASE + 5)
    assert lease_of(db, folder_id) == T0 + LEASE + 5
    with db.write() as s:
        assert release_lease(s, DropFolder, folder_id, "scan_lease_at", T0 + LEASE + 5, scan_failures=0)
    assert lease_of(db, folder_id) is None
    assert take(db, folder_id, T0 + LEASE + 6)  # free again at once


def test_a_lease_without_expiry_is_free_only_when_null(db, folder_id):
    """The work-unit claim's form: the token is a worker's, and only a NULL column is free."""
    with db.write() as s:
        assert take_lease(s, DropFolder, folder_id, "last_error", "w1")
        assert not take_lease(s, DropFolder, folder_id, "last_error", "w2")
        assert release_lease(s, DropFolder, folder_id, "last_error", "w1")
        assert take_lease(s, DropFolder, folder_id, "last_error", "w2")
