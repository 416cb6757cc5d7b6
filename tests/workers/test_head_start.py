"""A one-task validation's early slices (workers/head_start.py): real database, object store and
the demo model's tokenizer; no engine (the units' state is what is checked)."""

from __future__ import annotations

import ast
import itertools
import json
import random
from collections import Counter
from dataclasses import replace

import pytest
from sqlalchemy import select

from api.services.tenants import create_tenant, set_quota
from storage.broker import model_queue
from storage.models import Batch, StoredFile, UnitStatus, ValidationChunk, WorkUnit
from storage.runtime import Runtime
from storage.shards import read_rows
from storage.status import BatchStatus
from tests.conftest import now
from tests.factories import chat_line, jsonl, upload_and_create
from workers import validation, validation_chunks
from workers.head_start import HEAD_SLICES
from workers.render_blocks import BLOCK_LINES
from workers.unit_claims import claim_unit
from workers.validation import FileChecks, batch_rules, validate_batch, write_store

HEAD = 10  # the first slice's rows here; the next is 40, then 160


@pytest.fixture
def rt(settings):
    runtime = Runtime(replace(settings, unit_size=4, validation_head_rows=HEAD, max_file_bytes=1 << 20))
    yield runtime
    runtime.db.dispose()


def lines(n: int, prefix: str = "r") -> list[dict]:
    return [chat_line(f"{prefix}{i}", f"question {i}: what is {i * 7 % 13}?") for i in range(n)]


def documents(n: int, docs: int, *, shuffled: bool) -> list[dict]:
    """``n`` questions over ``docs`` documents of several KV blocks each (the document first, so a
    document's questions share its prefix), in file order by document or shuffled (seeded)."""
    texts = [" ".join(f"doc{d} word{w}" for w in range(150)) for d in range(docs)]
    order = random.Random(5).sample(range(n), n) if shuffled else list(range(n))
    return [
        chat_line(f"q{i}", f"{texts[j * docs // n]}\n\nQuestion {j}: what is {j * 7 % 13}?")
        for i, j in enumerate(order)
    ]


def units_of(rt: Runtime, batch_id: str) -> list[WorkUnit]:
    with rt.db.read() as s:
        return list(s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch_id).order_by(WorkUnit.seq)))


def rows_of(rt: Runtime, units: list[WorkUnit]) -> list[list]:
    return [list(read_rows(rt.store, u.shard_key, u.row_start, u.n_requests)) for u in units]


def input_of(rt: Runtime, batch_id: str) -> str:
    with rt.db.read() as s:
        return s.get(StoredFile, s.get(Batch, batch_id).input_file_id).object_key


def slice_of(unit: WorkUnit) -> str:
    """The shards' stem: s0-, s1-... for the slices, "" for the rest."""
    name = unit.shard_key.rsplit("/", 1)[1]
    return name.split("-")[0] if "-" in name else ""


def test_a_file_runs_as_slices_then_the_rest_each_line_in_one_unit(rt):
    tenant, _ = create_tenant(rt.db, "t", now())
    source = lines(80)
    batch = upload_and_create(rt, tenant.id, source)
    validate_batch(rt, batch.id)
    with rt.db.read() as s:
        done = s.get(Batch, batch.id)
        assert done.status == BatchStatus.IN_PROGRESS and done.request_total == 80 and done.model == "demo"
    units = units_of(rt, batch.id)
    rows = rows_of(rt, units)
    # 10 rows, then 40, then the 30 left (a slice of 160 never filled): the rest's
    per_slice = Counter()
    for unit in units:
        per_slice[slice_of(unit)] += unit.n_requests
    assert per_slice == {"s0": 10, "s1": 40, "": 30}
    assert [u.seq for u in units] == list(range(len(units)))
    # slices are the file's first rows in order, each sorted by prompt key within itself
    by_slice: dict[str, list] = {}
    for unit, unit_rows in zip(units, rows, strict=True):
        by_slice.setdefault(slice_of(unit), []).extend(unit_rows)
    assert sorted(r.line for r in by_slice["s0"]) == list(range(1, 11))
    assert sorted(r.line for r in by_slice["s1"]) == list(range(11, 51))
    assert sorted(r.line for r in by_slice[""]) == list(range(51, 81))
    for part in by_slice.values():
        keys = [r.key for r in part]
        assert keys == sorted(keys)
    # every line exactly once, with its body
    flat = [r for unit_rows in rows for r in unit_rows]
    assert sorted(r.custom_id for r in flat) == sorted(x["custom_id"] for x in source)
    assert done.planned_prompt_tokens == sum(u.planned_prompt_tokens for u in units)
    assert sum(u.n_requests for u in units) == 80


