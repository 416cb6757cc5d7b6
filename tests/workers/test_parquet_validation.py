"""Parquet input through the validating step: the same validated store as JSONL, and bad rows
listed by row and column (real database, object store and the demo model's tokenizer)."""

from __future__ import annotations

import json
from dataclasses import replace

import pyarrow as pa
from sqlalchemy import select

from api.services.tenants import create_tenant
from storage.models import Batch, WorkUnit
from storage.runtime import Runtime
from storage.shards import read_rows
from tests.conftest import now
from tests.factories import OMIT, chat_line, jsonl, parquet_bytes, upload_and_create
from workers.validation import validate_batch


def run(
    rt: Runtime, data: bytes, name: str = "in.parquet", metadata: dict | None = None
) -> tuple[Batch, list]:
    tenant, _ = create_tenant(rt.db, "t", now())
    batch = upload_and_create(rt, tenant.id, data, name=name, metadata=metadata or {})
    validate_batch(rt, batch.id)
    with rt.db.read() as s:
        batch = s.get(Batch, batch.id)
        units = s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch.id).order_by(WorkUnit.seq)).all()
    return batch, [r for u in units for r in read_rows(rt.store, u.shard_key, u.row_start, u.n_requests)]


def test_simple_shape_becomes_the_validated_store(settings):
    rt = Runtime(replace(settings, unit_size=4))
    n = 10
    table = pa.table(
        {
            "custom_id": [f"r{i}" for i in range(n)],
            "messages": [[{"role": "user", "content": f"question {i}"}] for i in range(n)],
            "max_tokens": [i + 1 if i % 2 else None for i in range(n)],
        }
    )
    try:
        batch, rows = run(
            rt, parquet_bytes(table), metadata={"default_model": "demo", "default_max_tokens": "5"}
        )
    finally:
        rt.db.dispose()
    assert batch.status == "in_progress", batch.errors
    assert batch.request_total == n and batch.model == "demo"
    by_id = {r.custom_id: r for r in rows}
    assert sorted(by_id) == sorted(f"r{i}" for i in range(n))
    for i in range(n):
        r = by_id[f"r{i}"]
        assert r.line == i + 1 and r.max_tokens == (i + 1 if i % 2 else 5)
        assert r.body == {
            "model": "demo",
            "max_tokens": r.max_tokens,
            "messages": [{"role": "user", "content": f"question {i}"}],
        }
        assert r.prompt_token_ids and r.prompt_len == len(r.prompt_token_ids)


def test_bad_rows_are_listed_by_row_and_column(settings):
    rt = Runtime(settings)
    table = pa.table(
        {
            "custom_id": ["a", "b", None, "d", "a"],
            "messages": [
                json.dumps([{"role": "user", "content": "fine"}]),
                "[{not json",
                json.dumps([{"role": "user", "content": "no id"}]),
                json.dumps([{"role": "user", "content": "hot"}]),
                json.dumps([{"role": "user", "content": "dup"}]),
            ],
            "temperature": [0.1, 0.2, 0.3, 9.0, 0.5],
            "model": ["demo"] * 5,
        }
    )
    try:
        batch, rows = run(rt, parquet_bytes(table))
    finally:
        rt.db.dispose()
    assert batch.status == "failed" and rows == []
    errors = {e["line"]: e for e in batch.errors["data"]}
    assert sorted(errors) == [2, 3, 4, 5]
    assert errors[2]["param"] == "messages" and errors[2]["message"].startswith("row 2, column 'messages'")
    assert errors[3]["code"] == "missing_custom_id" and errors[3]["message"].startswith(
        "row 3, column 'custom_id'"
    )
    assert errors[4]["param"] == "temperature" and errors[4]["message"].startswith(
        "row 4, column 'temperature'"
    )
    assert errors[5]["code"] == "duplicate_custom_id"


def test_a_model_without_a_tokenizer_fails_clearly(settings, tmp_path):
    (tmp_path / "empty-model").mkdir()
    rt = Runtime(replace(settings, models={"demo": str(tmp_path / "empty-model")}))
    try:
        batch, _ = run(rt, jsonl([chat_line("a", max_tokens=OMIT)]), "in.jsonl")
    finally:
        rt.db.dispose()
    assert batch.status == "failed"
    (error,) = batch.errors["data"]
    assert error["code"] == "tokenizer_unavailable" and "demo" in error["message"] and error["line"] is None
