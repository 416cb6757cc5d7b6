"""A large input validated in chunks gives what one task gives: the same shards byte for byte, the
same units, the same errors with the same line numbers, in order; a chunk validated twice or lost
changes nothing (real database, SQLite and PostgreSQL, object store and the demo model's tokenizer;
the chunk tasks run in-process here, across control processes in test_validation_chunks_live.py)."""

from __future__ import annotations

import base64
import io
import json
import random
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select, update

from api.services.tenants import create_tenant
from storage.broker import VALIDATE_QUEUE
from storage.models import Batch, ValidationChunk, WorkUnit
from storage.objectstore import iter_lines
from storage.runtime import Runtime
from storage.shards import read_rows
from storage.status import ChunkStatus
from tests.conftest import now
from tests.factories import chat_line, jsonl, upload_and_create
from workers import validation, validation_chunks
from workers.batch_input import range_lines
from workers.dispatcher import TickReport, resend_lost_validations

CHUNK = 4096  # bytes a chunk: the files below make 5-20 chunks


def doc_lines(n: int = 120, seed: int = 3) -> list[dict]:
    """Questions about a few shared documents, shuffled: the sort moves rows across chunks."""
    rng = random.Random(seed)
    words = ["alpha", "ledger", "river", "copper", "index", "marble"]
    docs = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(4)]
    lines = [chat_line(f"q{i}", f"{docs[i % 4]}\n\nQuestion {i}?", max_tokens=1 + i % 5) for i in range(n)]
    rng.shuffle(lines)
    return lines


def validate_batch(rt: Runtime, batch_id: str) -> float | None:
    """The validation task's way: chunked past FREIGHT_VALIDATION_CHUNK_BYTES."""
    return validation.validate_batch(rt, batch_id, validation_chunks.validate_in_chunks)


def chunked(settings, chunk_bytes: int = CHUNK, **changes):
    """Chunks past ``chunk_bytes``; no early slice (workers/head_start.py, tested there), so the
    shards are the whole-file sort's, as one task without slices makes them."""
    changes.setdefault("validation_head_rows", 0)
    return Runtime(replace(settings, validation_chunk_bytes=chunk_bytes, unit_size=4, **changes))


def run_chunks(rt: Runtime, batch_id: str) -> int:
    """Every pending chunk validated, as the control processes would; how many there were."""
    with rt.db.read() as s:
        ids = s.scalars(select(ValidationChunk.id).where(ValidationChunk.batch_id == batch_id)).all()
    for chunk_id in ids:
        validation_chunks.validate_chunk(rt, batch_id, chunk_id)
    return len(ids)


def validate_chunked(rt: Runtime, batch_id: str) -> int:
    """Chunks sent, validated, merged: the task sequence of a chunked validation; the chunks."""
    assert validate_batch(rt, batch_id) is None  # makes and sends the chunks
    n = run_chunks(rt, batch_id)
    assert validate_batch(rt, batch_id) is None  # the merge the last chunk sent
    return n


def outcome(rt: Runtime, batch_id: str) -> tuple[Batch, list[tuple], list[bytes]]:
    """The batch, its units (all but ids) and its shard objects' bytes, in order."""
    with rt.db.read() as s:
        batch = s.get(Batch, batch_id)
        units = s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch_id).order_by(WorkUnit.seq)).all()
    plan = [
        (u.seq, u.model, u.shard_key.rsplit("/", 1)[1], u.row_start, u.first_line, u.n_requests,
         u.prefix_key, u.planned_prompt_tokens, u.planned_cached_tokens)
        for u in units
    ]  # fmt: skip
    shards = []
    for key in dict.fromkeys(u.shard_key for u in units):
        with rt.store.open(key) as stream:
            shards.append(stream.read())
    return batch, plan, shards


