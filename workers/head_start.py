"""Early slices of a validation: a file's first valid rows run while the rest is read.

Why: a batch's units used to exist only once validation had read, checked and sorted its whole
file, and for a job running alone that time is idle engine time (0.5-1.3 s of the image and
request-rate benchmarks' 5-18 s, about 39 s of a million lines). Validation reads short lines many
times faster than an engine answers them, so the engine needs only a small first slice to start,
and each later slice is read while the one before it runs.

What, in one task: ``HeadStart.records`` sits between the scan and the whole-file sort. It holds
the file's first FREIGHT_VALIDATION_HEAD_ROWS valid rows, then four times as many, and so on (at
most ``HEAD_SLICES`` slices, each at most ``SLICE_BYTES`` of sort records). When a row past a
slice arrives and the file is clean so far (``FileChecks.clean``: no error, a served model named),
the slice is sorted by prompt key within itself, written as shards of its own (``shards/s<k>-*``)
and planned, and its units are committed while the batch is still ``validating``
(``start_slice``, ``commit_slice``, which checks the tenant's queued-requests quota as
``conclude`` does); the dispatcher packs units of a validating batch as any others. The rows
after the last slice go to the whole-file sort as before and become the rest of the units at
``validation.conclude``, which moves the batch to ``in_progress``. In chunks (a file over
FREIGHT_VALIDATION_CHUNK_BYTES), the first chunk is the one slice: done while another chunk is
pending, and clean, its sorted run is written and committed the same way
(``validation_chunks.first_chunk_slice``), and the merge leaves that run out.

The Batch API's semantics are kept: the batch stays ``validating`` until its whole file is
checked (its request_counts total counts the slices' rows meanwhile). A file that then fails, or
that the quota or the SLA refuses, fails as before (``storage.lifecycle.fail_validating``): its
unstarted units are skipped, running ones stop within a second, and no result of theirs is output;
the engine time they took is in the batch's usage, under the tenant's fair share like any work.

The trade: each slice is sorted within itself, so a prefix that rows of two slices share is
computed again unless the KV cache still holds it when the later slice runs; and where validation
shares the engine's cores (a CPU host), its CPU slows the engine by about as much as the overlap
saves. So the first slice starts only where a boundary costs the prefix cache little
(``slices_pay``, ``scheduler.slice_cost``: unique prompts, or prompts under one system prompt),
and a file of a few prefixes shared by many rows keeps the whole-file sort. A file no larger than
its first slice has none.

Crash safety: a slice's shards are written under keys fixed by its index before the one
transaction that commits its units. A validation run again (its lease taken over, its message
redelivered) counts the rows the batch's units hold (``sliced``), drops that many first rows of
its scan (the same rows: the scan's order depends on the file and the rules only) and starts no
slice of its own; ``conclude`` and ``commit_slice`` both commit only if the slices are still those
their run counted, so two runs never both add rows.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy import case, exists, func, select
from sqlalchemy.orm import Session

from scheduler.slice_cost import SPLIT_COST_LIMIT, boundary_cost
from scheduler.unit_plan import UnitPlan, kv_block_size
from storage.models import Batch, ValidationChunk, WorkUnit
from storage.quotas import queued_refusal
from storage.runtime import Runtime
from storage.shards import PREFIX_KEY_BYTES
from storage.status import BatchStatus, ChunkStatus
from workers.dispatcher import TickReport, enqueue_units
from workers.planning import plan_batch
from workers.prefix_caching import prediction_block_size

log = logging.getLogger(__name__)

Record = tuple[bytes, int, bytes]  # the sort's (prompt key, line, payload)
WriteShards = Callable[[Runtime, str, Iterable[Record], str], list[str]]

HEAD_SLICES = 4  # at the default 256 rows: slices of 256, 1,024, 4,096 and 16,384 rows
SLICE_GROWTH = 4  # each slice this many times the one before: read while the one before runs
SLICE_BYTES = 64 * 1024 * 1024  # of sort records held for one slice (keys and payloads)
RECORD_OVERHEAD = 64  # bytes a held record costs beyond its key and payload


@dataclass(frozen=True)
class Sliced:
    """What a batch's units hold already: its early slices' (all of them while it validates)."""

    units: int = 0
    rows: int = 0
    asked: int = 0  # what the quota counts: each row's sequences, inputs or pairs
    prompt_tokens: int = 0
    cached_tokens: int = 0


def sliced(s: Session, batch_id: str) -> Sliced:
    """The totals of a batch's units, one aggregate read."""
    asked = case((WorkUnit.sequences > 0, WorkUnit.sequences), else_=WorkUnit.n_requests)
    row = s.execute(
        select(
            func.count(),
            func.coalesce(func.sum(WorkUnit.n_requests), 0),
            func.coalesce(func.sum(asked), 0),
            func.coalesce(func.sum(WorkUnit.planned_prompt_tokens), 0),
            func.coalesce(func.sum(WorkUnit.planned_cached_tokens), 0),
        ).where(WorkUnit.batch_id == batch_id)
    ).one()
    return Sliced(*(int(x) for x in row))


