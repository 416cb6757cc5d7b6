"""Validation of one large batch input in chunks, in parallel across control processes.

Why: validation costs about 0.5-1 ms of CPU a line, so a million-line batch spent ten minutes in
one process. An input larger than FREIGHT_VALIDATION_CHUNK_BYTES is cut into chunks (JSONL: byte
ranges, a line belonging to the chunk it starts in, so no pre-pass reads the file; Parquet: runs of
row groups), each validated by a task of its own on the freight.validate queue, which any process
of any control worker takes. A chunk checks its lines with the one-task validation's own
``check_line`` and writes two objects: the sorted run of its valid rows (the one-task sort's
records) and one event per line (blank, bad, valid with its model and custom_id, or refused with
its custom_id: a line naming a model not served here, ``validation.RefusedLine``, whose row is in
the run); its row keeps its line count, its first errors and its refused lines' first errors.
Lines are numbered within the chunk; the merge adds the lines of the chunks before, so no chunk
needs to know where it starts.

The chunk that finds itself the last one done (the batch row locked, its move pending -> done a
compare-and-set, the others counted) sends the batch's validation again; under the batch's
validation lease that validation merges, once: it replays the events in file order through the
file-level rules ``scan_lines`` applies, the same ``validation.FileChecks`` (unique custom_ids
across all chunks, one model, the request limit, blank lines inside the file, the error cap), and
when no line failed merges the runs by (prompt key, line) into the shards the one-task validation
would write, byte for byte (``validation.write_shards``), then plans and commits as it does
(``validation.conclude``). A line naming a LoRA adapter of another base than the file's model is
refused by a file rule only the merge can apply (a chunk does not know the file's model, and
renders it): its event names the adapter, and the merge puts its refused row in place of the
rendered one (``_Diverted``).

Crash safety: a chunk's objects depend only on the file and the chunk's bounds and are written
under fixed keys, so a chunk validated twice (an acks_late redelivery, a lease taken over) writes
the same bytes again and only one run moves it to ``done``; the merge reads done chunks only. A
chunk whose process died leaves its lease to run out; the tick sends the batch's validation again a
lease after it was last due (``dispatcher.resend_lost_validations``: while chunks run the batch's
own lease is free), and that validation sends every chunk whose lease ran out a lease after it was
sent. The merge commits only from ``validating``, like the one-task validation.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any, cast

from sqlalchemy import CursorResult, func, select, update
from sqlalchemy.orm import Session

from scheduler.chunk_window import share_slots
from scheduler.ordering import Record, dump_records, load_records, sort_records
from storage.leases import VALIDATION_CHUNK_LEASE
from storage.models import Batch, StoredFile, Tenant, ValidationChunk
from storage.request_tables import RowError, decode_limits, is_parquet, metadata_defaults, row_group_runs
from storage.runtime import Runtime
from storage.settings import Settings
from storage.status import BatchStatus, ChunkStatus, chunk_source
from workers.batch_input import head_bytes, local_copy, open_chunk
from workers.head_start import sliced, slices_pay, start_slice
from workers.prompt_tokens import TokenizerUnavailable
from workers.render_blocks import RenderBlock
from workers.validation import (
    FileChecks,
    LineError,
    RefusedLine,
    ScanResult,
    SkippedLine,
    _LeaseKeeper,
    _payload,
    batch_rules,
    check_fields,
    conclude,
    line_content,
    line_error,
    name_columns,
    spill_dir,
    tokenizer_failure,
    write_shards,
    write_store,
)

log = logging.getLogger(__name__)

# one event per line: kind, model index, custom_id length; then the custom_id's UTF-8 bytes
EVENT = struct.Struct(">BHH")
# BAD_ROW: a Parquet row that made no line; REFUSED: a ``RefusedLine`` (its row in the run);
# SKIPPED: a ``SkippedLine``, settled by the batch a resume resumes (no row)
BLANK, BAD_ROW, BAD_LINE, VALID, REFUSED, SKIPPED = range(6)
# a Parquet row error after which the file's rows end (request_tables._limited_lines)
ENDS_ROWS = frozenset({"too_many_requests", "file_too_large"})


def _objects(batch_id: str, seq: int) -> tuple[str, str]:
    """A chunk's sorted run and its events, under fixed keys: a re-run writes the same again."""
    prefix = f"batches/{batch_id}/validation/{seq:05d}"
    return f"{prefix}.run", f"{prefix}.events"