def both_ways(
    settings, data: bytes, name: str = "in.jsonl", chunk_bytes: int = CHUNK, **changes
) -> tuple[tuple, tuple, int]:
    """The same file validated in one task and in chunks: both outcomes and the chunk count."""
    one = Runtime(replace(settings, validation_chunk_bytes=0, unit_size=4, validation_head_rows=0, **changes))
    many = chunked(settings, chunk_bytes, **changes)
    try:
        tenant, _ = create_tenant(one.db, f"t-{uuid.uuid4().hex[:8]}", now())
        a = upload_and_create(one, tenant.id, data, name=name).id
        b = upload_and_create(many, tenant.id, data, name=name).id
        assert validate_batch(one, a) is None
        n = validate_chunked(many, b)
        return outcome(one, a), outcome(many, b), n
    finally:
        one.db.dispose()
        many.db.dispose()


# -- cutting JSONL into byte ranges --------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"a\nbb\n\nccc\r\n\n\ndddd",
        b"a\nbb\n\nccc\n\n",
        b"\n\nx\n" + b"y" * 50 + b"\nz\n",
        b"one line, no newline",
        b"\n",
    ],
)
def test_byte_ranges_hold_every_line_once(data):
    whole = list(iter_lines(io.BytesIO(data)))
    for size in range(1, len(data) + 2):
        parts = []
        for start in range(0, len(data), size):
            stream = io.BytesIO(data)
            stream.seek(max(start - 1, 0))
            parts.extend(range_lines(stream, start, min(start + size, len(data))))
        assert parts == whole, size


# -- same outcome as one task --------------------------------------------------------------------


