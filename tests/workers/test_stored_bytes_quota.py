"""The stored-bytes quota counts everything a tenant's batch stores (issue #49 part 2): its shards
and unit results beside its files; a tenant past its limit cannot create another batch; a batch
whose output takes the tenant past the limit completes with its output kept and says so, and new
work is refused until files go; a drop folder's inbox file is refused before it is copied.
On SQLite and PostgreSQL, on the local store and S3 where the store matters."""

from __future__ import annotations

import uuid
from typing import IO

import pytest

from api.services import dropfolders as folders_service
from api.services import files
from api.services.tenants import set_quota
from storage.errors import ServiceError
from storage.models import Batch, DropObject, StoredFile
from storage.quotas import stored_bytes
from storage.retention import purge_batch_data
from storage.runtime import Runtime
from storage.status import BatchStatus
from tests import factories
from tests.conftest import now
from tests.factories import OMIT, chat_line, jsonl
from tests.workers.test_unit_recorder import claimed, record
from workers import dropfolders
from workers.finalize import finalize_batch
from workers.results import encode, success_line

CHAT = "/v1/chat/completions"


def use(rt: Runtime, tenant_id: str) -> int:
    with rt.db.read() as s:
        return stored_bytes(s, tenant_id)


def listed_bytes(rt: Runtime, prefix: str) -> int:
    return sum(info.size for info in rt.store.list_info(prefix))


def tenant_of(rt: Runtime, batch_id: str) -> str:
    with rt.db.read() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None
        return batch.tenant_id


def input_file(rt: Runtime, batch_id: str) -> str:
    with rt.db.read() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None
        return batch.input_file_id


def test_shards_and_unit_results_count_and_a_tenant_past_its_limit_creates_nothing(
    runtime: Runtime, store_kind: str
) -> None:
    batch_id, (unit,) = claimed(runtime, 2)  # validated: its shards are stored
    tenant_id = tenant_of(runtime, batch_id)
    with runtime.db.read() as s:
        input_bytes = s.get(StoredFile, input_file(runtime, batch_id)).bytes  # type: ignore[union-attr]
    shards = listed_bytes(runtime, f"batches/{batch_id}/shards/")
    assert shards > 0 and use(runtime, tenant_id) == input_bytes + shards

    unit.out.write(encode(success_line("r-0", {"ok": 1})) * 40)
    unit.err.write(b"")
    unit.results = unit.tally.completed = 2
    record(runtime, [unit])
    results = listed_bytes(runtime, f"batches/{batch_id}/units/")
    assert results > 2_000 and use(runtime, tenant_id) == input_bytes + shards + results

    # its own limit just under what its batch stores: no upload and no batch, not even on a file
    # it has (before, only uploads were checked: five batches were accepted over the limit)
    set_quota(runtime.db, "t", {"quota_stored_bytes": str(input_bytes + shards)})
    with pytest.raises(ServiceError) as refused:
        factories.create(runtime, tenant_id, input_file(runtime, batch_id))
    assert refused.value.code == "quota_exceeded" and "stored file bytes" in refused.value.message
    assert f"current use {input_bytes + shards + results:,} bytes" in refused.value.message
    with pytest.raises(ServiceError) as refused:
        factories.upload(runtime, tenant_id, jsonl([chat_line()]))
    assert refused.value.code == "quota_exceeded"


def test_an_output_past_the_limit_is_kept_and_new_work_is_refused_until_files_go(
    runtime: Runtime, store_kind: str
) -> None:
    batch_id, (unit,) = claimed(runtime, 2)
    tenant_id = tenant_of(runtime, batch_id)
    output = encode(success_line("r-0", {"ok": "x" * 3_000})) + encode(success_line("r-1", {"ok": 2}))
    unit.out.write(output)
    unit.results = unit.tally.completed = 2
    # room for everything stored so far and the unit's results, not for the output file as well
    set_quota(runtime.db, "t", {"quota_stored_bytes": str(use(runtime, tenant_id) + len(output) + 100)})
    record(runtime, [unit])

    assert finalize_batch(runtime, batch_id) == BatchStatus.COMPLETED  # nothing is lost
    with runtime.db.read() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None
        out_file = s.get(StoredFile, batch.output_file_id)
        assert out_file is not None
        warnings = batch.warnings or []
    with runtime.store.open(out_file.object_key) as f:
        assert f.read() == output
    assert len(warnings) == 1 and "quota exceeded: stored file bytes" in warnings[0]
    assert "the output is kept" in warnings[0]
    over = use(runtime, tenant_id)
    assert f"current use {over:,} bytes" in warnings[0]

    with pytest.raises(ServiceError) as refused:
        factories.create(runtime, tenant_id, input_file(runtime, batch_id))
    assert refused.value.code == "quota_exceeded"
    with pytest.raises(ServiceError) as refused:
        factories.upload(runtime, tenant_id, jsonl([chat_line()]))
    assert refused.value.code == "quota_exceeded"

    # deleting the output file frees its bytes, the purge of the batch's data its shards and unit
    # results: the tenant may work again
    files.delete(runtime, tenant_id, out_file.id)
    purge_batch_data(runtime, batch_id, now())
    assert use(runtime, tenant_id) < over - len(output)
    factories.upload_and_create(runtime, tenant_id, jsonl([chat_line()]))


def test_an_inbox_file_past_the_quota_is_refused_before_it_is_copied(
    runtime: Runtime, s3_service, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch_id, _ = claimed(runtime, 2)
    tenant_id = tenant_of(runtime, batch_id)
    bucket = s3_service.create_bucket(f"drop-{uuid.uuid4().hex[:10]}")
    view = folders_service.add(
        runtime, f"s3://{bucket}/team", "t", CHAT, now=now(), model="demo", window="24h",
        s3_endpoint_url=s3_service.endpoint_url, region="us-east-1", access_key_id="freight",
        secret_access_key="drop-secret-value",
    )  # fmt: skip
    copied: list[str] = []  # the keys written to Freight's store (the real store writes them)
    put_stream = runtime.store.put_stream

    def noting(key: str, stream: IO[bytes]) -> int:
        copied.append(key)
        return put_stream(key, stream)

    monkeypatch.setattr(runtime.store, "put_stream", noting)
    data = jsonl([chat_line(f"d-{i}", "say it", model=OMIT, max_tokens=2) for i in range(40)])
    set_quota(runtime.db, "t", {"quota_stored_bytes": str(use(runtime, tenant_id) + len(data) - 1)})
    client = s3_service.client()
    client.put_object(Bucket=bucket, Key="team/inbox/big.jsonl", Body=data)

    report = dropfolders.scan_folder(runtime, view.id, now() + 1.0)
    assert report.refused == ["inbox/big.jsonl"] and report.created == []
    assert not [k for k in copied if k.startswith("dropfolders/")]  # refused before the copy
    with runtime.db.read() as s:
        row = s.query(DropObject).one()
    [error] = row.errors or []
    assert row.batch_id is None and error["code"] == "quota_exceeded"
    assert "stored file bytes" in error["message"]

    # room for it: the next version of the file is copied and made a batch
    set_quota(runtime.db, "t", {"quota_stored_bytes": "0"})
    client.put_object(Bucket=bucket, Key="team/inbox/big.jsonl", Body=data + b"\n")
    report = dropfolders.scan_folder(runtime, view.id, now() + 1.0)
    assert len(report.created) == 1 and [k for k in copied if k.startswith("dropfolders/")]