# -- sending the chunks (under the batch's validation lease) -------------------------------------


def plan_chunks(rt: Runtime, input_key: str, endpoint: str) -> list[tuple[int, int]]:
    """The chunks of an input larger than FREIGHT_VALIDATION_CHUNK_BYTES, in file order (JSONL:
    byte ranges; Parquet: row-group ranges); none for a smaller one (validated in one task)."""
    settings: Settings = rt.settings
    target = settings.validation_chunk_bytes
    size = rt.store.size(input_key) if target else 0
    if size <= target:
        return []
    if is_parquet(head_bytes(rt.store, input_key)):
        with local_copy(rt.store, input_key, spill_dir(settings)) as path:
            return row_group_runs(path, endpoint, decode_limits(settings), target) or []
    return [(start, min(start + target, size)) for start in range(0, size, target)]


def validate_in_chunks(rt: Runtime, batch_id: str, input_key: str, endpoint: str, defaults: dict) -> bool:
    """The batch's validation, holding its lease, for a chunked input: the first time, make and
    send the chunks; while some are not done, send again those that were lost; once all are done,
    merge. False (nothing done) for an input validated in one task: one no larger than a chunk
    is told by its size alone (no query: most batches are small)."""
    target = rt.settings.validation_chunk_bytes
    if not target or rt.store.size(input_key) <= target:
        return False  # (a chunk size raised since the chunks were made: one task, as exact)
    now = time.time()
    with rt.db.read() as s:
        chunks = s.execute(
            select(ValidationChunk.seq, ValidationChunk.status)
            .where(ValidationChunk.batch_id == batch_id)
            .order_by(ValidationChunk.seq)
        ).all()
    if not chunks:
        bounds = plan_chunks(rt, input_key, endpoint)
        if not bounds:
            return False
        with rt.db.write() as s:  # only the lease's holder gets here: the rows are made once
            s.add_all(
                ValidationChunk(
                    batch_id=batch_id, seq=seq, start=start, stop=stop, status=ChunkStatus.PENDING
                )
                for seq, (start, stop) in enumerate(bounds)
            )
            # the tick sends this validation again a lease from now: it checks on the chunks then
            s.execute(update(Batch).where(Batch.id == batch_id).values(validation_due_at=now))
            s.flush()
            tenant_id = s.scalar(select(Batch.tenant_id).where(Batch.id == batch_id))
            sent = _mark_next_sent(s, rt.settings, str(tenant_id), now)
        _send(rt, sent)  # after the commit that made and marked them; the rest as chunks end
        log.info(
            "batch %s: validating in %d chunks, %d sent now (%d of its tenant's at a time)",
            batch_id,
            len(bounds),
            sum(1 for b, _ in sent if b == batch_id),
            rt.settings.validation_chunks_in_flight,
        )
        return True
    if any(status != ChunkStatus.DONE for _, status in chunks):
        resend_lost_chunks(rt, batch_id, now)
        return True
    merge(rt, batch_id, input_key, endpoint, defaults)
    return True


def resend_lost_chunks(rt: Runtime, batch_id: str, now: float) -> list[int]:
    """Send again each pending chunk that no validation holds a live lease of and that was sent
    more than a lease ago (its message lost, or its process killed), then top the batch's window
    up (a chunk's process that died between its commit and sending the next left it short); a
    copy that meets a running or done chunk does nothing. The ids sent again."""
    lease = rt.settings.lease_seconds
    with rt.db.write() as s:
        lost = list(
            s.scalars(
                select(ValidationChunk.id).where(
                    ValidationChunk.batch_id == batch_id,
                    ValidationChunk.status == ChunkStatus.PENDING,
                    ValidationChunk.sent_at.is_not(None),  # unsent: waiting for the window
                    VALIDATION_CHUNK_LEASE.free(now, lease),
                    ValidationChunk.sent_at < now - lease,
                )
            )
        )
        if lost:
            s.execute(update(ValidationChunk).where(ValidationChunk.id.in_(lost)).values(sent_at=now))
        s.execute(update(Batch).where(Batch.id == batch_id).values(validation_due_at=now))
    for chunk_id in lost:
        log.warning(
            "batch %s: chunk %d of its validation was lost; sending it again",
            batch_id,
            chunk_id,
            extra={"batch_id": batch_id},
        )
        rt.queue.validate_chunk(batch_id, chunk_id)
    send_next_chunks(rt, batch_id, now)
    return lost