@pytest.mark.parametrize("sort_memory_mb", [256, 0])  # 0: every chunk's sort spills
def test_chunks_make_the_same_shards_and_units_as_one_task(settings, sort_memory_mb):
    data = jsonl(doc_lines())
    one, many, n = both_ways(settings, data, max_file_bytes=1 << 20, sort_memory_mb=sort_memory_mb)
    assert n == -(-len(data) // CHUNK) >= 5
    assert one[0].status == many[0].status == "in_progress", (one[0].errors, many[0].errors)
    assert one[0].request_total == many[0].request_total == 120
    assert many[1] == one[1] and len(one[1]) == 30  # the unit plan
    assert many[2] == one[2]  # the shard objects, byte for byte
    assert (many[0].planned_prompt_tokens, many[0].planned_cached_tokens) == (
        one[0].planned_prompt_tokens,
        one[0].planned_cached_tokens,
    )


def bad_file() -> tuple[bytes, dict[str, int]]:
    """Good lines with bad ones spread over the chunks: the lines' numbers, by what they are."""
    lines = [json.dumps(line).encode() for line in doc_lines(150)]
    where = {}
    lines[0] = b"\xef\xbb\xbf" + lines[0]  # a BOM is fine on line 1
    lines[5] = lines[5] + b"\r"  # CRLF is fine
    lines[20] = b"{not json"
    where["not_json"] = 21
    lines[60] = json.dumps(chat_line("q-dup", "first")).encode()
    lines[130] = json.dumps(chat_line("q-dup", "again")).encode()  # chunks apart
    where["duplicate"] = 131
    lines[90] = json.dumps(chat_line("x", model=None)).encode()  # no model: malformed
    where["model"] = 91
    lines[100] = json.dumps(chat_line("y", model="other")).encode()  # unknown: a row, refused alone
    # a blank run across a chunk boundary: one error, at its first line
    text = b"\n".join(lines) + b"\n"
    cut = text.rindex(b"\n", 0, 4 * CHUNK - 1) + 1
    blanks = 4 * CHUNK - cut + 2  # the last two blank lines start in the next chunk
    before = text[:cut].count(b"\n")
    assert 22 < before < 60
    text = text[:cut] + b"\n" * blanks + text[cut:]
    where = {what: line + blanks if line > before else line for what, line in where.items()}
    where["blank"] = before + 1
    return text + b"\n\n", where  # trailing blank lines are fine


@pytest.mark.parametrize("max_listed", [100, 2])
def test_errors_across_chunks_have_the_file_line_numbers_in_order(settings, max_listed):
    data, where = bad_file()
    one, many, n = both_ways(settings, data, max_file_bytes=1 << 20, max_listed_errors=max_listed)
    assert n > 4
    assert one[0].status == many[0].status == "failed"
    assert many[0].errors == one[0].errors  # same codes, messages, lines, cap
    listed = [(e["code"], e["line"]) for e in many[0].errors["data"]]
    expected = [
        ("invalid_json_line", where["not_json"]),
        ("model_not_found", where["model"]),
        ("empty_line", where["blank"]),
        ("duplicate_custom_id", where["duplicate"]),
    ]
    expected.sort(key=lambda e: e[1])
    if max_listed == 2:
        assert listed == [*expected[:2], ("too_many_errors", None)]
        assert many[0].errors["data"][-1]["message"].startswith("4 lines failed validation")
    else:
        assert listed == expected
    assert not many[1] and not many[2]  # no units, no shards


def test_lines_naming_unknown_models_are_refused_alone_across_chunks(settings):
    """Lines naming a model not served here (spread over the chunks, the first before any served
    line) are rows that run as their error, in both ways the same shards; a file of nothing else
    fails as it did, each line listed, capped alike."""
    lines = doc_lines(120)
    for i, model in ((0, "typo"), (47, "lora-nobody"), (95, "typo")):
        lines[i] = chat_line(f"unknown-{i}", "x", model=model)
    one, many, n = both_ways(settings, jsonl(lines), max_file_bytes=1 << 20)
    assert n >= 5
    assert one[0].status == many[0].status == "in_progress", (one[0].errors, many[0].errors)
    assert one[0].request_total == many[0].request_total == 120
    assert many[1] == one[1] and many[2] == one[2]  # the units, the shards byte for byte
    stored = [pq.read_table(io.BytesIO(shard)).to_pylist() for shard in one[2]]
    refused = [r for rows in stored for r in rows if r["custom_id"].startswith("unknown-")]
    assert [r["line"] for r in refused] == [1, 48, 96]  # first: their prompt key is empty
    assert [json.loads(r["body"])["x_freight_refused"]["message"] for r in refused] == [
        "model 'typo' is not served here", "model 'lora-nobody' is not served here",
        "model 'typo' is not served here",
    ]  # fmt: skip
    unknown = [chat_line(f"u{i}", "a question " * 20, model=f"typo-{i % 3}") for i in range(60)]
    one, many, n = both_ways(settings, jsonl(unknown), max_file_bytes=1 << 20, max_listed_errors=7)
    assert n >= 2
    assert one[0].status == many[0].status == "failed"
    assert many[0].errors == one[0].errors
    listed = many[0].errors["data"]
    assert [(e["code"], e["line"]) for e in listed[:-1]] == [("model_not_found", i) for i in range(1, 8)]
    assert listed[-1]["message"].startswith("60 lines failed validation")


def test_file_level_rules_across_chunks(settings):
    """A model differing from the first chunk's, and the request limit, are file-wide."""
    lines = doc_lines(100)
    lines[80] = chat_line("late", "x", model="demo2")
    data = jsonl(lines)
    models = {**settings.models, "demo2": settings.models["demo"]}
    one, many, _ = both_ways(settings, data, max_file_bytes=1 << 20, models=models)
    assert many[0].errors == one[0].errors
    assert [(e["code"], e["line"]) for e in many[0].errors["data"]] == [("mixed_models", 81)]
    one, many, _ = both_ways(
        settings, jsonl(doc_lines(100)), max_file_bytes=1 << 20, max_requests_per_file=70
    )
    assert many[0].errors == one[0].errors
    assert [(e["code"], e["line"]) for e in many[0].errors["data"]] == [("too_many_requests", 71)]


# -- re-delivery and loss ------------------------------------------------------------------------


def test_a_chunk_validated_twice_or_lost_adds_no_row(settings):
    rt = chunked(settings, max_file_bytes=1 << 20)
    try:
        tenant, _ = create_tenant(rt.db, "t", now())
        lines = doc_lines()
        batch_id = upload_and_create(rt, tenant.id, jsonl(lines)).id
        assert validate_batch(rt, batch_id) is None
        assert not tick_resends(rt, batch_id)  # its chunks were just sent
        with rt.db.read() as s:
            chunks = s.scalars(
                select(ValidationChunk)
                .where(ValidationChunk.batch_id == batch_id)
                .order_by(ValidationChunk.seq)
            ).all()
            first, second, *rest = [(c.id, c.seq, c.start, c.stop) for c in chunks]
        # the first chunk twice (an acks_late redelivery): the second delivery finds it done
        assert not validation_chunks.validate_chunk(rt, batch_id, first[0])
        assert not validation_chunks.validate_chunk(rt, batch_id, first[0])
        # a copy that ran late writes the same objects again
        batch = outcome(rt, batch_id)[0]
        validation_chunks.scan_chunk(
            rt, batch_id, first[1], _input_key(rt, batch), batch.endpoint, {}, *first[2:]
        )
        # the second chunk's process died mid-way: its lease runs out, nothing was recorded
        stale = now() - 10 * settings.lease_seconds
        with rt.db.write() as s:
            s.execute(
                update(ValidationChunk)
                .where(ValidationChunk.id == second[0])
                .values(lease_at=stale, sent_at=stale)
            )
        for chunk_id, *_ in rest:
            validation_chunks.validate_chunk(rt, batch_id, chunk_id)
        # the tick sends the batch's validation again only once no pending chunk was sent or held a
        # live lease for a lease; that validation sends the lost chunk again
        assert tick_resends(rt, batch_id)
        assert validate_batch(rt, batch_id) is None
        with rt.db.read() as s:
            row = s.get(ValidationChunk, second[0])
            assert row.status == ChunkStatus.PENDING and row.sent_at > stale
        assert validation_chunks.validate_chunk(rt, batch_id, second[0])  # the last: sends the merge
        assert validate_batch(rt, batch_id) is None
        batch, plan, _ = outcome(rt, batch_id)
        assert batch.status == "in_progress" and batch.request_total == len(lines)
        with rt.db.read() as s:
            units = s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch_id)).all()
        ids = [
            r.custom_id for u in units for r in read_rows(rt.store, u.shard_key, u.row_start, u.n_requests)
        ]
        assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each once
        # the merge runs once: another delivery finds the batch validated
        assert validate_batch(rt, batch_id) is None
        assert outcome(rt, batch_id)[1] == plan
        assert not list(rt.store.list(f"batches/{batch_id}/validation/"))  # the runs are deleted
    finally:
        rt.db.dispose()