def asked(units: Sequence[UnitPlan]) -> int:
    """What the quota counts of planned units: a line's n sequences, inputs or pairs."""
    return sum(unit.sequences or unit.n_requests for unit in units)


def unit_rows(batch_id: str, model: str, units: Sequence[UnitPlan], first_seq: int) -> list[WorkUnit]:
    """The rows of planned units, numbered on from ``first_seq`` (the batch's units so far)."""
    return [
        WorkUnit(
            batch_id=batch_id,
            seq=seq,
            model=model,
            shard_key=unit.shard_key,
            row_start=unit.row_start,
            first_line=unit.first_line,
            n_requests=unit.n_requests,
            prefix_key=unit.prefix_key[:PREFIX_KEY_BYTES],
            planned_prompt_tokens=unit.prompt_tokens,
            planned_cached_tokens=unit.cached_tokens,
            sequences=unit.sequences,
            work=unit.work,
        )
        for seq, unit in enumerate(units, start=first_seq)
    ]


def commit_slice(
    rt: Runtime,
    batch_id: str,
    model: str,
    units: Sequence[UnitPlan],
    rows_before: int,
    rows: int,
    *,
    chunks_pending: bool = False,
) -> bool:
    """Add one slice's units to a ``validating`` batch; False, having changed nothing, if it is no
    longer validating, if its units are not the ``rows_before`` rows this run counted (another run
    of its validation added some), or if its tenant's queued-requests quota has no room for them.
    ``chunks_pending``: a chunked validation's first chunk, committed only while another chunk of
    the batch is still pending (the batch row locked, as a chunk's move to done locks it), so the
    merge, which the last chunk done sends, always finds the slice or none."""
    with rt.db.write() as s:
        batch = s.get(Batch, batch_id, with_for_update=True)
        if batch is None or batch.status != BatchStatus.VALIDATING:
            return False
        if chunks_pending and not s.scalar(
            select(
                exists().where(
                    ValidationChunk.batch_id == batch_id, ValidationChunk.status == ChunkStatus.PENDING
                )
            )
        ):
            return False
        prior = sliced(s, batch_id)
        if prior.rows != rows_before:
            return False
        if queued_refusal(s, rt.settings, batch, prior.asked + asked(units)) is not None:
            return False
        batch.model = model
        batch.request_total = prior.rows + rows  # the rows known so far; the whole file's at the end
        s.add_all(unit_rows(batch_id, model, units, prior.units))
    return True


class Clean(Protocol):
    """What ``HeadStart`` asks of the file's checks before a slice starts (``FileChecks.clean``):
    the file's model if no line so far failed and one named a served model, else None."""

    def clean(self) -> str | None: ...


