"""The lease keepers (storage/leases.py) on each database Freight supports: of two claims racing
exactly one wins, a lease that ran out can be taken over, and a holder whose lease was taken over
can neither renew nor release it, for every keeper; and no product code writes a lease column but
through one."""

from __future__ import annotations

import ast
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from storage.db import Database
from storage.leases import (
    FINALIZER_LEASE,
    KEEPERS,
    SCAN_LEASE,
    UNIT_LEASE,
    VALIDATION_CHUNK_LEASE,
    VALIDATION_LEASE,
    WEBHOOK_DELIVERY_LEASE,
    WEBHOOK_ENDPOINT_LEASE,
    LeaseKeeper,
)
from storage.models import (
    Base,
    Batch,
    DropFolder,
    DropObject,
    Estimate,
    StoredFile,
    Tenant,
    UnitStatus,
    ValidationChunk,
    WebhookDelivery,
    WebhookEndpoint,
    WorkUnit,
)
from storage.status import BatchStatus

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
        return SCAN_LEASE.take(s, folder_id, now, *extra, now=now, lease_seconds=LEASE)


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
        assert not SCAN_LEASE.renew(s, folder_id, T0, T0 + 40)
        assert not SCAN_LEASE.release(s, folder_id, T0, last_error="x")
    assert lease_of(db, folder_id) == T0 + LEASE + 1
    with db.read() as s:
        assert s.get(DropFolder, folder_id).last_error is None
    # the holder's own token does renew, then release
    with db.write() as s:
        assert SCAN_LEASE.renew(s, folder_id, T0 + LEASE + 1, T0 + LEASE + 5)
    assert lease_of(db, folder_id) == T0 + LEASE + 5
    with db.write() as s:
        assert SCAN_LEASE.release(s, folder_id, T0 + LEASE + 5, scan_failures=0)
    assert lease_of(db, folder_id) is None
    assert take(db, folder_id, T0 + LEASE + 6)  # free again at once


def test_a_lease_without_expiry_is_free_only_when_null(db, folder_id):
    """The work-unit claim's form: the token is a worker's, and only a NULL column is free."""
    keeper = LeaseKeeper(DropFolder, "last_error")
    with db.write() as s:
        assert keeper.take(s, folder_id, "w1")
        assert not keeper.take(s, folder_id, "w2")
        assert keeper.release(s, folder_id, "w1")
        assert keeper.take(s, folder_id, "w2")


@pytest.fixture
def batch_id(db: Database, folder_id: str) -> str:
    """A batch finalizing, with two pending units."""
    with db.write() as s:
        folder = s.get(DropFolder, folder_id)
        assert folder is not None
        f = StoredFile(tenant_id=folder.tenant_id, purpose="batch", filename="in.jsonl", bytes=1,
                       object_key="k", created_at=int(T0))  # fmt: skip
        s.add(f)
        s.flush()
        batch = Batch(tenant_id=folder.tenant_id, endpoint="/v1/chat/completions", input_file_id=f.id,
                      completion_window="24h", status=BatchStatus.FINALIZING, created_at=int(T0),
                      expires_at=int(T0) + 86400)  # fmt: skip
        s.add(batch)
        s.flush()
        for seq in range(2):
            s.add(WorkUnit(batch_id=batch.id, seq=seq, model="demo", shard_key="k", first_line=seq,
                           n_requests=1))  # fmt: skip
        return batch.id


def test_the_keeper_refuses_a_stale_finalizers_renewal_and_release(db, batch_id):
    """A finalizer whose lease ran out and was taken over (workers/finalize.py holds the time it
    took or last renewed the lease as its token) neither renews nor releases the new holder's."""
    with db.write() as s:
        assert FINALIZER_LEASE.take(s, batch_id, T0, now=T0, lease_seconds=LEASE)
        assert not FINALIZER_LEASE.take(s, batch_id, T0 + 1, now=T0 + 1, lease_seconds=LEASE)
        assert FINALIZER_LEASE.renew(s, batch_id, T0, T0 + 10)  # the holder's own token renews
        assert FINALIZER_LEASE.take(s, batch_id, T0 + 50, now=T0 + 50, lease_seconds=LEASE)  # ran out
        assert not FINALIZER_LEASE.renew(s, batch_id, T0 + 10, T0 + 60)  # the stale holder's
        assert not FINALIZER_LEASE.release(s, batch_id, T0 + 10)
    with db.read() as s:
        assert s.scalar(select(Batch.finalizer_heartbeat_at).where(Batch.id == batch_id)) == T0 + 50
    with db.write() as s:
        assert FINALIZER_LEASE.release(s, batch_id, T0 + 50)
        assert FINALIZER_LEASE.take(s, batch_id, T0 + 51, now=T0 + 51, lease_seconds=LEASE)
        # the task policy failing the batch ends the lease whoever holds it
        assert VALIDATION_LEASE.revoke(s, [batch_id]) == 1
        assert FINALIZER_LEASE.revoke(s, [batch_id]) == 1
    with db.read() as s:
        assert s.scalar(select(Batch.finalizer_heartbeat_at).where(Batch.id == batch_id)) is None