def tick_resends(rt: Runtime, batch_id: str) -> bool:
    """Whether the tick sends the batch's validation again, its last delivery due long ago."""
    with rt.db.write() as s:
        s.execute(update(Batch).where(Batch.id == batch_id).values(validation_due_at=now() - 1000))
    report = TickReport()
    resend_lost_validations(rt, time.time(), report)
    return batch_id in report.revalidated


def _input_key(rt: Runtime, batch: Batch) -> str:
    from storage.models import StoredFile

    with rt.db.read() as s:
        return s.get(StoredFile, batch.input_file_id).object_key


# -- Parquet: chunks of row groups ---------------------------------------------------------------


def parquet_of(lines: list[dict], row_group_rows: int = 10) -> bytes:
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "custom_id": [line["custom_id"] for line in lines],
            "body": [json.dumps(line["body"]) for line in lines],
        }
    )
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=row_group_rows)
    return sink.getvalue()


def test_parquet_row_groups_make_the_same_shards_and_errors(settings):
    lines = doc_lines(200)
    data = parquet_of(lines)
    for size in (1024, 3000):  # chunks of about this many stored bytes of row groups
        one, many, n = both_ways(settings, data, "in.parquet", size, max_file_bytes=1 << 20)
        assert n > 2, n
        assert one[0].status == many[0].status == "in_progress", many[0].errors
        assert many[1] == one[1] and many[2] == one[2]
    bad = list(lines)
    bad[15] = {**bad[15], "body": {**bad[15]["body"], "temperature": "hot"}}
    bad[170] = {**bad[170], "custom_id": bad[40]["custom_id"]}
    one, many, n = both_ways(settings, parquet_of(bad), "in.parquet", 1024, max_file_bytes=1 << 20)
    assert n > 2 and one[0].status == many[0].status == "failed"
    assert many[0].errors == one[0].errors
    assert [(e["code"], e["line"]) for e in many[0].errors["data"]] == [
        ("invalid_request", 16),
        ("duplicate_custom_id", 171),
    ]
    assert many[0].errors["data"][0]["message"].startswith("row 16, column 'body'")


