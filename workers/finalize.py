"""Finalization: stream every unit's results into the batch's output and error files.

Runs when no unit of the batch is running any more. Idempotent: the files go to keys fixed by the
batch id, the file rows and the final transition are committed together, and a finalizer lease
keeps two finalizers from copying the same batch at once. Totals are recomputed from the units,
so live progress counters can never be double counted in the final figures.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO

from sqlalchemy import select

from scheduler.cost import TokenWork, list_price_micros
from scheduler.leases import renewal_due
from storage.leases import FINALIZER_LEASE
from storage.lifecycle import finish_batch, unfinished_units
from storage.models import Batch, StoredFile, UnitStatus, WorkUnit, new_id
from storage.objectstore import CHUNK
from storage.quotas import stored_overrun
from storage.registry import lookup_in
from storage.retention import expiry
from storage.runtime import Runtime
from storage.shards import custom_ids
from storage.status import BatchStatus
from workers.results import encode, stopped_line
from workers.resume import carried, chain_usage

log = logging.getLogger(__name__)


PREFETCH_UNITS = 8  # result objects opened ahead of the one being copied
METERED = (
    "engine_seconds",
    "cost_micros",
    "cost_input_micros",
    "cost_cached_micros",
    "cost_output_micros",
)


class _Lease:
    """This finalizer's hold on the batch (``FINALIZER_LEASE``): its token is the time it was taken
    or last renewed, so each renewal checks the token held and moves it to the renewal's time."""

    def __init__(self, rt: Runtime, batch_id: str, token: float) -> None:
        self.rt = rt
        self.batch_id = batch_id
        self.token = token
        self.lost = False

    def renew_if_due(self) -> None:
        now = time.time()
        if self.lost or not renewal_due(self.token, now, self.rt.settings.lease_seconds):
            return
        with self.rt.db.write() as s:
            renewed = FINALIZER_LEASE.renew(s, self.batch_id, self.token, now)
        if renewed:
            self.token = now
        else:  # it ran out and another finalizer took it: both write the same files, one commits
            self.lost = True
            log.warning("batch %s: the finalizer lease was taken over", self.batch_id)

    def release(self) -> None:
        try:
            with self.rt.db.write() as s:
                FINALIZER_LEASE.release(s, self.batch_id, self.token)
        except Exception:  # the database is down too: the lease runs out instead
            log.exception("batch %s: could not release the finalizer lease", self.batch_id)


def _claim(rt: Runtime, batch_id: str, now: float) -> Batch | None:
    with rt.db.write() as s:
        claimed = FINALIZER_LEASE.take(
            s,
            batch_id,
            now,
            Batch.status.in_([BatchStatus.FINALIZING, BatchStatus.CANCELLING]),
            now=now,
            lease_seconds=rt.settings.lease_seconds,
        )
        if not claimed or unfinished_units(s, batch_id):
            if claimed:  # units still running: give the lease straight back
                FINALIZER_LEASE.release(s, batch_id, now)
            return None
        return s.get(Batch, batch_id)


def finalize_batch(rt: Runtime, batch_id: str) -> str | None:
    """Assemble the files and move the batch to its final state; returns that state, or None."""
    taken = time.time()
    batch = _claim(rt, batch_id, taken)
    if batch is None:
        return None
    lease = _Lease(rt, batch_id, taken)
    stop_code = "batch_cancelled" if batch.status == BatchStatus.CANCELLING else "batch_expired"
    with rt.db.read() as s:
        units = s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch_id).order_by(WorkUnit.seq)).all()

    counts = {"output": 0, "errors": 0}
    sizes = {}
    keys = {kind: f"batches/{batch_id}/{kind}.jsonl" for kind in counts}
    try:
        for kind in counts:
            # a resume's files begin with the lines the batch it resumes settled (workers/resume.py)
            earlier = carried(rt, batch.resumed_from, kind, counts) if batch.resumed_from else iter(())
            sizes[kind] = rt.store.put_chunks(
                keys[kind], itertools.chain(earlier, _assemble(rt, lease, units, kind, stop_code, counts))
            )
    except Exception:
        lease.release()  # the store gave up (an outage past its retries): the next tick retries
        raise

    now = int(time.time())
    with rt.db.write() as s:
        batch = s.get(Batch, batch_id, with_for_update=True)
        if batch is None or batch.status not in (BatchStatus.FINALIZING, BatchStatus.CANCELLING):
            return None
        for kind, attr, filename in (
            ("output", "output_file_id", "output"),
            ("errors", "error_file_id", "errors"),
        ):
            if counts[kind] and getattr(batch, attr) is None:
                f = StoredFile(
                    id=new_id("file-"),
                    tenant_id=batch.tenant_id,
                    purpose="batch_output",
                    filename=f"{batch_id}_{filename}.jsonl",
                    bytes=sizes[kind],
                    object_key=keys[kind],
                    created_at=now,
                    expires_at=expiry(rt.settings, now, batch.output_expires_after),
                )
                s.add(f)
                setattr(batch, attr, f.id)
        # only recorded units count: a unit that was running when it was released, lost or given
        # up may still hold the live counts of an attempt whose results were discarded
        batch.request_completed = sum(u.completed for u in units if u.status == UnitStatus.DONE)
        batch.request_failed = batch.request_total - batch.request_completed
        batch.prompt_tokens = sum(u.prompt_tokens for u in units)
        batch.cached_tokens = sum(u.cached_tokens for u in units)
        batch.completion_tokens = sum(u.completion_tokens for u in units)
        for column in METERED:  # the batch's cost is exactly the sum of its units' shares
            setattr(batch, column, sum(getattr(u, column) for u in units))
        entry = lookup_in(s, rt.settings, batch.model or "")
        price = (
            entry.list_price_or_default(rt.settings) if entry else rt.settings.list_price(batch.model or "")
        )
        work = TokenWork(batch.prompt_tokens, batch.cached_tokens, batch.completion_tokens)
        batch.list_price_micros = list_price_micros(work, price) if price else None
        batch.chain_usage = chain_usage(s, batch)
        if batch.status == BatchStatus.CANCELLING:
            final = BatchStatus.CANCELLED
        elif batch.final_status == BatchStatus.EXPIRED:
            final = BatchStatus.EXPIRED
        else:
            final = BatchStatus.COMPLETED
        s.flush()  # the files above count in the check below
        # past the tenant's stored-bytes limit with these files: nothing is lost (they stay, the
        # batch ends as it would), the batch says why, and the tenant's new work is refused
        overrun = stored_overrun(s, rt.settings, batch.tenant_id)
        if overrun is not None:
            batch.warnings = [*(batch.warnings or []), overrun]
            log.warning("batch %s: %s", batch_id, overrun)
        finish_batch(s, batch, final, now)
        FINALIZER_LEASE.release(s, batch_id, lease.token)
    log.info(
        "batch %s %s: %d output lines, %d error lines", batch_id, final, counts["output"], counts["errors"]
    )
    return final.value