class HeadStart:
    """The early slices of one validation run (see the module's docstring)."""

    def __init__(self, rt: Runtime, batch_id: str, write_shards: WriteShards) -> None:
        self.rt = rt
        self.batch_id = batch_id
        self.write_shards = write_shards
        with rt.db.read() as s:
            self.rows = sliced(s, batch_id).rows  # held by the batch's units: slices of an earlier run
        self.first_rows = 0 if self.rows else rt.settings.validation_head_rows
        self.slices = 0

    def records(self, scanned: Iterable[Record], checks: Clean) -> Iterator[Record]:
        """The records of ``scanned`` (file order) that wait for the whole-file sort: all but those
        of the slices started here and, on a run again, of the slices an earlier run started."""
        source = iter(scanned)
        if self.rows:  # the same first rows as that run's: its units hold them
            for _ in itertools.islice(source, self.rows):
                pass
            yield from source
            return
        if not self.first_rows:
            yield from source
            return
        held: list[Record] = []
        size, used = self.first_rows, 0
        for record in source:
            if held and (len(held) >= size or used >= SLICE_BYTES):  # a row past the slice: it has one
                model = checks.clean()
                started = model is not None and self._start(held, model)
                if not started or self.slices >= HEAD_SLICES:
                    if not started:  # slicing ends here: these rows wait for the whole file
                        yield from held
                    yield record
                    yield from source
                    return
                held, used, size = [], 0, size * SLICE_GROWTH
            held.append(record)
            used += len(record[0]) + len(record[2]) + RECORD_OVERHEAD
        yield from held  # the file ended inside a slice: its rows are the rest's

    def _start(self, held: list[Record], model: str) -> bool:
        """Sort, write, plan and commit one slice; True if its units were committed. The first
        slice starts only if a boundary costs the prefix cache little (``slices_pay``)."""
        mid_line = held[len(held) // 2][1]  # held in file order: the line a boundary would cut at
        held.sort()  # by (prompt key, line): the whole-file sort's order
        if not self.slices and not slices_pay(self.rt, self.batch_id, model, held, mid_line):
            return False
        keys = self.write_shards(self.rt, self.batch_id, held, f"s{self.slices}-")
        if not start_slice(self.rt, self.batch_id, model, keys, self.rows, len(held)):
            log.info(
                "batch %s: slice %d not started; its rows wait for the whole file", self.batch_id, self.slices
            )
            return False
        self.rows += len(held)
        self.slices += 1
        log.info("batch %s: slice %d started, %d rows", self.batch_id, self.slices - 1, len(held))
        return True


def slices_pay(
    rt: Runtime, batch_id: str, model: str, ordered: Iterable[tuple[bytes, int, object]], mid_line: int
) -> bool:
    """Whether a file whose first rows are ``ordered`` (sorted) may run in early slices: a slice
    boundary at ``mid_line`` would cost less than ``SPLIT_COST_LIMIT`` more prefill than the rows
    sorted whole (``scheduler.slice_cost``). Where it would cost more (a few prefixes shared by
    many rows, the file shuffled), the whole-file sort keeps each prefix's rows together."""
    block = prediction_block_size(rt, model, kv_block_size(rt.settings.engine_block_size))
    extra = boundary_cost(((key, line) for key, line, _ in ordered), block, mid_line)
    if extra < SPLIT_COST_LIMIT:
        return True
    log.info(
        "batch %s: no early slices; a boundary would compute %.0f%% more of its first rows' prompts",
        batch_id, 100 * extra,
    )  # fmt: skip
    return False


def start_slice(
    rt: Runtime,
    batch_id: str,
    model: str,
    keys: list[str],
    rows_before: int,
    rows: int,
    *,
    chunks_pending: bool = False,
) -> bool:
    """Plan a slice written as the shards ``keys`` and commit its units (``commit_slice``), then
    pack them at once rather than at the next tick (which would do the same); True if committed."""
    settings = rt.settings
    block = prediction_block_size(rt, model, kv_block_size(settings.engine_block_size))
    units = plan_batch(rt.store, keys, settings, block_size=block)
    if not commit_slice(rt, batch_id, model, units, rows_before, rows, chunks_pending=chunks_pending):
        return False
    try:
        enqueue_units(rt, time.time(), TickReport(), model=model)
    except Exception:
        log.warning("packing batch %s's slice failed; the next tick does it", batch_id, exc_info=True)
    return True