# -- the file-wide rules, one pass and chunks alike ----------------------------------------------

FILL = " ".join(["ledger", "river", "copper", "marble"] * 20)  # a line of ~700 bytes: ~6 a chunk


class Lines:
    """A JSONL file built line by line, with the (code, line) of each error it should give."""

    def __init__(self, max_requests: int = 1000, max_listed: int = 100) -> None:
        self.lines: list[bytes] = []
        self.expected: list[tuple[str, int]] = []
        self.max_requests = max_requests  # FREIGHT_MAX_REQUESTS_PER_FILE
        self.max_listed = max_listed  # FREIGHT_MAX_LISTED_ERRORS

    def add(self, *lines: bytes, error: str | None = None) -> None:
        """``lines`` appended; ``error``: the code it gives, at the first of them."""
        if error is not None:
            self.expected.append((error, len(self.lines) + 1))
        self.lines.extend(lines)

    def requests(self, *custom_ids: str, model: str = "demo", error: str | None = None) -> None:
        for custom_id in custom_ids:
            line = chat_line(custom_id, f"{custom_id}: {FILL}", model=model)
            self.add(json.dumps(line).encode(), error=error)

    def data(self) -> bytes:
        return b"\n".join(self.lines) + b"\n"


def blank_runs() -> Lines:
    f = Lines()
    f.add(b"", b"  ", error="empty_line")  # a run opening the file
    f.requests(*(f"a{i}" for i in range(10)))
    f.add(b"\r", error="empty_line")  # one blank line (CRLF)
    f.requests(*(f"b{i}" for i in range(10)))
    f.add(b"", error="empty_line")  # before a bad line: both errors, the run's first
    f.add(b"{not json", error="invalid_json_line")
    f.add(*[b""] * 10_000, error="empty_line")  # a run over two chunks: a chunk of blank lines only
    f.requests(*(f"c{i}" for i in range(10)))
    f.add(b"", b" ")  # trailing blank lines are fine
    return f


def duplicates() -> Lines:
    f = Lines()
    f.requests(*(f"a{i}" for i in range(12)))
    f.requests("a3", error="duplicate_custom_id")  # in the same chunk or the next
    f.requests(*(f"b{i}" for i in range(30)))
    f.requests("a3", "b0", error="duplicate_custom_id")  # chunks apart, the first one twice
    f.requests("late")
    return f


def two_models() -> Lines:
    f = Lines()
    f.requests(*(f"a{i}" for i in range(15)))  # the first line's model is the file's
    f.requests("x1", model="demo2", error="mixed_models")
    f.requests(*(f"b{i}" for i in range(15)))
    f.requests("x2", "x3", model="demo2", error="mixed_models")
    return f


def over_the_limit() -> Lines:
    f = Lines(max_requests=20)
    f.requests(*(f"a{i}" for i in range(5)))
    f.add(b"{not json", error="invalid_json_line")  # not a request: not counted
    f.requests("a1", error="duplicate_custom_id")  # neither
    f.requests(*(f"b{i}" for i in range(15)))  # the 20th request
    f.requests("c0", error="too_many_requests")  # the 21st, a few chunks in: the file's lines end here
    f.add(b"{not json", b"", b"")
    f.requests("a0", "c1")  # past the end: neither a duplicate nor a request
    return f