def send_next_chunks(rt: Runtime, batch_id: str, now: float) -> list[tuple[str, int]]:
    """Fill the window of the batch's tenant: its validating batches' next unsent chunks, in file
    order, until FREIGHT_VALIDATION_CHUNKS_IN_FLIGHT of their pending chunks are sent (the tick's
    top-up, for a window a dead process left short). A chunk sent as another ends joins the queue
    behind other tenants' validations, so one tenant's huge inputs take turns instead of filling
    the queue. The (batch, chunk) ids sent."""
    with rt.db.write() as s:
        batch = s.get(Batch, batch_id, with_for_update=True)
        if batch is None or batch.status != BatchStatus.VALIDATING:
            return []
        sent = _mark_next_sent(s, rt.settings, batch.tenant_id, now)
    _send(rt, sent)
    return sent


def _mark_next_sent(s: Session, settings: Settings, tenant_id: str, now: float) -> list[tuple[str, int]]:
    """Mark the next unsent chunks of the tenant's validating batches sent, filling the tenant's
    window, each slot to its batch with the fewest in flight (``scheduler.chunk_window``). Locks
    the tenant's row, after whatever batch row the caller holds (the order ``validate_batch``'s
    tenant check takes them in), so two chunks ending together never both fill the same room;
    the caller sends the chunks after its commit (``_send``)."""
    s.get(Tenant, tenant_id, with_for_update=True)
    counts = s.execute(
        select(ValidationChunk.batch_id, func.count(ValidationChunk.sent_at), func.count())
        .join(Batch, Batch.id == ValidationChunk.batch_id)
        .where(
            Batch.tenant_id == tenant_id,
            Batch.status == BatchStatus.VALIDATING,
            ValidationChunk.status == ChunkStatus.PENDING,
        )
        .group_by(ValidationChunk.batch_id, Batch.created_at)
        .order_by(Batch.created_at, ValidationChunk.batch_id)
    ).all()
    room = settings.validation_chunks_in_flight - sum(int(sent) for _, sent, _ in counts)
    shares = share_slots(room, [(b, int(sent), int(total) - int(sent)) for b, sent, total in counts])
    picked: list[tuple[str, int]] = []
    for batch_id, n in shares.items():
        ids = s.scalars(
            select(ValidationChunk.id)
            .where(
                ValidationChunk.batch_id == batch_id,
                ValidationChunk.status == ChunkStatus.PENDING,
                ValidationChunk.sent_at.is_(None),
            )
            .order_by(ValidationChunk.seq)
            .limit(n)
        )
        picked += [(batch_id, chunk_id) for chunk_id in ids]
    if picked:
        chosen = [chunk_id for _, chunk_id in picked]
        s.execute(update(ValidationChunk).where(ValidationChunk.id.in_(chosen)).values(sent_at=now))
    return picked


def _send(rt: Runtime, chunks: list[tuple[str, int]]) -> None:
    for batch_id, chunk_id in chunks:
        rt.queue.validate_chunk(batch_id, chunk_id)


# -- one chunk (the freight.validate_chunk task) -------------------------------------------------


