"""``Batch.finished_at`` and ``BatchStatus.FINAL``, the one definition of when a batch finished
(the API's timeline and chart, reports, /metrics, drop folders and retention read it), on each
database: on a row and in a query they agree, for every final state and for a batch not final."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import select

from storage.db import Database
from storage.models import Batch, StoredFile, Tenant
from storage.status import STAMP, BatchStatus

T0 = 1_000_000


@pytest.fixture
def db(database_url: str) -> Iterator[Database]:
    database = Database(database_url)
    yield database
    database.dispose()


def test_final_is_the_states_with_no_way_out():
    assert set(BatchStatus.FINAL) == {s for s in BatchStatus if s.is_terminal}
    assert BatchStatus.FINAL not in list(BatchStatus)  # a tuple beside the members, not a state


@pytest.mark.parametrize("status", [*BatchStatus.FINAL, BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING])
def test_finished_at_on_a_row_and_in_a_query_agree(db, status):
    with db.write() as s:
        tenant = Tenant(name="a", created_at=T0)
        s.add(tenant)
        s.flush()
        f = StoredFile(tenant_id=tenant.id, purpose="batch", filename="in.jsonl", bytes=1,
                       object_key="k", created_at=T0)  # fmt: skip
        s.add(f)
        s.flush()
        batch = Batch(tenant_id=tenant.id, endpoint="/v1/chat/completions", input_file_id=f.id,
                      completion_window="24h", status=status, created_at=T0, expires_at=T0 + 86400,
                      in_progress_at=T0 + 1, cancelling_at=T0 + 2)  # fmt: skip
        if status in BatchStatus.FINAL:
            setattr(batch, STAMP[BatchStatus(status)], T0 + 7)
        s.add(batch)
        s.flush()
        batch_id = batch.id
    expected = T0 + 7 if status in BatchStatus.FINAL else None  # cancelling_at is not an end
    with db.read() as s:
        row = s.get(Batch, batch_id)
        assert row is not None and row.finished_at == expected
        assert s.scalar(select(Batch.finished_at).where(Batch.id == batch_id)) == expected
        final = s.scalars(select(Batch.id).where(Batch.status.in_(BatchStatus.FINAL))).all()
        assert final == ([batch_id] if expected is not None else [])
        ended = s.scalars(select(Batch.id).where(Batch.finished_at >= T0 + 7)).all()
        assert ended == final