def over_the_error_cap() -> Lines:
    f = Lines(max_listed=4)  # the first four listed, all counted
    for i in range(12):
        f.requests(f"a{i}")
        for _ in range(6):  # dozens in each chunk, which keeps its first four
            f.add(b"[1, 2]", error="invalid_json_line")
    f.add(b"", error="empty_line")
    f.requests("a0", error="duplicate_custom_id")
    f.requests("x", model="demo2", error="mixed_models")
    return f


def empty() -> Lines:
    f = Lines()
    f.add(*[b""] * 10_000, b" \r")  # blank lines only, over several chunks
    f.expected.append(("empty_file", len(f.lines)))  # the last line
    return f


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    "build", [blank_runs, duplicates, two_models, over_the_limit, over_the_error_cap, empty]
)
def test_file_wide_rules_give_the_same_errors_in_one_pass_and_in_chunks(settings, build):
    f = build()
    models = {**settings.models, "demo2": settings.models["demo"]}
    one, many, n = both_ways(
        settings, f.data(), max_file_bytes=1 << 20, max_listed_errors=f.max_listed,
        max_requests_per_file=f.max_requests, models=models,
    )  # fmt: skip
    assert n >= 3, n
    assert one[0].status == many[0].status == "failed"
    assert many[0].errors == one[0].errors  # codes, messages, lines, params, the cap's count
    expected = sorted(f.expected, key=lambda e: e[1])
    listed = [(e["code"], e["line"]) for e in many[0].errors["data"]]
    if len(expected) > f.max_listed:
        assert listed == [*expected[: f.max_listed], ("too_many_errors", None)]
        assert many[0].errors["data"][-1]["message"].startswith(f"{len(expected)} lines failed validation")
    else:
        assert listed == expected
    assert not many[1] and not many[2]  # no units, no shards


# -- the window of chunks in flight --------------------------------------------------------------


def queued(rt: Runtime) -> list[tuple[str, list]]:
    """The validation queue's messages, first out first: (task, its arguments)."""
    with rt.queue.celery.connection_for_write() as conn:
        raw = conn.default_channel.client.lrange(VALIDATE_QUEUE, 0, -1)
    out = []
    for message in map(json.loads, reversed(raw)):  # LPUSHed, taken from the right
        assert message["properties"]["body_encoding"] == "base64"
        args = json.loads(base64.b64decode(message["body"]))[0]
        out.append((message["headers"]["task"], args))
    return out


def flush(rt: Runtime) -> None:
    """Empty the test's own broker database: messages sent so far run here, in-process, instead."""
    with rt.queue.celery.connection_for_write() as conn:
        conn.default_channel.client.flushdb()


@contextmanager
def window_of_two(settings, redis_service, db: int) -> Iterator[Runtime]:
    """A runtime that validates in chunks, two in flight per tenant, on a broker database of the
    test's own (``db``), emptied."""
    broker = redis_service.url.rsplit("/", 1)[0] + f"/{db}"
    rt = chunked(settings, max_file_bytes=1 << 20, validation_chunks_in_flight=2, broker_url=broker)
    try:
        flush(rt)
        yield rt
    finally:
        rt.db.dispose()


def chunks_sent(rt: Runtime, batch_id: str) -> int:
    with rt.db.read() as s:
        return (
            s.scalar(
                select(func.count())
                .select_from(ValidationChunk)
                .where(ValidationChunk.batch_id == batch_id, ValidationChunk.sent_at.is_not(None))
            )
            or 0
        )


def two_large_batches(rt: Runtime) -> tuple[str, str, str]:
    """One tenant's two chunked batches, both validated once (their chunks made; the window sent
    what it had room for): (tenant id, first, second)."""
    tenant, _ = create_tenant(rt.db, "t", now())
    first = upload_and_create(rt, tenant.id, jsonl(doc_lines())).id
    second = upload_and_create(rt, tenant.id, jsonl(doc_lines(seed=4)), name="second.jsonl").id
    flush(rt)  # their creations' messages: run here instead
    assert validate_batch(rt, first) is None
    assert validate_batch(rt, second) is None
    return tenant.id, first, second


