"""The idempotency keys' rows (storage/idempotency.py) on SQLite and PostgreSQL: a claim, its
answer, a key in flight, one taken over after its process went silent, the object a create noted
in its own transaction (never taken over), keys past their 24 hours, claims racing, and the
cleanup's pruning."""

from __future__ import annotations

import threading

from sqlalchemy import func, select

from api.services.tenants import create_tenant
from storage import idempotency
from storage.idempotency import ABANDONED_SECONDS, IN_FLIGHT, KEY_SECONDS, Answer, Claim, Created
from storage.models import IdempotencyKey, Tenant
from tests.conftest import now


def tenants(runtime) -> tuple[str, str]:
    return create_tenant(runtime.db, "alpha", now())[0].id, create_tenant(runtime.db, "beta", now())[0].id


def rows(runtime) -> int:
    with runtime.db.read() as s:
        return int(s.scalar(select(func.count()).select_from(IdempotencyKey)) or 0)


def test_a_claimed_key_answers_its_answer_and_is_in_flight_meanwhile(runtime) -> None:
    alpha, beta = tenants(runtime)
    t = 1_000_000.0
    first = idempotency.claim(runtime.db, alpha, "k1", t)
    assert isinstance(first, Claim)
    assert idempotency.claim(runtime.db, alpha, "k1", t + 1) == IN_FLIGHT
    other = idempotency.claim(runtime.db, beta, "k1", t + 1)  # another tenant's key of that name
    assert isinstance(other, Claim)
    assert idempotency.complete(runtime.db, alpha, "k1", first, "d" * 64, 200, '{"id": "batch_1"}')
    again = idempotency.claim(runtime.db, alpha, "k1", t + KEY_SECONDS - 1)
    assert again == Answer("d" * 64, 200, '{"id": "batch_1"}')
    assert idempotency.claim(runtime.db, beta, "k1", t + 2) == IN_FLIGHT  # beta's still runs


def test_a_released_key_runs_again_and_a_stale_holder_changes_nothing(runtime) -> None:
    alpha, _ = tenants(runtime)
    t = 1_000_000.0
    first = idempotency.claim(runtime.db, alpha, "k", t)
    assert isinstance(first, Claim)
    idempotency.release(runtime.db, alpha, "k", first)
    assert rows(runtime) == 0
    second = idempotency.claim(runtime.db, alpha, "k", t + 1)
    assert isinstance(second, Claim) and second != first
    idempotency.release(runtime.db, alpha, "k", first)  # the first's claim is gone: no effect
    assert not idempotency.complete(runtime.db, alpha, "k", first, "d" * 64, 200, "{}")
    assert idempotency.claim(runtime.db, alpha, "k", t + 2) == IN_FLIGHT


def test_an_abandoned_key_is_taken_over_and_its_old_holder_cannot_complete(runtime) -> None:
    alpha, _ = tenants(runtime)
    t = 1_000_000.0
    lost = idempotency.claim(runtime.db, alpha, "k", t)
    assert idempotency.claim(runtime.db, alpha, "k", t + ABANDONED_SECONDS - 1) == IN_FLIGHT
    taken = idempotency.claim(runtime.db, alpha, "k", t + ABANDONED_SECONDS + 1)
    assert isinstance(lost, Claim) and isinstance(taken, Claim) and taken != lost
    assert not idempotency.complete(runtime.db, alpha, "k", lost, "a" * 64, 200, '{"id": "old"}')
    assert idempotency.complete(runtime.db, alpha, "k", taken, "b" * 64, 200, '{"id": "new"}')
    assert idempotency.claim(runtime.db, alpha, "k", t + ABANDONED_SECONDS + 2) == Answer(
        "b" * 64, 200, '{"id": "new"}'
    )


def test_a_create_noted_in_its_transaction_is_answered_and_never_taken_over(runtime) -> None:
    alpha, _ = tenants(runtime)
    t = 1_000_000.0
    with runtime.db.write() as s:  # outside a request with a key: nothing to note
        idempotency.note_created(s, "batch", "batch_x")
    assert rows(runtime) == 0
    claimed = idempotency.claim(runtime.db, alpha, "k", t)
    assert isinstance(claimed, Claim)
    with idempotency.creating(alpha, "k", claimed, lambda: ("c" * 64, 120)):
        try:
            with runtime.db.write() as s:  # a create that rolls back notes nothing
                idempotency.note_created(s, "batch", "batch_gone")
                raise RuntimeError("rolled back")
        except RuntimeError:
            pass
        assert idempotency.claim(runtime.db, alpha, "k", t + 1) == IN_FLIGHT
        with runtime.db.write() as s:
            s.get(Tenant, alpha)  # the create's own rows would be added here
            idempotency.note_created(s, "batch", "batch_1")
    made = Created("batch", "batch_1", "c" * 64, 120)
    assert idempotency.claim(runtime.db, alpha, "k", t + 1) == made
    assert idempotency.claim(runtime.db, alpha, "k", t + ABANDONED_SECONDS + 1) == made  # not taken over
    # the process that made it, alive after all, still records its answer
    assert idempotency.complete(runtime.db, alpha, "k", claimed, "d" * 64, 200, '{"id": "batch_1"}')
    assert idempotency.claim(runtime.db, alpha, "k", t + 2) == Answer("d" * 64, 200, '{"id": "batch_1"}')


def test_a_key_past_its_24_hours_is_new_again_and_pruned(runtime) -> None:
    alpha, beta = tenants(runtime)
    t = 1_000_000.0
    for tenant, key, at in [(alpha, "old", t), (beta, "old", t + 10), (alpha, "young", t + KEY_SECONDS)]:
        claimed = idempotency.claim(runtime.db, tenant, key, at)
        assert isinstance(claimed, Claim)
        idempotency.complete(runtime.db, tenant, key, claimed, "d" * 64, 200, "{}")
    renewed = idempotency.claim(runtime.db, alpha, "old", t + KEY_SECONDS + 1)
    assert isinstance(renewed, Claim)  # the 24 hours have passed: the request runs
    idempotency.release(runtime.db, alpha, "old", renewed)
    with runtime.db.write() as s:
        assert idempotency.prune(s, t + KEY_SECONDS + 11, limit=500) == 1  # beta's old one
    with runtime.db.read() as s:
        left = {(r.tenant_id, r.key) for r in s.scalars(select(IdempotencyKey))}
    assert left == {(alpha, "young")}


def test_of_claims_racing_for_one_key_exactly_one_wins(runtime) -> None:
    alpha, _ = tenants(runtime)
    results: list[object] = []
    start = threading.Barrier(6)

    def race() -> None:
        start.wait()
        results.append(idempotency.claim(runtime.db, alpha, "raced", 1_000_000.0))

    threads = [threading.Thread(target=race) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(isinstance(r, Claim) for r in results) == 1
    assert results.count(IN_FLIGHT) == 5
    assert rows(runtime) == 1