def validate_chunk(rt: Runtime, batch_id: str, chunk_id: int) -> bool:
    """Validate one chunk under its lease and record it done; True if it was the last of its
    batch's chunks to be done (then the batch's validation is sent, to merge). A chunk done
    already, or under another live lease, or of a batch no longer validating, is left alone."""
    settings: Settings = rt.settings
    now = time.time()
    with rt.db.write() as s:
        batch = s.get(Batch, batch_id)
        if batch is None or batch.status != BatchStatus.VALIDATING:
            return False
        pending = ValidationChunk.status == ChunkStatus.PENDING
        taken = VALIDATION_CHUNK_LEASE.take(s, chunk_id, now, pending, now=now,
                                            lease_seconds=settings.lease_seconds)  # fmt: skip
        if not taken:
            return False
        chunk = s.get(ValidationChunk, chunk_id)
        assert chunk is not None
        seq, start, stop = chunk.seq, chunk.start, chunk.stop
        input_key = s.get(StoredFile, batch.input_file_id).object_key  # type: ignore[union-attr]
        endpoint, defaults = batch.endpoint, metadata_defaults(batch.metadata_)
    with _LeaseKeeper(rt, batch_id, now, VALIDATION_CHUNK_LEASE, chunk_id):
        lines, summary = scan_chunk(rt, batch_id, seq, input_key, endpoint, defaults, start, stop)
        with rt.db.write() as s:
            batch = s.get(Batch, batch_id, with_for_update=True)  # chunks finishing together count in turn
            moved = cast(CursorResult[Any], s.execute(
                update(ValidationChunk)
                .where(ValidationChunk.id == chunk_id, ValidationChunk.status == chunk_source(ChunkStatus.DONE))
                .values(status=ChunkStatus.DONE, lines=lines, summary=summary)
            )).rowcount  # fmt: skip
            left = s.scalar(
                select(func.count())
                .select_from(ValidationChunk)
                .where(ValidationChunk.batch_id == batch_id, ValidationChunk.status != ChunkStatus.DONE)
            )
            # its place in the tenant's window, in the same transaction: the next chunk of whichever
            # of the tenant's batches has the fewest in flight (this one's, when it is alone)
            following = _mark_next_sent(s, settings, batch.tenant_id, time.time()) if batch and moved else []
    last = bool(moved) and not left
    if moved and seq == 0 and not last and settings.validation_head_rows:
        first_chunk_slice(rt, batch_id, lines, summary)
    if last:
        rt.queue.validate(batch_id)  # after the commit: the merge finds every chunk done
    _send(rt, following)  # after the commit that marked them sent
    return last