def test_a_batch_keeps_its_window_of_chunks_in_flight_and_others_queue_between(settings, redis_service):
    """FREIGHT_VALIDATION_CHUNKS_IN_FLIGHT=2: the chunked validation sends two chunks; each one done
    sends the next, behind another tenant's validation that queued meanwhile; a window left short
    (a process died between its commit and the send) is topped up by the batch's next validation,
    which the tick sends; the result is the one-task result all the same."""
    with window_of_two(settings, redis_service, 10) as rt:
        broker = rt.settings.broker_url
        tenant, _ = create_tenant(rt.db, "t", now())
        other, _ = create_tenant(rt.db, "u", now())
        lines = doc_lines()
        batch_id = upload_and_create(rt, tenant.id, jsonl(lines)).id
        flush(rt)  # its creation's message: run here instead
        assert validate_batch(rt, batch_id) is None
        with rt.db.read() as s:
            chunks = s.execute(
                select(ValidationChunk.id, ValidationChunk.sent_at)
                .where(ValidationChunk.batch_id == batch_id)
                .order_by(ValidationChunk.seq)
            ).all()
        ids = [c.id for c in chunks]
        assert len(ids) >= 5
        assert [c.sent_at is not None for c in chunks] == [True, True] + [False] * (len(ids) - 2)
        assert queued(rt) == [("freight.validate_chunk", [batch_id, i]) for i in ids[:2]]

        # another tenant's batch queues its validation; the first chunk done sends the third after it
        small = upload_and_create(rt, other.id, jsonl(doc_lines(10, seed=5)), name="small.jsonl").id
        assert not validation_chunks.validate_chunk(rt, batch_id, ids[0])
        # (the messages stay queued: the chunks run here, in-process)
        assert [args for _, args in queued(rt)] == [
            [batch_id, ids[0]],
            [batch_id, ids[1]],
            [small],
            [batch_id, ids[2]],
        ]

        # the second chunk's process dies after its commit, before it sends the fourth, and the
        # third's message is lost: the tick sends the batch's validation, which sends both
        assert not validation_chunks.validate_chunk(rt, batch_id, ids[1])
        flush(rt)
        stale = now() - 10 * settings.lease_seconds
        with rt.db.write() as s:
            s.execute(update(ValidationChunk).where(ValidationChunk.id == ids[3]).values(sent_at=None))
            s.execute(update(ValidationChunk).where(ValidationChunk.id == ids[2]).values(sent_at=stale))
        assert tick_resends(rt, batch_id)
        assert validate_batch(rt, batch_id) is None
        assert sorted(args[1] for task, args in queued(rt) if task == "freight.validate_chunk") == [
            ids[2],
            ids[3],
        ]

        run_chunks(rt, batch_id)
        assert validate_batch(rt, batch_id) is None  # the merge
        batch, plan, shards = outcome(rt, batch_id)
        assert batch.status == "in_progress" and batch.request_total == len(lines)
        reference = Runtime(replace(settings, validation_chunk_bytes=0, unit_size=4, broker_url=broker))
        try:
            one = upload_and_create(reference, tenant.id, jsonl(lines), name="one.jsonl").id
            validation.validate_batch(reference, one)
            assert outcome(reference, one)[1:] == (plan, shards)
        finally:
            reference.db.dispose()