def _assemble(
    rt: Runtime, lease: _Lease, units: Sequence[WorkUnit], kind: str, stop_code: str, counts: dict[str, int]
) -> Iterator[bytes]:
    """The bytes of one result file, unit by unit in file order; counts lines as it goes and
    renews the finalizer lease when it is due."""
    ids = _ShardIds(rt)
    for unit, stream in _opened(rt, units, kind):
        if stream is not None:
            with stream:
                while chunk := stream.read(CHUNK):
                    counts[kind] += chunk.count(b"\n")
                    yield chunk
        elif kind == "errors" and unit.status != UnitStatus.DONE:
            code = "worker_failed" if unit.status == UnitStatus.FAILED else stop_code
            for custom_id in ids.of(unit):
                counts[kind] += 1
                yield encode(stopped_line(custom_id, code))
        lease.renew_if_due()


class _ShardIds:
    """The custom ids of units that never ran, one read of each shard's ``custom_id`` column.

    Why: a cancelled or expired million-request batch has ~15,600 such units, 64 to a shard.
    Reading each unit's rows whole (bodies, keys, token ids) opened its shard and parsed its footer
    once per unit, and fetched the whole shard once per unit from S3: 79 s of a cancelled
    million-request batch's finalization on a local store. Units come in file order, so the units
    of one shard come together and one shard's ids (SHARD_UNITS x unit_size strings) are held."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.key: str | None = None
        self.ids: list[str] = []

    def of(self, unit: WorkUnit) -> list[str]:
        if unit.shard_key != self.key:
            self.ids = custom_ids(self.rt.store, unit.shard_key)
            self.key = unit.shard_key
        return self.ids[unit.row_start : unit.row_start + unit.n_requests]


def _opened(rt: Runtime, units: Sequence[WorkUnit], kind: str) -> Iterator[tuple[WorkUnit, IO[bytes] | None]]:
    """Each unit with its result object of ``kind`` opened (None for a unit that did not run),
    in order, the next ``PREFETCH_UNITS`` opened ahead by a small pool.

    Why: an object store's GET waits a round trip before its first byte, and a million-request
    batch has about 3,900 units with two objects each; opened one after the other, those waits
    added up to most of the finalization (bench/finalization.py). Memory stays bounded: an opened
    object is a response whose body is read only when its turn comes."""
    todo = iter(units)
    ahead: deque[tuple[WorkUnit, Future[IO[bytes]] | None]] = deque()
    with ThreadPoolExecutor(PREFETCH_UNITS, thread_name_prefix="finalize-get") as pool:

        def refill() -> None:
            while len(ahead) < PREFETCH_UNITS and (unit := next(todo, None)) is not None:
                if unit.status != UnitStatus.DONE:
                    ahead.append((unit, None))
                    continue
                key = unit.output_key if kind == "output" else unit.error_key
                assert key is not None, (
                    f"unit {unit.id} is done without its {kind} file"
                )  # record_unit writes both
                ahead.append((unit, pool.submit(rt.store.open, key)))

        try:
            refill()
            while ahead:
                unit, opening = ahead.popleft()
                refill()
                yield unit, None if opening is None else opening.result()
        finally:  # stopped early (a failed write, an error): close what was opened ahead
            for _, opening in ahead:
                if opening is not None and not opening.cancel():
                    with contextlib.suppress(Exception):
                        opening.result().close()