def test_a_unit_lease_moves_the_units_status_and_refuses_a_stale_holder(db, batch_id):
    with db.read() as s:
        first, second = s.scalars(
            select(WorkUnit.id).where(WorkUnit.batch_id == batch_id).order_by(WorkUnit.id)
        )
    claim = {"from_": (UnitStatus.PENDING, UnitStatus.QUEUED), "to": UnitStatus.RUNNING}
    back = {"from_": UnitStatus.RUNNING, "to": UnitStatus.PENDING}
    with db.write() as s:
        assert UNIT_LEASE.take(s, first, "w1", **claim, heartbeat_at=T0)
        assert not UNIT_LEASE.take(s, first, "w2", **claim)  # held: no second claim
        assert UNIT_LEASE.take(s, second, "w1", **claim, heartbeat_at=T0)
        # the tick takes the first back over w1's head (its heartbeats stopped); w2 claims it
        assert UNIT_LEASE.revoke(s, [first], **back) == 1
        assert UNIT_LEASE.take(s, first, "w2", **claim)
        assert not UNIT_LEASE.release(s, first, "w1", **back)  # w1's lease on it is gone
        assert UNIT_LEASE.release(s, second, "w1", **back, attempts=0)
    with db.read() as s:
        rows = s.execute(select(WorkUnit.status, WorkUnit.worker).order_by(WorkUnit.id)).all()
    assert [tuple(r) for r in rows] == [(UnitStatus.RUNNING, "w2"), (UnitStatus.PENDING, None)]


TIME_LEASES = [k for k in KEEPERS if k is not UNIT_LEASE]


@pytest.fixture
def lease_rows(db: Database, batch_id: str, folder_id: str) -> dict[type, object]:
    """A row of each table with a time lease: the batch, a chunk, the folder, a drop object, a
    webhook endpoint and a pending delivery to it, an estimate."""
    with db.write() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None
        tenant_id = batch.tenant_id
        chunk = ValidationChunk(batch_id=batch_id, seq=0, start=0, stop=10)
        obj = DropObject(folder_id=folder_id, bucket="b", key="p/inbox/a.jsonl", etag="e", size=1,
                         created_at=T0)  # fmt: skip
        endpoint = WebhookEndpoint(tenant_id=tenant_id, url="https://example.com/h",
                                   events=["batch.completed"], secret="whsec_x", status_at=int(T0),
                                   created_at=int(T0))  # fmt: skip
        estimate = Estimate(tenant_id=tenant_id, input_file_id="file-x", endpoint="/v1/chat/completions",
                            completion_window="24h", price_multiplier=1.0, created_at=int(T0))  # fmt: skip
        s.add_all([chunk, obj, endpoint, estimate])
        s.flush()
        delivery = WebhookDelivery(endpoint_id=endpoint.id, tenant_id=tenant_id, batch_id=batch_id,
                                   event_id="evt_1", event_type="batch.completed", created_at=int(T0),
                                   status_at=int(T0), next_attempt_at=T0)  # fmt: skip
        s.add(delivery)
        s.flush()
        return {Batch: batch_id, ValidationChunk: chunk.id, DropFolder: folder_id, DropObject: obj.id,
                WebhookEndpoint: endpoint.id, WebhookDelivery: delivery.id, Estimate: estimate.id}  # fmt: skip


def token_of(db: Database, keeper: LeaseKeeper, row_id: object) -> object:
    with db.read() as s:
        return s.scalar(select(getattr(keeper.model, keeper.column)).where(keeper.model.id == row_id))


