"""An engine worker's database writes on its units, apart from the engine: claim, heartbeat,
record and release, each a compare-and-set on the claim.

Every write a worker makes on a unit is guarded by its claim (``held``): a unit is recorded once
whatever else happened, and a stale worker's writes change nothing. Apart from the pack runner
(``workers/execution.py``) so that bench/dispatcher_fleet.py's simulated workers claim, heartbeat
and record through the same statements.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, cast

from sqlalchemy import ColumnElement, Table, and_, bindparam, select, update

from storage.leases import UNIT_LEASE
from storage.lifecycle import ACTIVE, NO_LIVE_COUNTS, finish_if_done, move_units
from storage.models import Batch, UnitStatus, WorkUnit
from storage.object_ledger import charge_bytes
from storage.runtime import Runtime
from workers.identity import claim_token

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claim:
    unit_id: int
    token: str
    attempt: int
    batch_id: str
    endpoint: str
    shard_key: str
    seq: int
    n_requests: int
    row_start: int = 0  # the unit's rows are [row_start, row_start + n_requests) of its shard
    cache_domain: str = ""  # whose prefix-cache entries its requests may share ("": everyone's)
    urgent: bool = False  # the dispatcher marked it urgent (its batch short of slack, within the share cap)
    # vLLM's cache_salt for its requests: a secret per tenant (Settings.cache_salt), None when
    # every tenant shares the prefix cache
    cache_salt: str | None = None
    tenant_id: str = ""
    trace_context: str | None = None  # its batch's (storage/tracing.py): the parent of the unit's spans


def held(claim: Claim) -> ColumnElement[bool]:
    """The unit is still running under this claim: every write a worker makes is guarded by it."""
    return and_(
        WorkUnit.id == claim.unit_id, WorkUnit.worker == claim.token, WorkUnit.status == UnitStatus.RUNNING
    )


def claim_unit(
    rt: Runtime, unit_id: int, now: float, holder: str, urgent: bool = False, pack_id: str | None = None
) -> Claim | None:
    """Take a queued or pending unit for the worker process ``holder`` (its stable name and its
    incarnation: workers/identity.holder_id); None if it is running, finished or stopped.
    ``urgent``: the dispatcher's word (after its per-tenant share cap) that it runs first.
    ``pack_id``: the pack whose message delivered it, recorded as the unit's pack: a unit packed
    again after its message waited too long (back to pending, its pack cleared) may still be taken
    by that late message, and then that is the pack it ran in."""
    token = claim_token(holder)
    delivered: dict[str, Any] = {"pack_id": pack_id} if pack_id is not None else {}
    with rt.db.write() as s:
        # compare-and-set: a pending or queued unit has no worker (every move back to pending clears
        # it); a running one is a live worker's (if it dies, the dispatcher's lease redelivers), a
        # finished one is done with, and a stopping batch skips its unstarted units itself
        taken = UNIT_LEASE.take(
            s,
            unit_id,
            token,
            select(Batch.id).where(Batch.id == WorkUnit.batch_id, Batch.status.in_(ACTIVE)).exists(),
            from_=(UnitStatus.PENDING, UnitStatus.QUEUED),
            to=UnitStatus.RUNNING,
            attempts=WorkUnit.attempts + 1,
            started_at=now,
            heartbeat_at=now,
            **NO_LIVE_COUNTS,  # live progress of this attempt (see heartbeat)
            **delivered,
        )
        if not taken:
            return None
        # one read of the columns a claim needs, not two ORM loads: a fleet claims dozens of
        # units a second, each on its worker's engine thread's time
        attempts, batch_id, shard_key, seq, n_requests, row_start, endpoint, tenant_id, trace_context = (
            s.execute(
                select(
                    WorkUnit.attempts,
                    WorkUnit.batch_id,
                    WorkUnit.shard_key,
                    WorkUnit.seq,
                    WorkUnit.n_requests,
                    WorkUnit.row_start,
                    Batch.endpoint,
                    Batch.tenant_id,
                    Batch.trace_context,
                )
                .join(Batch, Batch.id == WorkUnit.batch_id)
                .where(WorkUnit.id == unit_id)
            ).one()
        )
        return Claim(
            unit_id,
            token,
            attempts,
            batch_id,
            endpoint,
            shard_key,
            seq,
            n_requests,
            row_start,
            rt.settings.cache_domain(tenant_id),
            urgent,
            rt.settings.cache_salt(tenant_id),
            tenant_id,
            trace_context,
        )


@dataclass
class UnitTally:
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # the completed lines a LoRA adapter served, per adapter: [requests, prompt, cached, completion
    # tokens] (counted in the figures above too); recorded as the unit's adapter_usage
    adapters: dict[str, list[int]] = field(default_factory=dict)

    def count_adapter(self, adapter: str, prompt: int, cached: int, completion: int) -> None:
        usage = self.adapters.setdefault(adapter, [0, 0, 0, 0])
        for i, n in enumerate((1, prompt, cached, completion)):
            usage[i] += n


def record_unit(
    rt: Runtime,
    claim: Claim,
    now: float,
    tally: UnitTally,
    metering: dict[str, float | int],
    results: Iterable[tuple[str, int]] = (),
    **values: object,
) -> bool | None:
    """A finished unit's database record, in one transaction: the unit moves to ``done`` under its
    claim (compare-and-set, so a unit is recorded once), its figures (``tally``, the engine time
    and cost in ``metering``, the unit columns in ``values``) join its batch's live totals, and the
    batch moves to ``finalizing`` if this was its last unit, and its result objects (``results``:
    key and size) count in the tenant's stored bytes. None: the claim was lost and nothing was
    recorded; else whether the batch is ready to finalize."""
    with rt.db.write() as s:
        done = move_units(
            s,
            held(claim),
            from_=UnitStatus.RUNNING,
            to=UnitStatus.DONE,
            finished_at=now,
            heartbeat_at=now,
            completed=tally.completed,
            failed=tally.failed,
            prompt_tokens=tally.prompt_tokens,
            cached_tokens=tally.cached_tokens,
            completion_tokens=tally.completion_tokens,
            adapter_usage=tally.adapters or None,
            **metering,
            **values,
        )
        if not done:
            return None
        # live progress; finalization recomputes the totals from the units
        s.execute(
            update(Batch)
            .where(Batch.id == claim.batch_id)
            .values(
                request_completed=Batch.request_completed + tally.completed,
                request_failed=Batch.request_failed + tally.failed,
                prompt_tokens=Batch.prompt_tokens + tally.prompt_tokens,
                cached_tokens=Batch.cached_tokens + tally.cached_tokens,
                completion_tokens=Batch.completion_tokens + tally.completion_tokens,
                **{k: getattr(Batch, k) + v for k, v in metering.items()},
            )
        )
        batch = s.get(Batch, claim.batch_id, with_for_update=True)
        if batch is None:
            return False
        for key, size in results:
            charge_bytes(s, batch.tenant_id, key, size, batch_id=batch.id, now=int(now))
        return finish_if_done(s, batch, int(now))


def unit_recorded(rt: Runtime, claim: Claim, ready: bool, model: str) -> None:
    """After a unit's record committed: its batch to finalization if that was its last unit, and
    the queue of ``model`` refilled, the room this unit made in it."""
    if ready:
        rt.queue.finalize(claim.batch_id)
    from workers.dispatcher import TickReport, enqueue_units

    enqueue_units(rt, time.time(), TickReport(), model=model)


def heartbeat(rt: Runtime, beats: Iterable[tuple[Claim, UnitTally]], now: float) -> None:
    """Renew claims in one transaction, each with its unit's results so far (requests completed
    and failed, input and output tokens): live figures of the running attempt, which every move
    out of ``running`` other than ``record_unit`` (released, redelivered, given up, failed) sets
    back to 0 (``NO_LIVE_COUNTS``), so finalization's sums over the units never count an attempt
    whose results were discarded.

    One executemany (psycopg pipelines it: one round trip, not one per unit) in unit id order:
    the rows stay locked for as short a time as possible, since a record or the dispatcher's
    redelivery of those units waits for them, and in one order with the redelivery's, so the two
    never deadlock (PostgreSQL failed five such pairs under the 1,000-worker simulation)."""
    rows = sorted(
        (
            {
                "unit": c.unit_id,
                "token": c.token,
                "done": tally.completed,
                "bad": tally.failed,
                "input": tally.prompt_tokens,
                "tokens": tally.completion_tokens,
            }
            for c, tally in beats
        ),
        key=itemgetter("unit"),
    )
    if not rows:
        return
    table = cast(Table, WorkUnit.__table__)  # Core: an executemany, not the ORM's bulk update by key
    with rt.db.write() as s:
        s.execute(
            update(table)
            .where(
                table.c.id == bindparam("unit"),
                table.c.worker == bindparam("token"),
                table.c.status == UnitStatus.RUNNING,
            )
            .values(
                heartbeat_at=now,
                completed=bindparam("done"),
                failed=bindparam("bad"),
                prompt_tokens=bindparam("input"),
                completion_tokens=bindparam("tokens"),
            ),
            rows,
        )


def release_unit(rt: Runtime, claim: Claim, why: str = "unfinished at shutdown") -> None:
    """Give a unit back to pending, unrecorded and its attempt not counted."""
    with rt.db.write() as s:
        UNIT_LEASE.release(
            s,
            claim.unit_id,
            claim.token,
            from_=UnitStatus.RUNNING,
            to=UnitStatus.PENDING,
            pack_id=None,
            attempts=WorkUnit.attempts - 1,
            **NO_LIVE_COUNTS,  # its live counts: these results are given back unrecorded
        )
    log.info("unit %s released %s", claim.unit_id, why)