def test_a_tenants_batches_share_its_window(settings, redis_service):
    """FREIGHT_VALIDATION_CHUNKS_IN_FLIGHT=2 holds for all of a tenant's batches together: a second
    large batch sends nothing while the first holds both slots, then takes each slot that comes
    free while it has fewer in flight; both end as one task would validate them."""
    with window_of_two(settings, redis_service, 11) as rt:
        _, first, second = two_large_batches(rt)

        def chunk_ids(batch_id: str) -> list[int]:
            with rt.db.read() as s:
                return list(
                    s.scalars(
                        select(ValidationChunk.id)
                        .where(ValidationChunk.batch_id == batch_id)
                        .order_by(ValidationChunk.seq)
                    )
                )

        a, b = chunk_ids(first), chunk_ids(second)
        assert len(a) >= 3 and len(b) >= 3
        sent = [tuple(args) for task, args in queued(rt) if task == "freight.validate_chunk"]
        assert sent == [(first, a[0]), (first, a[1])]

        validation_chunks.validate_chunk(rt, first, a[0])  # its slot: to the batch holding none
        validation_chunks.validate_chunk(rt, first, a[1])  # now the first holds none: back to it
        sent = [tuple(args) for task, args in queued(rt) if task == "freight.validate_chunk"]
        assert sent == [(first, a[0]), (first, a[1]), (second, b[0]), (first, a[2])]

        for batch_id in (first, second):
            run_chunks(rt, batch_id)
        for batch_id, lines in ((first, doc_lines()), (second, doc_lines(seed=4))):
            assert validate_batch(rt, batch_id) is None  # the merge
            batch, plan, _ = outcome(rt, batch_id)
            assert batch.status == "in_progress" and batch.request_total == len(lines) and plan


def test_a_cancelled_batch_frees_its_tenants_window(settings, redis_service):
    """A cancelled batch's chunks end without sending anyone's next one; the tenant's other batch,
    all of its chunks waiting for room, is nudged by the tick's lost-validation check a lease
    later, and its validation fills the window the cancel freed."""
    from api.services.batches import cancel

    with window_of_two(settings, redis_service, 12) as rt:
        tenant_id, first, second = two_large_batches(rt)
        assert chunks_sent(rt, second) == 0  # the first holds both slots

        cancel(rt, tenant_id, first)
        assert tick_resends(rt, second)  # nothing of it active for a lease: nudged
        assert validate_batch(rt, second) is None
        assert chunks_sent(rt, second) == 2  # the cancelled batch's slots, both


def test_an_adapter_of_another_base_is_refused_alone_across_chunks(settings):
    """A line naming an adapter of another served base than the file's model (the first line's)
    is refused alone (``adapter_base_mismatch``), though its chunk cannot know the file's model
    and renders it: the merge puts its refused row in place of the rendered one, so both ways
    give the same shards and units byte for byte; the adapters of the file's base run as rows."""
    from storage.models import Adapter

    models = {**settings.models, "demo2": settings.models["demo"]}
    rt = Runtime(replace(settings, models=models))
    with rt.db.write() as s:
        for name, base in (("demo-a", "demo"), ("demo2-a", "demo2")):
            s.add(Adapter(name=name, base=base, path="/srv/a", rank=8, target_modules=["q_proj"],
                          tenants=None, created_at=now()))  # fmt: skip
    rt.db.dispose()
    lines = doc_lines(120)
    for i, model in ((30, "demo2-a"), (31, "demo-a"), (100, "demo2-a")):
        lines[i] = chat_line(f"adapter-{i}", f"x{i}", model=model)
    one, many, n = both_ways(settings, jsonl(lines), max_file_bytes=1 << 20, models=models)
    assert n >= 5
    assert one[0].status == many[0].status == "in_progress", (one[0].errors, many[0].errors)
    assert one[0].request_total == many[0].request_total == 120
    assert many[1] == one[1] and many[2] == one[2]  # the units, the shards byte for byte
    stored = [r for shard in one[2] for r in pq.read_table(io.BytesIO(shard)).to_pylist()]
    refused = [r for r in stored if "x_freight_refused" in r["body"]]
    assert [r["line"] for r in refused] == [31, 101]
    errors = [json.loads(r["body"])["x_freight_refused"] for r in refused]
    assert {(e["code"], e["param"]) for e in errors} == {("adapter_base_mismatch", "model")}
    assert errors[0]["message"].startswith("model 'demo2-a' is a LoRA adapter of 'demo2', not of 'demo'")
    ran = next(r for r in stored if r["custom_id"] == "adapter-31")
    assert json.loads(ran["body"])["model"] == "demo-a"  # the file's base's adapter: a row that runs