@pytest.mark.parametrize("keeper", TIME_LEASES, ids=lambda k: f"{k.model.__name__}.{k.column}")
def test_every_time_lease_refuses_a_stale_holders_renewal_and_release(db, lease_rows, keeper):
    """A holder whose time lease ran out and was taken over (a validation chunk's, a webhook
    attempt's delivery and endpoint leases, and the others alike) neither renews nor releases the
    new holder's; the new holder does both, and a revoke ends it whoever holds it."""
    row_id = lease_rows[keeper.model]
    held = {"lease_seconds": LEASE}
    with db.write() as s:
        assert keeper.take(s, row_id, T0, now=T0, **held)
        assert not keeper.take(s, row_id, T0 + 1, now=T0 + 1, **held)  # held: a second holder waits
        assert keeper.renew(s, row_id, T0, T0 + 10)
        assert not keeper.take(s, row_id, T0 + 10 + LEASE, now=T0 + 10 + LEASE, **held)  # renewed: held
        assert keeper.take(s, row_id, T0 + 11 + LEASE, now=T0 + 11 + LEASE, **held)  # ran out: taken over
        assert not keeper.renew(s, row_id, T0 + 10, T0 + 60)  # the stale holder's
        assert not keeper.release(s, row_id, T0 + 10)
    assert token_of(db, keeper, row_id) == T0 + 11 + LEASE
    with db.write() as s:
        assert keeper.renew(s, row_id, T0 + 11 + LEASE, T0 + 12 + LEASE)
        assert keeper.release(s, row_id, T0 + 12 + LEASE)
        assert not keeper.release(s, row_id, T0 + 12 + LEASE)  # released once
    assert token_of(db, keeper, row_id) is None
    with db.write() as s:
        assert keeper.take(s, row_id, T0 + 13 + LEASE, now=T0 + 13 + LEASE, **held)  # free at once
        assert keeper.revoke(s, [row_id]) == 1
    assert token_of(db, keeper, row_id) is None


# -- no lease column is written but through storage/leases.py -------------------------------------

REPO = Path(__file__).resolve().parents[2]
LEASE_COLUMNS = {keeper.column for keeper in KEEPERS}
TIME_LEASE_COLUMNS = {keeper.column for keeper in KEEPERS if keeper is not UNIT_LEASE}
# calls whose keywords are column writes: an UPDATE's values and the status movers that take extra
# columns with the move
WRITES = {"values", "move_units", "move_units_by_id", "move_delivery", "move_estimates"}
LEASE_CALLS = {"take", "renew", "release", "revoke"}  # a keeper's: a status move there bypasses move_units

# the leases of the schema, each with its keeper (a lease column added later names itself below)
SCHEMA_LEASES = {
    (WorkUnit, "worker"),
    (Batch, "finalizer_heartbeat_at"),
    (Batch, "validation_heartbeat_at"),
    (ValidationChunk, "lease_at"),
    (Estimate, "lease_at"),
    (DropFolder, "scan_lease_at"),
    (DropObject, "delivery_lease_at"),
    (WebhookDelivery, "lease_at"),
    (WebhookEndpoint, "busy_at"),
}


def test_every_lease_of_the_schema_has_a_keeper():
    assert {(k.model, k.column) for k in KEEPERS} == SCHEMA_LEASES
    keepers = (VALIDATION_CHUNK_LEASE, WEBHOOK_DELIVERY_LEASE, WEBHOOK_ENDPOINT_LEASE)
    assert [(k.model, k.column) for k in keepers] == [
        (ValidationChunk, "lease_at"),
        (WebhookDelivery, "lease_at"),
        (WebhookEndpoint, "busy_at"),
    ]
    # a column named as a lease is one of them
    named = {(m.class_, c.key) for m in Base.registry.mappers for c in m.columns if "lease" in c.key}
    assert named <= SCHEMA_LEASES


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _keys(node: ast.Dict) -> list[str]:
    return [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]


