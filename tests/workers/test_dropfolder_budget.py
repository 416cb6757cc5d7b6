"""A drop folder's inbox file of a tenant whose hard monthly budget is spent (issue #52 part 3):
refused as an API create is (``budget_exceeded``, in its manifest), no batch made, the file moved
to ``failed/``; once the operator makes the budget soft, the next file runs. Real SeaweedFS, on
SQLite and PostgreSQL (the fixtures of test_dropfolder_scan)."""

from __future__ import annotations

import json

from sqlalchemy import select

from storage.models import Batch, Tenant
from tests.factories import cli_on, jsonl, upload_and_create
from tests.workers.test_dropfolder_scan import bucket, folder, get, keys, later, line, put, s3  # noqa: F401
from workers import dropfolder_delivery, dropfolders


def test_a_spent_budget_refuses_the_inbox_file_and_a_soft_one_lets_it_run(runtime, s3, bucket, folder):  # noqa: F811
    assert cli_on(runtime, "tenant", "budget", "alpha", "--monthly", "1").exit_code == 0
    with runtime.db.read() as s:
        tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == "alpha"))
    spent = upload_and_create(runtime, tenant_id, [line("x")]).id
    with runtime.db.write() as s:
        s.get(Batch, spent).cost_micros = 1_000_000  # $1.00 charged: the budget is spent

    put(s3, bucket, "inbox/late.jsonl", jsonl([line("a")]))
    report = dropfolders.scan_folder(runtime, folder, later())
    assert report.created == [] and report.refused == ["inbox/late.jsonl"]
    for delivery in dropfolders.poll(runtime, later()).deliveries:
        assert dropfolder_delivery.deliver(runtime, delivery, later())
    manifest = json.loads(get(s3, bucket, "outbox/late.manifest.json"))
    assert manifest["status"] == "failed" and manifest["batch_id"] is None
    assert manifest["errors"][0]["code"] == "budget_exceeded", manifest
    assert "failed/late.jsonl" in keys(s3, bucket)
    with runtime.db.read() as s:
        assert s.scalars(select(Batch.id)).all() == [spent]

    assert cli_on(runtime, "tenant", "budget", "alpha", "--soft").exit_code == 0
    put(s3, bucket, "inbox/next.jsonl", jsonl([line("b")]))
    assert len(dropfolders.scan_folder(runtime, folder, later()).created) == 1
