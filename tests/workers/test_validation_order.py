"""Validation writes a batch's requests in prompt-prefix order, in bounded memory (real database,
object store and the demo model's tokenizer; no engine)."""

from __future__ import annotations

import random
from dataclasses import replace
from itertools import pairwise

from sqlalchemy import select

from api.services.tenants import create_tenant
from scheduler.ordering import common_prefix_tokens
from scheduler.unit_plan import predicted_cached_tokens
from storage.models import Batch, WorkUnit
from storage.runtime import Runtime
from storage.shards import PREFIX_KEY_BYTES, read_rows
from tests.conftest import now
from tests.factories import chat_line, upload_and_create
from workers.validation import validate_batch

DOCS = 6
QUESTIONS = 5


def doc_lines(seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    words = ["alpha", "ledger", "river", "copper", "index", "marble", "signal", "harbor"]
    docs = [" ".join(rng.choice(words) for _ in range(400)) for _ in range(DOCS)]
    lines = [
        chat_line(f"d{d}-q{q}", f"{docs[d]}\\n\\nQuestion {q}: what is item {q * 3 + d}?")
        for d in range(DOCS)
        for q in range(QUESTIONS)
    ]
    rng.shuffle(lines)
    return lines


def test_shards_hold_the_batch_in_prefix_order_even_when_the_sort_spills(settings):
    rt = Runtime(replace(settings, unit_size=4, sort_memory_mb=0, max_file_bytes=1 << 20))  # 0 MB: all spill
    try:
        tenant, _ = create_tenant(rt.db, "t", now())
        lines = doc_lines()
        batch = upload_and_create(rt, tenant.id, lines, name="docs.jsonl")
        validate_batch(rt, batch.id)
        with rt.db.read() as s:
            assert s.get(Batch, batch.id).status == "in_progress"
            units = s.scalars(
                select(WorkUnit).where(WorkUnit.batch_id == batch.id).order_by(WorkUnit.seq)
            ).all()
        rows = [
            (u, row) for u in units for row in read_rows(rt.store, u.shard_key, u.row_start, u.n_requests)
        ]
    finally:
        rt.db.dispose()
    assert [u.n_requests for u in units] == [4] * 7 + [2]
    keys = [row.key for _, row in rows]
    assert all(keys) and keys == sorted(keys)  # one order across all the batch's shards
    # every custom_id once, bodies intact, line numbers those of the input file
    assert sorted(row.custom_id for _, row in rows) == sorted(x["custom_id"] for x in lines)
    by_id = {x["custom_id"]: (i + 1, x["body"]) for i, x in enumerate(lines)}
    assert all((row.line, row.body) == by_id[row.custom_id] for _, row in rows)
    # the questions on one document are contiguous: a depth-first walk of the prefix tree
    docs = [row.custom_id.split("-")[0] for _, row in rows]
    assert [d for i, d in enumerate(docs) if i == 0 or d != docs[i - 1]] == sorted(set(docs), key=docs.index)
    assert len(set(docs)) == DOCS
    # neighbours share the document's tokens; the unit row keeps its first key's first 32 tokens
    same_doc = [common_prefix_tokens(a, b) for a, b in pairwise(keys)]
    assert sorted(same_doc)[-DOCS * (QUESTIONS - 1)] > 300
    for unit in units:
        first = next(read_rows(rt.store, unit.shard_key, unit.row_start, 1))
        assert unit.prefix_key == first.key[:PREFIX_KEY_BYTES] and len(unit.prefix_key) == PREFIX_KEY_BYTES


def planned(rt: Runtime, lines: list[dict], tenant_name: str = "t") -> tuple[Batch, list[WorkUnit], list]:
    tenant, _ = create_tenant(rt.db, tenant_name, now())
    batch = upload_and_create(rt, tenant.id, lines, name="plan.jsonl")
    validate_batch(rt, batch.id)
    with rt.db.read() as s:
        b = s.get(Batch, batch.id)
        units = s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch.id).order_by(WorkUnit.seq)).all()
    rows = [[*read_rows(rt.store, u.shard_key, u.row_start, u.n_requests)] for u in units]
    return b, list(units), rows


def test_units_and_batch_record_the_cache_hits_the_sorted_order_predicts(settings):
    rt = Runtime(replace(settings, unit_size=4, max_file_bytes=1 << 20))  # engine_block_size 0: 128
    try:
        batch, units, rows = planned(rt, doc_lines())
    finally:
        rt.db.dispose()
    assert batch.status == "in_progress"
    flat = [row for unit_rows in rows for row in unit_rows]
    # each row: what its key shares with the row before it in the batch, across units and shards
    assert [r.shared_tokens for r in flat] == [0] + [
        common_prefix_tokens(a.key, b.key) for a, b in pairwise(flat)
    ]
    for unit, unit_rows in zip(units, rows, strict=True):
        assert unit.planned_prompt_tokens == sum(r.prompt_len for r in unit_rows)
        assert unit.planned_cached_tokens == sum(
            predicted_cached_tokens(r.shared_tokens, r.prompt_len, 128) for r in unit_rows
        )
        assert unit.planned_cached_tokens % 128 == 0
    assert batch.planned_prompt_tokens == sum(u.planned_prompt_tokens for u in units)
    assert batch.planned_cached_tokens == sum(u.planned_cached_tokens for u in units)
    # 6 documents of ~400 tokens, 5 questions each: all but the first question per document hit
    assert 0.5 < batch.planned_cached_tokens / batch.planned_prompt_tokens < 0.8


def test_a_shared_long_prompt_predicts_a_high_hit_rate_and_unique_prompts_none(settings):
    rng = random.Random(3)
    words = ["alpha", "ledger", "river", "copper", "index", "marble", "signal", "harbor"]
    system = " ".join(rng.choice(words) for _ in range(250))  # under sort_key_tokens
    shared = [chat_line(f"s{i}", f"{system}\\n\\nQuestion {i}?") for i in range(12)]
    unique = [chat_line(f"u{i}", " ".join(rng.choice(words) for _ in range(300))) for i in range(12)]
    rt = Runtime(replace(settings, max_file_bytes=1 << 20))
    try:
        high, _, _ = planned(rt, shared)
        low, _, _ = planned(rt, unique, "u")
    finally:
        rt.db.dispose()
    assert high.planned_cached_tokens / high.planned_prompt_tokens > 0.8
    assert low.planned_prompt_tokens > 0 and low.planned_cached_tokens / low.planned_prompt_tokens < 0.05