def written(node: ast.AST) -> list[str]:
    """The lease columns ``node`` writes: a keyword of an UPDATE's ``.values(...)`` or of a status
    mover's (``move_units``, ``move_delivery``, ...), a key of a dict passed to one, a time lease's
    column as a key of any dict (values to splat into a write later: ``seen = {"lease_at": None}``;
    not "worker", a key of log fields and metric labels too), an assignment to a row's attribute
    (``batch.finalizer_heartbeat_at = None``), a ``setattr`` naming one; and "status" for a status
    move made inside a keeper's call (it belongs to ``move_units``)."""
    columns: list[str] = []
    if isinstance(node, ast.Dict):
        return [c for c in _keys(node) if c in TIME_LEASE_COLUMNS]
    if isinstance(node, ast.Call) and _name(node.func) in WRITES:
        columns += [k.arg for k in node.keywords if k.arg]
        for arg in [*node.args, *(k.value for k in node.keywords if k.arg is None)]:
            if isinstance(arg, ast.Dict):  # its time lease keys: the dict itself counts them
                columns += [c for c in _keys(arg) if c not in TIME_LEASE_COLUMNS]
    elif isinstance(node, ast.Call) and _name(node.func) in LEASE_CALLS:
        return ["status"] if any(k.arg == "status" for k in node.keywords) else []
    elif isinstance(node, ast.Call) and _name(node.func) == "setattr" and len(node.args) > 1:
        if isinstance(node.args[1], ast.Constant):
            columns.append(str(node.args[1].value))
    elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        columns += [t.attr for t in targets if isinstance(t, ast.Attribute)
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self")]  # fmt: skip
    return [c for c in columns if c in LEASE_COLUMNS]


def raw_lease_writes(root: Path = REPO) -> list[str]:
    """Every write of a lease column (``written``) in the product code outside storage/leases.py."""
    found = []
    for folder in ("storage", "workers", "api"):
        for path in sorted((root / folder).rglob("*.py")):
            where = str(path.relative_to(root))
            if where == "storage/leases.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                found += [f"{where}:{getattr(node, 'lineno', 0)} {column}" for column in written(node)]
    return found


def test_no_lease_column_is_written_but_through_the_keeper():
    assert raw_lease_writes() == []


@pytest.mark.parametrize(
    ("sample", "column"),
    [
        ("s.execute(update(Batch).values(finalizer_heartbeat_at=None))", "finalizer_heartbeat_at"),
        ("batch.scan_lease_at = 1.0", "scan_lease_at"),
        ("move_units(s, w, from_=a, to=b, worker=None)", "worker"),
        ("s.execute(update(T).values({'delivery_lease_at': None}))", "delivery_lease_at"),
        ("setattr(batch, 'validation_heartbeat_at', None)", "validation_heartbeat_at"),
        ("UNIT_LEASE.take(s, 1, 't', status=RUNNING)", "status"),
        ("delivery.lease_at = now", "lease_at"),
        ("s.execute(update(WebhookEndpoint).values(busy_at=None))", "busy_at"),
        ("move_delivery(s, i, FAILED, now, lease_at=None)", "lease_at"),
        ("s.execute(update(ValidationChunk).where(w).values(lease_at=now, sent_at=now))", "lease_at"),
        ("seen = {'attempts': 1, 'lease_at': None}\nmove_delivery(s, i, DONE, now, **seen)", "lease_at"),
        ("s.execute(update(WorkUnit).values({'worker': None, 'status': PENDING}))", "worker"),
    ],
)
def test_the_source_scan_sees_each_form_of_a_raw_lease_write(sample, column):
    """The scan on the forms it looks for: a scan that passes could otherwise be a blind one."""
    assert [c for node in ast.walk(ast.parse(sample)) for c in written(node)] == [column]


def test_the_source_scan_passes_what_is_not_a_lease_write():
    harmless = (
        "self.worker = worker\nconfigure(worker=name)\nEngineSample(worker=w)\nrow.status = 'x'\n"
        "fields = {'worker': name, 'batch_id': b}\nmove_delivery(s, i, DONE, now, attempts=1)"
    )
    assert [c for node in ast.walk(ast.parse(harmless)) for c in written(node)] == []


def test_the_source_scan_finds_a_raw_write_planted_in_the_product_code(tmp_path):
    """The scan over a tree: a raw write anywhere in storage/, workers/ or api/ is found, with
    where it is; storage/leases.py itself may write."""
    for where, text in [
        ("storage/leases.py", "row.busy_at = now\n"),
        ("workers/webhooks.py", "x = 1\n\ndelivery.lease_at = now\n"),
        ("api/services/webhooks.py", "s.execute(update(WebhookEndpoint).values(busy_at=None))\n"),
    ]:
        (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / where).write_text(text)
    assert raw_lease_writes(tmp_path) == [
        "workers/webhooks.py:3 lease_at",
        "api/services/webhooks.py:1 busy_at",
    ]