def scan_chunk(
    rt: Runtime, batch_id: str, seq: int, input_key: str, endpoint: str, defaults: dict, start: int, stop: int
) -> tuple[int, dict[str, Any]]:
    """Check the chunk's lines and write its run and events; its line count and summary (the
    models its valid lines name, its first errors and its count of bad lines, its refused lines'
    first errors, Parquet columns and decoded bytes, or the fatal error that fails the whole file)."""
    settings: Settings = rt.settings
    spill = spill_dir(settings)
    rules = batch_rules(rt, endpoint, batch_id)
    max_listed = settings.max_listed_errors
    models: dict[tuple[str, str | None], int] = {}  # (model, the adapter named; None: the model)
    errors: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []  # the errors of the all-refused file (FileChecks.refuse)
    summary: dict[str, Any] = {
        "models": [],
        "errors": errors,
        "bad": 0,
        "refused": refused,
        "rows": 0,
        "blank": 0,
    }
    run_key, events_key = _objects(batch_id, seq)
    lines = 0
    with contextlib.ExitStack() as stack:
        source, parquet = stack.enter_context(
            open_chunk(rt.store, input_key, endpoint, defaults, spill, decode_limits(settings), start, stop)
        )
        first_row = parquet.first_row if parquet else 0
        events = stack.enter_context(tempfile.TemporaryFile(dir=spill, buffering=1 << 16))
        run = stack.enter_context(tempfile.TemporaryFile(dir=spill, buffering=1 << 16))

        def bad(kind: int, error: LineError) -> None:
            events.write(EVENT.pack(kind, 0, 0))
            summary["bad"] += 1
            if len(errors) < max_listed:
                errors.append({"line": error.line, "code": error.code, "message": error.message,
                               "param": error.param})  # fmt: skip

        def records() -> Iterator[Record]:
            nonlocal lines
            block = RenderBlock(rules.endpoint, rules.render, rules.render_many)
            for pos, raw in enumerate(source.lines, start=1):
                lines = pos
                summary["stopped"] = isinstance(raw, RowError) and raw.code in ENDS_ROWS
                if isinstance(raw, RowError):  # numbered in the whole file: made the chunk's
                    error = line_error(raw)
                    bad(BAD_ROW, LineError(error.line - first_row, error.code, error.message, error.param))
                    continue
                raw = line_content(raw, start == 0 and pos == 1)
                if not raw.strip():
                    events.write(EVENT.pack(BLANK, 0, 0))
                    summary["blank"] += 1
                    continue
                checked = check_fields(raw, pos, rules)
                if isinstance(checked, LineError):
                    bad(BAD_LINE, checked)
                    continue
                if isinstance(checked, RefusedLine | SkippedLine):  # the file's rules decide
                    yield from _unrendered(checked, events, refused, max_listed)
                    continue
                custom_id = checked.custom_id.encode()
                named = checked.body.get("model")  # None: a body a media refusal cleared
                adapter = None if named == checked.model else named
                model = models.setdefault((checked.model, adapter), len(models))
                events.write(EVENT.pack(VALID, model, len(custom_id)))
                events.write(custom_id)
                summary["rows"] += 1
                for row in block.add(checked):
                    yield row.key, row.line, _payload(row)
            for row in block.flush():
                yield row.key, row.line, _payload(row)

        try:
            ordered = sort_records(
                records(), memory_bytes=settings.sort_memory_mb * 1024 * 1024, spill_dir=spill
            )
            try:
                dump_records(ordered, run)
            finally:
                ordered.close()
        except TokenizerUnavailable as exc:  # fails the file as a whole, as in one task
            return 0, {"fatal": str(exc)}
        summary["models"] = [base for base, _ in models]
        summary["named"] = [adapter for _, adapter in models]  # the adapter each one names, or None
        summary["parquet"] = source.parquet
        summary["columns"] = list(source.columns)
        if parquet is not None:
            summary["decoded"] = parquet.decoded
        for stream, key in ((run, run_key), (events, events_key)):
            stream.flush()
            stream.seek(0)
            rt.store.put_stream(key, stream)
    return lines, summary