def test_a_file_within_its_first_slice_or_with_slices_off_has_none(rt):
    tenant, _ = create_tenant(rt.db, "t", now())
    small = upload_and_create(rt, tenant.id, lines(HEAD), name="small.jsonl")
    validate_batch(rt, small.id)  # exactly one slice of rows, none past it: nothing to overlap
    assert {slice_of(u) for u in units_of(rt, small.id)} == {""}
    off = Runtime(replace(rt.settings, validation_head_rows=0))
    try:
        whole = upload_and_create(off, tenant.id, lines(80), name="whole.jsonl")
        validate_batch(off, whole.id)
        assert {slice_of(u) for u in units_of(off, whole.id)} == {""}
        assert sum(u.n_requests for u in units_of(off, whole.id)) == 80
    finally:
        off.db.dispose()


def test_a_shuffled_file_of_few_long_prefixes_keeps_the_whole_file_sort(rt):
    """Four documents asked 20 questions each, shuffled: a slice boundary would compute each
    document on both sides of it (scheduler/slice_cost.py), so no slice starts and the whole-file
    sort keeps each document's questions together; the same questions in document order start
    slices as any file does."""
    tenant, _ = create_tenant(rt.db, "t", now())
    shuffled = upload_and_create(rt, tenant.id, documents(80, 4, shuffled=True), name="shuffled.jsonl")
    validate_batch(rt, shuffled.id)
    units = units_of(rt, shuffled.id)
    assert {slice_of(u) for u in units} == {""} and sum(u.n_requests for u in units) == 80
    firsts = [r.key[:600] for unit_rows in rows_of(rt, units) for r in unit_rows]
    assert sum(a != b for a, b in itertools.pairwise(firsts)) == 3  # four runs of one document
    grouped = upload_and_create(rt, tenant.id, documents(80, 4, shuffled=False), name="grouped.jsonl")
    validate_batch(rt, grouped.id)
    per_slice = Counter()
    for unit in units_of(rt, grouped.id):
        per_slice[slice_of(unit)] += unit.n_requests
    assert per_slice == {"s0": 10, "s1": 40, "": 30}


def test_slices_stop_at_the_cap_and_the_rest_holds_every_row_after(rt):
    tenant, _ = create_tenant(rt.db, "t", now())
    sizes = [HEAD * 4**k for k in range(HEAD_SLICES)]
    total = sum(sizes) + 25
    many = Runtime(replace(rt.settings, max_file_bytes=1 << 24))
    try:
        batch = upload_and_create(many, tenant.id, lines(total))
        validate_batch(many, batch.id)
        per_slice = Counter()
        for unit in units_of(many, batch.id):
            per_slice[slice_of(unit)] += unit.n_requests
    finally:
        many.db.dispose()
    assert per_slice == {**{f"s{k}": size for k, size in enumerate(sizes)}, "": 25}


