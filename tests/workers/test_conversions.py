"""The conversion task's side (``workers.conversions``) on SQLite and PostgreSQL with the real
object store and Redis broker: a conversion made once and counted in the tenant's stored bytes, a
redelivered task that changes nothing, a lost task sent again, a fault remembered as a refusal, a
file deleted before its conversion ran.

The task is run by its function (``conversions.convert`` is the whole body of
``freight.convert_file``; ``end_conversion`` its fault handler), in this process: what is tested
is what it records, and the live tests (tests/e2e/test_parquet_live.py) run it on a worker."""

from __future__ import annotations

import time

from api.services import files
from api.services.tenants import create_tenant
from storage.errors import ServiceError
from storage.models import FileConversion
from storage.quotas import stored_bytes
from tests.conftest import now
from tests.factories import chat_line, conversions_sent, upload
from workers import conversions, tasks


def _prepared(runtime, tenant_id: str) -> str:
    record = upload(runtime, tenant_id, [chat_line("a"), chat_line("b")])
    made = files.download(runtime, tenant_id, record.id, "parquet")
    assert isinstance(made, conversions.Preparing) and made.retry_after == conversions.RETRY_AFTER_SECONDS
    return record.id


def test_a_conversion_is_made_once_and_counted(runtime) -> None:
    tenant, _ = create_tenant(runtime.db, "alpha", now())
    file_id = _prepared(runtime, tenant.id)
    with runtime.db.read() as s:
        before = stored_bytes(s, tenant.id)
    assert conversions.convert(runtime, file_id, "parquet") == conversions.READY
    assert conversions.convert(runtime, file_id, "parquet") is None  # redelivered: nothing to do
    content = files.download(runtime, tenant.id, file_id, "parquet")
    assert isinstance(content, files.Content)
    data = b"".join(content.chunks)
    assert data[:4] == b"PAR1" and content.size == len(data)
    with runtime.db.read() as s:
        assert stored_bytes(s, tenant.id) == before + len(data)
    assert conversions_sent(runtime, file_id, "parquet") == 1
    files.delete(runtime, tenant.id, file_id)  # its conversion goes with it, from the store and the count
    assert not runtime.store.exists(conversions.derived_key(file_id, "parquet"))
    with runtime.db.read() as s:
        assert stored_bytes(s, tenant.id) == 0


def test_a_lost_task_is_sent_again_only_after_its_time_limit(runtime) -> None:
    tenant, _ = create_tenant(runtime.db, "alpha", now())
    file_id = _prepared(runtime, tenant.id)
    files.download(runtime, tenant.id, file_id, "parquet")
    assert conversions_sent(runtime, file_id, "parquet") == 1
    with runtime.db.write() as s:  # as if its worker was lost with the message long ago
        s.get(FileConversion, (file_id, "parquet")).sent_at = int(
            time.time() - conversions.resend_seconds(runtime) - 1
        )
    assert isinstance(files.download(runtime, tenant.id, file_id, "parquet"), conversions.Preparing)
    assert conversions_sent(runtime, file_id, "parquet") == 2


def test_a_fault_is_remembered_as_the_conversions_refusal(runtime) -> None:
    tenant, _ = create_tenant(runtime.db, "alpha", now())
    file_id = _prepared(runtime, tenant.id)
    tasks.end_conversion(None, runtime, "convert_file: ran past its time limit", file_id, "parquet")  # type: ignore[arg-type]
    for _ in range(2):
        try:
            files.download(runtime, tenant.id, file_id, "parquet")
        except ServiceError as refused:
            assert (refused.kind, refused.code) == ("invalid_request", "conversion_failed")
            assert "ran past its time limit" in refused.message
        else:
            raise AssertionError("a failed conversion must answer its refusal")
    assert conversions.convert(runtime, file_id, "parquet") is None
    assert conversions_sent(runtime, file_id, "parquet") == 1


def test_a_file_deleted_before_its_conversion_ran_is_not_converted(runtime) -> None:
    tenant, _ = create_tenant(runtime.db, "alpha", now())
    file_id = _prepared(runtime, tenant.id)
    files.delete(runtime, tenant.id, file_id)
    assert conversions.convert(runtime, file_id, "parquet") == conversions.REFUSED
    assert not runtime.store.exists(conversions.derived_key(file_id, "parquet"))


def test_a_tenant_has_at_most_its_validation_turns_of_conversions_being_made(runtime) -> None:
    """Each conversion is a task of the validation pool: a tenant asking for every file of its own
    in the other format gets FREIGHT_TENANT_VALIDATIONS (2) at once, then a 429 until one is made."""
    tenant, _ = create_tenant(runtime.db, "alpha", now())
    other, _ = create_tenant(runtime.db, "beta", now())
    first, second = (_prepared(runtime, tenant.id) for _ in range(2))
    third = upload(runtime, tenant.id, [chat_line("c")]).id
    try:
        files.download(runtime, tenant.id, third, "parquet")
    except ServiceError as refused:
        assert (refused.kind, refused.code, refused.retry_after) == (
            "rate_limited",
            "too_many_conversions",
            2,
        )
        assert "2 files of yours are being converted (at most 2 at once)" in refused.message
    else:
        raise AssertionError("a third conversion at once must be refused")
    assert conversions_sent(runtime, third, "parquet") == 0
    _prepared(runtime, other.id)  # another tenant's are its own
    # one asked again while being made is not a new one; one made frees its turn
    assert isinstance(files.download(runtime, tenant.id, first, "parquet"), conversions.Preparing)
    assert conversions.convert(runtime, second, "parquet") == conversions.READY
    assert isinstance(files.download(runtime, tenant.id, third, "parquet"), conversions.Preparing)