def first_chunk_slice(rt: Runtime, batch_id: str, lines: int, summary: dict[str, Any]) -> bool:
    """The file's first chunk (``lines`` of it), done while another is pending, runs as the
    batch's early slice (``workers.head_start``) if it is clean: no bad, blank or refused line, not
    stopped early, its valid lines of one served model (so no adapter of another base, which only
    the merge can refuse); and if a boundary after it costs the prefix cache little
    (``slices_pay``, reading its sorted run once more). Its sorted run is the slice, written as
    shards ``s0-*``; the merge leaves the run out and concludes with the rest. True if the slice
    was committed."""
    models = set(summary.get("models", []))
    if summary.get("fatal") or summary.get("bad") or summary.get("refused") or summary.get("blank"):
        return False
    if summary.get("stopped") or len(models) != 1 or not summary.get("rows"):
        return False
    model = models.pop()
    with _local(rt, _objects(batch_id, 0)[0], spill_dir(rt.settings)) as run:
        if not slices_pay(rt, batch_id, model, load_records(run), lines // 2):
            return False
        run.seek(0)
        keys = write_shards(rt, batch_id, load_records(run), "s0-")
    started = start_slice(rt, batch_id, model, keys, 0, summary["rows"], chunks_pending=True)
    if started:
        log.info("batch %s: its first chunk started as a slice, %d rows", batch_id, summary["rows"])
    return started


def _unrendered(
    checked: RefusedLine | SkippedLine, events: IO[bytes], refused: list[dict[str, Any]], max_listed: int
) -> Iterator[Record]:
    """A line the chunk does not render: its event, and a ``RefusedLine``'s row (whether the file
    keeps it is the merge's ``FileChecks`` to say) with its error among the chunk's first ones."""
    custom_id = checked.custom_id.encode()
    if isinstance(checked, SkippedLine):  # settled by the batch a resume resumes: no row
        events.write(EVENT.pack(SKIPPED, 0, len(custom_id)))
        events.write(custom_id)
        return
    events.write(EVENT.pack(REFUSED, 0, len(custom_id)))
    events.write(custom_id)
    if len(refused) < max_listed:
        e = checked.error
        refused.append({"line": e.line, "code": e.code, "message": e.message, "param": e.param})
    row = checked.row()
    yield row.key, row.line, _payload(row)


# -- the merge (the batch's validation, under its lease, once every chunk is done) ---------------


@dataclass(frozen=True)
class _Done:
    seq: int
    lines: int
    summary: dict[str, Any]


def merge(rt: Runtime, batch_id: str, input_key: str, endpoint: str, defaults: dict) -> None:
    settings: Settings = rt.settings
    started = time.monotonic()
    with rt.db.read() as s:
        chunks = [
            _Done(seq, lines, summary or {})
            for seq, lines, summary in s.execute(
                select(ValidationChunk.seq, ValidationChunk.lines, ValidationChunk.summary)
                .where(ValidationChunk.batch_id == batch_id)
                .order_by(ValidationChunk.seq)
            )
        ]
        first = sliced(s, batch_id).rows  # the first chunk's, if it started as a slice
    fatal = next((c.summary["fatal"] for c in chunks if "fatal" in c.summary), None)
    shard_keys: list[str] = []
    sliced_rows = 0
    if fatal is not None:
        summary = tokenizer_failure(batch_id, fatal)
    elif sum(c.summary.get("decoded", 0) for c in chunks) > decode_limits(settings).max_total_bytes:
        # past the decoded limit of a Parquet file, where the file stops being read depends on
        # the bytes of every chunk before: the one-task validation says it exactly
        log.info("batch %s: past the decoded limit; validated again in one task", batch_id)
        rules = batch_rules(rt, endpoint, batch_id)
        summary, shard_keys, sliced_rows = write_store(rt, batch_id, input_key, rules, defaults)
    else:
        with _Diverted(sum(c.lines for c in chunks), spill_dir(settings)) as diverted:
            summary = replay(rt, batch_id, chunks, diverted)
            if chunks and chunks[0].summary.get("parquet"):  # errors name the row and the column
                summary.errors = name_columns(summary.errors, tuple(chunks[0].summary["columns"]))
            if not summary.error_count:
                shard_keys = merge_runs(rt, batch_id, chunks, diverted, skip_first=bool(first))
                sliced_rows = first
    conclude(rt, batch_id, summary, shard_keys, started, sliced_rows)
    for chunk in chunks:  # what a merge interrupted here leaves, the batch's retention deletes
        for key in _objects(batch_id, chunk.seq):
            try:
                rt.store.delete(key)
            except Exception as exc:
                log.warning("batch %s: could not delete %s: %s", batch_id, key, exc)


def _events(stream: IO[bytes]) -> Iterator[tuple[int, int, bytes]]:
    read, size, unpack = stream.read, EVENT.size, EVENT.unpack
    while head := read(size):
        kind, model, n = unpack(head)
        yield kind, model, read(n) if n else b""


class _Diverted:
    """The lines a chunk rendered as rows that the file's rules made refused lines instead (an
    adapter of another base than the file's model, known only once the chunks before are read):
    a bit per line of the file, and their refused rows' records in line order in a spilled run,
    which ``merge_runs`` merges in place of the chunks' rows (as ``scan_lines`` yields them)."""

    def __init__(self, lines: int, spill: str) -> None:
        self.lines = bytearray(lines // 8 + 1)  # bit n: line n's row is diverted
        self.count = 0
        self.run = tempfile.TemporaryFile(dir=spill, buffering=1 << 16)  # noqa: SIM115 (closed on exit)

    def __enter__(self) -> _Diverted:
        return self

    def __exit__(self, *exc: object) -> None:
        self.run.close()

    def add(self, line_no: int, custom_id: bytes, error: LineError) -> None:
        self.lines[line_no >> 3] |= 1 << (line_no & 7)
        self.count += 1
        row = RefusedLine(line_no, custom_id.decode(), error).row()
        dump_records([(row.key, row.line, _payload(row))], self.run)

    def holds(self, line_no: int) -> bool:
        return bool(self.lines[line_no >> 3] & (1 << (line_no & 7)))

    def records(self) -> Iterator[Record]:
        self.run.flush()
        self.run.seek(0)
        return load_records(self.run)


def replay(rt: Runtime, batch_id: str, chunks: list[_Done], diverted: _Diverted | None = None) -> ScanResult:
    """The file-level rules over every chunk's events in file order: the ``FileChecks`` that
    ``scan_lines`` drives, given the same lines with the same numbers, the per-line checks' outcome
    read, not redone. A valid line that the file's rules make a refused line goes to ``diverted``."""
    settings: Settings = rt.settings
    checks = FileChecks(settings.max_requests_per_file, settings.max_listed_errors)
    line_no = offset = 0
    for chunk in chunks:
        listed = [LineError(e["line"] + offset, e["code"], e["message"], e["param"])
                  for e in chunk.summary.get("errors", [])]  # fmt: skip
        refused = [LineError(e["line"] + offset, e["code"], e["message"], e["param"])
                   for e in chunk.summary.get("refused", [])]  # fmt: skip
        models = chunk.summary.get("models", [])
        named = chunk.summary.get("named") or [None] * len(models)
        bad = 0  # the chunk's bad lines so far: its listed errors are its first ones, in order
        n_refused = 0  # the same for its refused lines
        with _local(rt, _objects(batch_id, chunk.seq)[1], spill_dir(settings)) as stream:
            for pos, (kind, model_index, custom_id) in enumerate(_events(stream), start=1):
                line_no = offset + pos
                if kind == VALID:
                    accepted = checks.accept(line_no, custom_id, models[model_index], named[model_index])
                    if accepted is False and checks.full:
                        return checks.finish(line_no)
                    if isinstance(accepted, LineError) and diverted is not None:
                        diverted.add(line_no, custom_id, accepted)
                elif kind == REFUSED:
                    error = refused[n_refused] if n_refused < len(refused) else None
                    n_refused += 1
                    if not checks.refuse(line_no, custom_id, error) and checks.full:
                        return checks.finish(line_no)
                elif kind == SKIPPED:
                    checks.skip(line_no, custom_id)
                elif kind == BLANK:
                    checks.blank(line_no)
                else:  # BAD_ROW or BAD_LINE
                    error = listed[bad] if bad < len(listed) else None
                    bad += 1
                    if kind == BAD_ROW:
                        checks.failed(error)
                    else:
                        checks.bad(error)
        if chunk.summary.get("stopped"):
            break  # a Parquet file past its row limit: its lines end there
        offset += chunk.lines
    return checks.finish(line_no)


@contextlib.contextmanager
def _local(rt: Runtime, key: str, spill: str) -> Iterator[IO[bytes]]:
    """An object copied to a local temporary file, read back buffered (many small reads)."""
    with tempfile.TemporaryFile(dir=spill) as local:
        with rt.store.open(key) as stream:
            while piece := stream.read(1 << 20):
                local.write(piece)
        local.seek(0)
        yield local


def merge_runs(
    rt: Runtime,
    batch_id: str,
    chunks: list[_Done],
    diverted: _Diverted | None = None,
    skip_first: bool = False,
) -> list[str]:
    """Every chunk's sorted run, lines made the file's, merged by (key, line) into the shards;
    the rows of ``diverted`` lines replaced by their refused rows. ``skip_first``: the first
    chunk's run is the batch's early slice (``first_chunk_slice``), its units made already."""
    spill = spill_dir(rt.settings)
    skip = diverted if diverted is not None and diverted.count else None
    with contextlib.ExitStack() as stack:
        streams: list[Iterator[Record]] = []
        offset = 0
        for chunk in chunks:
            if not (skip_first and chunk.seq == 0):
                run = stack.enter_context(_local(rt, _objects(batch_id, chunk.seq)[0], spill))
                streams.append(_shifted(load_records(run), offset, skip))
            offset += chunk.lines
        if skip is not None:
            streams.append(skip.records())
        return write_shards(rt, batch_id, heapq.merge(*streams))


def _shifted(records: Iterator[Record], offset: int, diverted: _Diverted | None) -> Iterator[Record]:
    for key, line, payload in records:
        if diverted is None or not diverted.holds(line + offset):
            yield key, line + offset, payload