def test_a_file_failing_after_its_slices_started_fails_and_skips_their_units(rt):
    """Rows leave the scan a render block (BLOCK_LINES lines) at a time: the first block's rows
    fill slices of 10, 40 and 160 rows, each started as the row after it arrives; the next slice
    (640 rows) is still filling when the file's last line fails it."""
    tenant, _ = create_tenant(rt.db, "t", now())
    size = 3 * BLOCK_LINES
    source = [*lines(size - 1), {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions"}]
    batch = upload_and_create(rt, tenant.id, source)
    validate_batch(rt, batch.id)
    with rt.db.read() as s:
        failed = s.get(Batch, batch.id)
        assert failed.status == BatchStatus.FAILED and failed.request_total == 0
        assert [e["line"] for e in failed.errors["data"]] == [size]
        assert failed.sla_met is None  # it failed validation: it never ran
    units = units_of(rt, batch.id)
    # the slices had started and none of their units runs now
    assert sum(u.n_requests for u in units) == 10 + 40 + 160
    assert {u.status for u in units} == {UnitStatus.SKIPPED}


def test_a_file_with_an_error_before_its_first_slice_starts_none(rt):
    tenant, _ = create_tenant(rt.db, "t", now())
    source = lines(80)
    source[3] = {**source[3], "body": {"model": "demo"}}  # no messages
    batch = upload_and_create(rt, tenant.id, source)
    validate_batch(rt, batch.id)
    with rt.db.read() as s:
        assert s.get(Batch, batch.id).status == BatchStatus.FAILED
    assert units_of(rt, batch.id) == []


def test_a_validation_run_again_keeps_the_slices_an_earlier_run_committed(rt):
    """A run that committed slices and died before concluding: the next run adds only the rest."""
    tenant, _ = create_tenant(rt.db, "t", now())
    source = lines(80)
    batch = upload_and_create(rt, tenant.id, source)
    rules = batch_rules(rt, "/v1/chat/completions", batch.id)
    input_key = input_of(rt, batch.id)
    _, _, sliced_rows = write_store(rt, batch.id, input_key, rules, {})  # slices committed, then "died"
    assert sliced_rows == 50
    first = {u.id: u.n_requests for u in units_of(rt, batch.id)}
    validate_batch(rt, batch.id)
    units = units_of(rt, batch.id)
    assert {u.id: u.n_requests for u in units if u.id in first} == first  # kept as they were
    assert [u.seq for u in units] == list(range(len(units)))
    flat = [r for unit_rows in rows_of(rt, units) for r in unit_rows]
    assert Counter(r.custom_id for r in flat) == Counter(x["custom_id"] for x in source)
    with rt.db.read() as s:
        assert s.get(Batch, batch.id).status == BatchStatus.IN_PROGRESS


def test_no_slice_starts_past_the_tenant_queued_requests_quota(rt):
    tenant, _ = create_tenant(rt.db, "t", now())
    set_quota(rt.db, "t", {"quota_queued_requests": "30"})
    batch = upload_and_create(rt, tenant.id, lines(80))
    validate_batch(rt, batch.id)
    with rt.db.read() as s:
        refused = s.get(Batch, batch.id)
        assert refused.status == BatchStatus.FAILED
        assert [e["code"] for e in refused.errors["data"]] == ["quota_exceeded"]
    units = units_of(rt, batch.id)
    # the first slice (10) fitted the quota of 30; the second (40 more) did not, and never started
    assert sum(u.n_requests for u in units) == HEAD
    assert {u.status for u in units} == {UnitStatus.SKIPPED}


def test_a_validating_batchs_slice_is_packed_at_once_and_claimable(settings):
    """A slice's units are packed as soon as it is committed, the batch still validating; the
    pack does not tell the engine to wait for more (the rest of the file is on its way, but no
    other job is), and a worker may claim its units."""
    # queue_depth 1: a pack is queued with no engine worker asking for one
    rt = Runtime(
        replace(settings, unit_size=4, validation_head_rows=HEAD, max_file_bytes=1 << 20, queue_depth=1)
    )
    try:
        sliced_and_packed(rt)
    finally:
        rt.db.dispose()


def sliced_and_packed(rt: Runtime) -> None:
    tenant, _ = create_tenant(rt.db, "t", now())
    batch = upload_and_create(rt, tenant.id, lines(80))
    rules = batch_rules(rt, "/v1/chat/completions", batch.id)
    write_store(rt, batch.id, input_of(rt, batch.id), rules, {})  # slices only: no conclusion
    with rt.db.read() as s:
        assert s.get(Batch, batch.id).status == BatchStatus.VALIDATING
    queued = [u for u in units_of(rt, batch.id) if u.status == UnitStatus.QUEUED]
    assert queued and len({u.pack_id for u in queued}) == 1
    pack_id = queued[0].pack_id
    with rt.queue.celery.connection_for_write() as conn:
        sent = [
            json.loads(m)["headers"] for m in conn.default_channel.client.lrange(model_queue("demo"), 0, -1)
        ]
    (args,) = [ast.literal_eval(h["argsrepr"]) for h in sent if pack_id in h["argsrepr"]]
    assert args[0] == pack_id and sorted(args[1]) == sorted(u.id for u in queued)
    assert args[2] is False  # more_coming: an idle engine starts at once
    taken = claim_unit(rt, queued[0].id, float(now()), "worker-a", pack_id=pack_id)
    assert taken is not None and taken.batch_id == batch.id


def test_file_checks_say_clean_only_with_a_served_model_and_no_error():
    checks = FileChecks(max_requests=100, max_listed=10)
    assert checks.clean() is None  # no line named a model yet
    assert checks.accept(1, b"a", "demo") is True
    assert checks.clean() == "demo"
    checks.blank(2)  # a blank line is an error if text follows it
    assert checks.clean() is None
    assert checks.accept(3, b"b", "demo") is True
    assert checks.clean() is None and checks.result.error_count == 1


# -- a chunked validation's first chunk ------------------------------------------------------------


def validate_chunked(rt: Runtime, batch_id: str) -> list[int]:
    """Chunks made and sent, validated in file order, merged: a chunked validation's tasks; the
    lines of each chunk."""
    assert validation.validate_batch(rt, batch_id, validation_chunks.validate_in_chunks) is None
    with rt.db.read() as s:
        chunks = s.execute(
            select(ValidationChunk.id, ValidationChunk.seq)
            .where(ValidationChunk.batch_id == batch_id)
            .order_by(ValidationChunk.seq)
        ).all()
    for chunk_id, _ in chunks:
        validation_chunks.validate_chunk(rt, batch_id, chunk_id)
    with rt.db.read() as s:
        counts = [
            s.get(ValidationChunk, chunk_id).lines for chunk_id, _ in chunks
        ]  # before the merge deletes nothing of these rows
    assert validation.validate_batch(rt, batch_id, validation_chunks.validate_in_chunks) is None
    return counts


@pytest.fixture
def chunked_rt(settings):
    runtime = Runtime(
        replace(
            settings,
            unit_size=4,
            validation_chunk_bytes=2048,
            validation_head_rows=HEAD,
            max_file_bytes=1 << 20,
        )
    )
    yield runtime
    runtime.db.dispose()


def test_a_chunked_files_first_chunk_runs_as_a_slice_and_the_merge_adds_the_rest(chunked_rt):
    rt = chunked_rt
    tenant, _ = create_tenant(rt.db, "t", now())
    source = lines(80)
    batch = upload_and_create(rt, tenant.id, source)
    counts = validate_chunked(rt, batch.id)
    assert len(counts) >= 3
    with rt.db.read() as s:
        done = s.get(Batch, batch.id)
        assert done.status == BatchStatus.IN_PROGRESS and done.request_total == 80
    units = units_of(rt, batch.id)
    per_slice = Counter()
    for unit in units:
        per_slice[slice_of(unit)] += unit.n_requests
    assert per_slice == {"s0": counts[0], "": 80 - counts[0]}
    rows = [r for unit_rows in rows_of(rt, units) for r in unit_rows]
    assert sorted(r.line for r in rows if r.line <= counts[0]) == list(range(1, counts[0] + 1))
    assert Counter(r.custom_id for r in rows) == Counter(x["custom_id"] for x in source)
    assert [u.seq for u in units] == list(range(len(units)))


def test_a_chunked_file_failing_after_its_first_chunk_started_fails_whole(chunked_rt):
    rt = chunked_rt
    tenant, _ = create_tenant(rt.db, "t", now())
    source = [*lines(79), lines(1)[0]]  # the last line repeats the first's custom_id
    batch = upload_and_create(rt, tenant.id, source)
    validate_chunked(rt, batch.id)
    with rt.db.read() as s:
        failed = s.get(Batch, batch.id)
        assert failed.status == BatchStatus.FAILED and failed.request_total == 0
        assert [(e["line"], e["code"]) for e in failed.errors["data"]] == [(80, "duplicate_custom_id")]
    units = units_of(rt, batch.id)
    assert units and {u.status for u in units} == {UnitStatus.SKIPPED}
    assert {slice_of(u) for u in units} == {"s0"}


def test_a_shuffled_chunked_file_of_few_long_prefixes_starts_no_slice(settings):
    rt = Runtime(
        replace(
            settings, unit_size=4, validation_chunk_bytes=40_000, validation_head_rows=HEAD,
            max_file_bytes=1 << 20,
        )
    )  # fmt: skip
    try:
        tenant, _ = create_tenant(rt.db, "t", now())
        batch = upload_and_create(rt, tenant.id, documents(120, 4, shuffled=True))
        counts = validate_chunked(rt, batch.id)
        assert len(counts) >= 3 and counts[0] >= 8  # a first chunk of many rows, others pending
        with rt.db.read() as s:
            assert s.get(Batch, batch.id).status == BatchStatus.IN_PROGRESS
        units = units_of(rt, batch.id)
        assert {slice_of(u) for u in units} == {""} and sum(u.n_requests for u in units) == 120
    finally:
        rt.db.dispose()


def test_a_first_chunk_with_a_blank_line_starts_no_slice(chunked_rt):
    rt = chunked_rt
    tenant, _ = create_tenant(rt.db, "t", now())
    data = jsonl(lines(5)) + b"\n" + jsonl(lines(75, "s"))  # a blank line inside the first chunk
    batch = upload_and_create(rt, tenant.id, data)
    validate_chunked(rt, batch.id)
    with rt.db.read() as s:
        assert s.get(Batch, batch.id).status == BatchStatus.FAILED  # the blank line fails the file
    assert units_of(rt, batch.id) == []
