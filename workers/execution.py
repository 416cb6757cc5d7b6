"""Running packs of work units on one warm engine, fed continuously.

An engine worker holds one `PackRunner`. Celery hands it packs (units of one model from any
batches); `run_pack` claims the units, merges their requests in prompt-prefix order onto the
runner's feed, and returns as soon as the feed runs low, so Celery delivers the next pack while
the engine still has work: the running batch never drains at a unit or pack boundary.

Three threads besides Celery's:

* the **engine loop** owns the engine: tops it up to its window from the feed, steps it, routes
  each result to its unit's spool files, and samples the batch fill;
* the **watcher** reads unit and batch state every second (cancellation, expiry, a claim taken
  over), heartbeats the claims, and writes the fill/throughput samples;
* the **recorder** uploads a finished unit's result files and records it, compare-and-set on the
  claim, so a unit's results are recorded exactly once whatever else happened.

A worker that dies records nothing: its units' heartbeats go stale and the dispatcher queues them
again. Results are keyed by ``custom_id``, never by position, so the order of running is free.
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO

from sqlalchemy import ColumnElement, and_, bindparam, select, update

from scheduler.cost import TokenWork, engine_cost_micros, kv_reads
from scheduler.feed_order import ElevatorFeed, gather_deadline
from scheduler.utilization import mbu, mfu
from storage.db import is_transient
from storage.leases import take_lease
from storage.lifecycle import NO_LIVE_COUNTS, abort_reason, finish_if_done, move_units
from storage.models import Batch, EngineSample, UnitStatus, WorkUnit
from storage.runtime import Runtime
from storage.shards import ShardRow, read_rows
from storage.status import BatchStatus, unit_sources
from workers import task_policy
from workers.checkpoint import model_shape
from workers.cost_meter import CostMeter, UnitMeter
from workers.engine import ABORTED_STATUS, Engine, EngineRequest, EngineResult
from workers.identity import claim_token, holder_id, new_incarnation
from workers.results import encode, request_error_line, stopped_line, success_line

log = logging.getLogger(__name__)

CHECK_SECONDS = 1.0  # how often the watcher reads unit/batch state (cancellation latency)
IDLE_WAIT_SECONDS = 0.2
GATHER_LOGGED_SECONDS = 0.01  # an idle start that waited this long for more packs says so in the log
# the feed's keys: (cache domain, prompt key, line, unit id); the first two name the prompt
FeedKey = tuple[str, bytes, int, int]
FEED_PROMPT_FIELDS = 2


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
    delivered = {"pack_id": pack_id} if pack_id is not None else {}
    with rt.db.write() as s:
        # compare-and-set: a pending or queued unit has no worker (every move back to pending clears
        # it); a running one is a live worker's (if it dies, the dispatcher's lease redelivers), a
        # finished one is done with, and a stopping batch skips its unstarted units itself
        taken = take_lease(
            s,
            WorkUnit,
            unit_id,
            "worker",
            token,
            WorkUnit.status.in_(unit_sources((UnitStatus.PENDING, UnitStatus.QUEUED), UnitStatus.RUNNING)),
            select(Batch.id)
            .where(Batch.id == WorkUnit.batch_id, Batch.status == BatchStatus.IN_PROGRESS)
            .exists(),
            status=UnitStatus.RUNNING,
            attempts=WorkUnit.attempts + 1,
            started_at=now,
            heartbeat_at=now,
            **NO_LIVE_COUNTS,  # live progress of this attempt (see _heartbeat)
            **delivered,
        )
        if not taken:
            return None
        # one read of the columns a claim needs, not two ORM loads: a fleet claims dozens of
        # units a second, each on its worker's engine thread's time
        attempts, batch_id, shard_key, seq, n_requests, row_start, endpoint, tenant_id = s.execute(
            select(
                WorkUnit.attempts,
                WorkUnit.batch_id,
                WorkUnit.shard_key,
                WorkUnit.seq,
                WorkUnit.n_requests,
                WorkUnit.row_start,
                Batch.endpoint,
                Batch.tenant_id,
            )
            .join(Batch, Batch.id == WorkUnit.batch_id)
            .where(WorkUnit.id == unit_id)
        ).one()
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
        )


@dataclass
class UnitTally:
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


def record_unit(
    rt: Runtime,
    claim: Claim,
    now: float,
    tally: UnitTally,
    metering: dict[str, float | int],
    **values: object,
) -> bool | None:
    """A finished unit's database record, in one transaction: the unit moves to ``done`` under its
    claim (compare-and-set, so a unit is recorded once), its figures (``tally``, the engine time
    and cost in ``metering``, the unit columns in ``values``) join its batch's live totals, and the
    batch moves to ``finalizing`` if this was its last unit. None: the claim was lost and nothing
    was recorded; else whether the batch is ready to finalize. Apart from ``PackRunner`` so that
    bench/dispatcher_fleet.py's simulated workers record through the same statements."""
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
        return batch is not None and finish_if_done(s, batch, int(now))


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
        key=lambda row: row["unit"],
    )
    if not rows:
        return
    table = WorkUnit.__table__  # Core: an executemany, not the ORM's bulk update by key
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


@dataclass(eq=False)
class ActiveUnit:
    """A claimed unit whose requests are on the feed or in the engine."""

    claim: Claim
    out: IO[bytes]
    err: IO[bytes]
    total: int
    results: int = 0
    tally: UnitTally = field(default_factory=UnitTally)
    reason: str | None = None  # set once the batch stops: batch_cancelled / batch_expired
    lost: bool = False  # the claim went to another worker: discard everything
    released: bool = False  # this worker is shutting down: give the unit back unrecorded
    fill_seconds: float = 0.0  # time-weighted sum of fill while its requests were in the engine
    seconds: float = 0.0
    in_engine: int = 0
    meter: UnitMeter = field(default_factory=UnitMeter)  # its engine time and cost so far

    @property
    def done(self) -> bool:
        return self.results >= self.total

    @property
    def stopping(self) -> bool:
        return self.reason is not None or self.lost or self.released


@dataclass
class _Sample:
    started_at: float = field(default_factory=time.time)
    seconds: float = 0.0
    steps: int = 0
    running: float = 0.0  # time-weighted sums
    waiting: float = 0.0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    kv_tokens_read: int = 0

    @property
    def work(self) -> TokenWork:
        return TokenWork(
            self.prompt_tokens, self.cached_tokens, self.output_tokens, self.requests, self.kv_tokens_read
        )


def _spool() -> IO[bytes]:
    """A unit's result spool; closed by the recorder once the unit is recorded or dropped."""
    return tempfile.TemporaryFile()


def _exit_process() -> None:
    """A worker whose engine died cannot serve its queue: exit so the supervisor restarts it."""
    logging.shutdown()
    os._exit(70)


def feed_key(unit: ActiveUnit, row: ShardRow) -> FeedKey:
    return (unit.claim.cache_domain, row.key, row.line, unit.claim.unit_id)


class PackRunner:
    """The engine worker's side of the scheduler; see the module docstring."""

    def __init__(
        self,
        rt: Runtime,
        engine: Engine,
        model: str,
        worker: str,
        price_per_hour: float | None = None,  # this pool's machine ($/hour); None: the setting
    ) -> None:
        self.rt = rt
        self.price_per_hour = (
            rt.settings.instance_price_per_hour if price_per_hour is None else price_per_hour
        )
        self.engine = engine
        self.model = model
        self.worker = worker  # the stable name: the label of its samples (workers/identity.py)
        # this process (the name and an incarnation of its own): every claim token starts with it
        self.holder = holder_id(worker, new_incarnation())
        self._lock = threading.Condition()
        # not-yet-started requests of every claimed unit, in elevator order; guarded by _lock
        self._feed: ElevatorFeed[tuple[ActiveUnit, ShardRow]] = ElevatorFeed(
            prompt_fields=FEED_PROMPT_FIELDS, domain_fields=1, quantum=rt.settings.pack_requests
        )
        # the next pack is wanted once no more requests wait than this look-ahead (at least the
        # engine's batch): a later job then reaches the feed while its prefix-mates still run
        self._high_water = max(
            engine.config.max_num_seqs, rt.settings.feed_requests or rt.settings.pack_requests
        )
        self._gather_since: float | None = None  # an idle engine began waiting for packs (monotonic)
        self._last_pack_at = 0.0  # the last pack's requests reached the feed (monotonic; guarded by _lock)
        self._more_coming = False  # the last pack's: other batches were validating (guarded by _lock)
        # by claim token: a unit lost and claimed again by this process is two entries; guarded by _lock
        self._units: dict[str, ActiveUnit] = {}
        self._keys: dict[str, tuple[ActiveUnit, str]] = {}  # engine key -> (unit, custom_id)
        self._stops: queue.SimpleQueue[ActiveUnit] = queue.SimpleQueue()  # for the engine loop
        self._finished: queue.Queue[ActiveUnit | None] = queue.Queue()  # for the recorder
        self._sample = _Sample()
        self._sample_lock = threading.Lock()
        self._meter = CostMeter(self.price_per_hour, rt.settings.sample_seconds)
        self._done: list[ActiveUnit] = []  # finished units, handed on once their share is settled
        self.shape = model_shape(engine.config.model_path, served_dtype=engine.dtype)
        # this process waits for a pack (its ask, renewed by the watcher); guarded by _ask_lock, held
        # over the broker call so a renewal never lands after the withdrawal that a claim makes
        self._asking = False
        self._ask_lock = threading.Lock()
        self._closing = threading.Event()
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self.failure: BaseException | None = None
        self.on_fatal = _exit_process

    # ------------------------------------------------------------------ public

    def start(self) -> PackRunner:
        for name, target in (
            ("engine", self._engine_loop),
            ("watcher", self._watch_loop),
            ("recorder", self._record_loop),
        ):
            thread = threading.Thread(target=target, name=f"freight-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._ask()  # an engine up and idle: the next tick makes it a pack
        return self

    def run_pack(
        self, pack_id: str, unit_ids: list[int], more_coming: bool = False, urgent: Iterable[int] = ()
    ) -> int:
        """Claim the pack's units, put their requests on the feed in prefix order, and return
        once the feed is low enough that the engine needs the next pack. Returns units claimed.

        ``more_coming``: the dispatcher saw batches that may be of this model still validating;
        the latest pack's word decides whether an idle engine waits for them (``_gathering``)."""
        if self._closing.is_set():
            return 0
        self._withdraw_ask()  # before the claims: see dispatcher.pack_model on the order
        try:
            return self._feed_pack(pack_id, unit_ids, more_coming, urgent)
        finally:
            # whatever became of this pack, the worker takes the next message now: it waits for a
            # pack, so one is made for it (the task's refill right after this, or the next tick)
            if not self._closing.is_set() and self.failure is None:
                self._ask()

    def _feed_pack(self, pack_id: str, unit_ids: list[int], more_coming: bool, urgent: Iterable[int]) -> int:
        hurry = set(urgent)
        claims = [
            c
            for u in unit_ids
            if (c := claim_unit(self.rt, u, time.time(), self.holder, u in hurry, pack_id))
        ]
        if not claims:
            return 0
        units = [ActiveUnit(c, _spool(), _spool(), c.n_requests) for c in claims]
        with self._lock:  # on the watcher's list from the claim: heartbeated while their rows are read
            for unit in units:
                self._units[unit.claim.token] = unit
        try:
            rows = [
                list(read_rows(self.rt.store, u.claim.shard_key, u.claim.row_start, u.claim.n_requests))
                for u in units
            ]
        except Exception as exc:
            self._give_back_unread(units, exc)
            raise
        with self._lock:
            self._more_coming = more_coming
            self._last_pack_at = time.monotonic()
            for unit, unit_rows in zip(units, rows, strict=True):
                unit.total = len(unit_rows)
                if unit.total == 0:
                    self._finished.put(unit)
                # each shard is prefix-sorted already; the feed merges them with every request
                # waiting from earlier packs, whatever batch or tenant (see scheduler.feed_order)
                for row in unit_rows:
                    self._feed.push(feed_key(unit, row), (unit, row), urgent=unit.claim.urgent)
            self._lock.notify_all()
        hurried = sum(len(r) for u, r in zip(units, rows, strict=True) if u.claim.urgent)
        log.info(
            "pack %s: %d units, %d requests%s%s",
            pack_id,
            len(units),
            sum(map(len, rows)),
            f" ({hurried} urgent)" if hurried else "",
            ", more may come" if more_coming else "",
        )
        with self._lock:
            while len(self._feed) > self._high_water and not self._closing.is_set() and self.failure is None:
                self._lock.wait(1.0)
        if self.failure is not None:
            raise RuntimeError("the engine loop failed") from self.failure
        return len(units)

    def _ask(self, renewal: bool = False) -> None:
        """Tell the dispatcher this process takes a pack of its model next (storage.broker's asks).
        ``renewal``: only if it still waits, and asking afresh only if the broker lost the ask. A
        failure is only logged: the watcher asks again within a heartbeat."""
        settings = self.rt.settings
        with self._ask_lock:
            if renewal and not self._asking:
                return
            self._asking = True
            try:
                ask = self.rt.queue.keep_ask if renewal else self.rt.queue.ask_for_pack
                ask(self.model, self.holder, time.time(), settings.ask_lifetime_seconds)
            except Exception:
                log.warning("asking for a pack failed; asking again with the next heartbeat", exc_info=True)

    def _withdraw_ask(self) -> None:
        with self._ask_lock:
            self._asking = False
            try:
                self.rt.queue.withdraw_ask(self.model, self.holder)
            except Exception:  # the ask lapses by itself: at worst one pack is made that waits
                log.warning("withdrawing the ask for a pack failed", exc_info=True)

    def busy(self) -> bool:
        with self._lock:
            return bool(self._units)

    def _give_back_unread(self, units: list[ActiveUnit], exc: Exception) -> None:
        """The pack's rows could not be read. An outage of the store (the reads retried for as long
        as the store's retry policy allows): the units go back to pending with the attempt not
        counted, for the dispatcher to pack again, so an outage never uses up a unit's attempts.
        Anything else is the pack's fault: the units stay claimed for the task's exception policy
        to fail (``task_policy.fail_pack``)."""
        for unit in units:
            self._forget(unit)
        if not task_policy.is_transient(exc):
            return
        for unit in units:
            try:
                self._release(unit, f"because its rows could not be read: {exc}")
            except Exception:
                log.exception("giving unit %s back failed; its lease will expire", unit.claim.unit_id)

    def close(self, drain_seconds: float) -> None:
        """Stop taking packs; let running units finish for ``drain_seconds``, then give the rest
        back to the dispatcher unrecorded (their requests run again elsewhere, exactly once)."""
        self._closing.set()
        self._withdraw_ask()
        deadline = time.monotonic() + drain_seconds
        while self.busy() and time.monotonic() < deadline and self.failure is None:
            time.sleep(0.2)
        with self._lock:
            leftover = list(self._units.values())
        for unit in leftover:
            unit.released = True
            self._stops.put(unit)
        deadline = time.monotonic() + 10
        while self.busy() and time.monotonic() < deadline and self.failure is None:
            time.sleep(0.1)
        self._stopped.set()
        self._finished.put(None)
        with self._lock:
            self._lock.notify_all()
        for thread in self._threads:
            thread.join(timeout=10)

    # ------------------------------------------------------------------ engine loop

    def _engine_loop(self) -> None:
        engine = self.engine
        # busy time runs on from the last step's end while the engine has work: vLLM's engine core
        # (a process of its own) computes the next step while this thread delivers the last one's
        # results, so a step's time alone undercounted the engine's (MFU past 1 was seen)
        busy_since: float | None = None
        try:
            while not self._stopped.is_set():
                started = time.monotonic() if busy_since is None else busy_since
                busy_since = None
                self._apply_stops()
                if engine.load == 0 and self._gathering():
                    continue
                self._top_up()
                self._settle()
                if engine.load == 0:
                    with self._lock:
                        if not self._feed and not self._stopped.is_set():
                            self._lock.wait(IDLE_WAIT_SECONDS)
                    continue
                if self._gather_since is not None:  # an idle start: busy now; the next one gathers afresh
                    waited = time.monotonic() - self._gather_since
                    if waited >= GATHER_LOGGED_SECONDS:
                        log.info(
                            "engine starting: %d requests in after gathering packs for %.2f s",
                            engine.load,
                            waited,
                        )
                    self._gather_since = None
                results = engine.step()
                busy_since = time.monotonic()
                self._account(busy_since - started)  # busy time: the last delivery, top-up and step
                for result in results:
                    self._deliver(result)
                self._settle()
        except BaseException as exc:  # the engine died: nothing more runs in this process
            log.exception("engine loop failed; giving this worker's units back")
            self.failure = exc
            with self._lock:
                units = list(self._units.values())
                self._lock.notify_all()
            for unit in units:
                try:
                    self._release(unit)
                except Exception:
                    log.exception("releasing unit %s failed; its lease will expire", unit.claim.unit_id)
            self.on_fatal()

    def _gathering(self) -> bool:
        """Whether an idle engine should wait a moment more for packs before it starts: never
        once the feed holds the look-ahead or anything urgent; else until
        ``scheduler.feed_order.gather_deadline`` (which says when, and why). Without the wait, jobs
        of one model submitted together run apart, and the prefixes the late ones share with the
        first are computed again once the KV cache has dropped them (issue #24)."""
        merge = self.rt.settings.feed_merge_seconds
        settle = self.rt.settings.feed_settle_seconds
        with self._lock:
            if (
                not self._feed
                or self._feed.urgent_waiting
                or len(self._feed) >= self._high_water
                or self._closing.is_set()
            ):
                return False
            now = time.monotonic()
            if self._gather_since is None:
                self._gather_since = now
            until = gather_deadline(self._gather_since, self._last_pack_at, self._more_coming, merge, settle)
            if now >= until:
                return False
            self._lock.wait(min(IDLE_WAIT_SECONDS, until - now))
            return True

    def _top_up(self) -> None:
        engine = self.engine
        while engine.load < engine.window:
            with self._lock:
                if not self._feed:
                    self._lock.notify_all()
                    return
                unit, row = self._feed.pop()
                if len(self._feed) <= self._high_water:
                    self._lock.notify_all()  # run_pack may return: the next pack is wanted
            if unit.stopping:
                self._deliver_to(unit, row.custom_id, None)
                continue
            # unique per claim: a lost attempt's requests may still be in the engine when this
            # process claims the unit again
            key = f"{unit.claim.token}/{row.line}"
            request = EngineRequest(
                key=key,
                endpoint=unit.claim.endpoint,
                body=row.body,
                prompt_token_ids=row.prompt_token_ids,
                validated=True,
                cache_salt=unit.claim.cache_salt,
            )
            rejected = engine.add(request)
            if rejected is not None:
                self._deliver_to(unit, row.custom_id, rejected)
            else:
                self._keys[key] = (unit, row.custom_id)
                unit.in_engine += 1

    def _apply_stops(self) -> None:
        while True:
            try:
                unit = self._stops.get_nowait()
            except queue.Empty:
                return
            keys = [k for k, (u, _) in self._keys.items() if u is unit]
            for result in self.engine.abort(keys):
                self._deliver(result)
            with self._lock:
                mine = self._feed.remove_if(lambda entry, stopped=unit: entry[0] is stopped)
            for _, row in mine:
                self._deliver_to(unit, row.custom_id, None)

    def _account(self, elapsed: float) -> None:
        stats = self.engine.stats
        fill = min(1.0, stats.running / max(1, self.engine.config.max_num_seqs))
        with self._sample_lock:
            sample = self._sample
            sample.seconds += elapsed
            sample.steps += 1
            sample.running += stats.running * elapsed
            sample.waiting += stats.waiting * elapsed
        self._meter.busy(elapsed)
        for unit in {u for u, _ in self._keys.values()}:
            if unit.in_engine:
                unit.fill_seconds += fill * elapsed
                unit.seconds += elapsed

    def _deliver(self, result: EngineResult) -> None:
        """A result out of the engine (finished or aborted)."""
        unit, custom_id = self._keys.pop(result.key)
        unit.in_engine -= 1
        self._deliver_to(unit, custom_id, result)

    def _deliver_to(self, unit: ActiveUnit, custom_id: str, result: EngineResult | None) -> None:
        """Write one request's outcome to its unit's spool (None: stopped before it ran)."""
        tally = unit.tally
        if result is not None and result.ok and result.body is not None:
            tally.completed += 1
            tally.prompt_tokens += result.prompt_tokens
            tally.cached_tokens += result.cached_tokens
            tally.completion_tokens += result.completion_tokens
            unit.out.write(encode(success_line(custom_id, result.body)))
            reads = kv_reads(result.prompt_tokens, result.completion_tokens)
            work = TokenWork(result.prompt_tokens, result.cached_tokens, result.completion_tokens, 1, reads)
            self._meter.finished(unit.claim.unit_id, unit.meter, work)
            with self._sample_lock:
                self._sample.requests += 1
                self._sample.prompt_tokens += result.prompt_tokens
                self._sample.cached_tokens += result.cached_tokens
                self._sample.output_tokens += result.completion_tokens
                self._sample.kv_tokens_read += reads
        elif result is None or result.status_code == ABORTED_STATUS:
            tally.failed += 1
            unit.err.write(encode(stopped_line(custom_id, unit.reason or "batch_cancelled")))
        else:
            tally.failed += 1
            unit.err.write(
                encode(request_error_line(custom_id, result.status_code or 500, result.error or {}))
            )
        unit.results += 1
        if unit.done:
            self._done.append(unit)

    def _settle(self) -> None:
        """Close the metering period when a unit finished or it is due, then hand finished units
        to the recorder: a unit's share of the engine's time is settled before it is recorded."""
        if self._done or self._meter.due:
            self._meter.close()
        done, self._done = self._done, []
        for unit in done:
            self._finished.put(unit)

    # ------------------------------------------------------------------ recorder

    def _record_loop(self) -> None:
        while True:
            unit = self._finished.get()
            if unit is None:
                return
            try:
                self._record_retrying(unit)
            except Exception:
                # the claim stays RUNNING without heartbeats: the dispatcher redelivers it
                log.exception("recording unit %s failed", unit.claim.unit_id)
            finally:
                self._forget(unit)

    def _forget(self, unit: ActiveUnit) -> None:
        """Drop a unit from the worker's books: its spools closed, its claim no longer
        heartbeated, and ``run_pack`` woken in case it waits for room."""
        unit.out.close()
        unit.err.close()
        with self._lock:
            self._units.pop(unit.claim.token, None)
            self._lock.notify_all()

    def _record_retrying(self, unit: ActiveUnit) -> None:
        """Record a unit, again while the database is down or cut the connection (a restart),
        for up to a lease: the unit stays on the watcher's list meanwhile, so its claim keeps
        being heartbeated once the database is back. Safe to repeat: the uploads go to the same
        keys and the recording is a compare-and-set on the claim."""
        deadline = time.monotonic() + self.rt.settings.lease_seconds
        pause = 0.5
        while True:
            try:
                return self._record(unit)
            except Exception as exc:
                if not is_transient(exc) or time.monotonic() + pause > deadline:
                    raise
                log.warning(
                    "unit %s: database unavailable while recording (%s); retrying", unit.claim.unit_id, exc
                )
                time.sleep(pause)
                pause = min(pause * 2, 5.0)

    def _record(self, unit: ActiveUnit) -> None:
        claim = unit.claim
        if unit.lost:
            log.warning("unit %s: claim lost to another worker; results discarded", claim.unit_id)
            return
        if unit.released:
            self._release(unit)
            return
        base = f"batches/{claim.batch_id}/units/{claim.seq:06d}.{claim.attempt}"
        output_key, error_key = f"{base}.output.jsonl", f"{base}.errors.jsonl"
        for key, spool in ((output_key, unit.out), (error_key, unit.err)):
            spool.seek(0)
            self.rt.store.put_stream(key, spool)
        tally = unit.tally
        now = time.time()
        fill = unit.fill_seconds / unit.seconds if unit.seconds else None
        meter = unit.meter
        metering = {
            "engine_seconds": meter.engine_seconds,
            "cost_micros": meter.cost_micros,
            "cost_input_micros": meter.parts["input"],
            "cost_cached_micros": meter.parts["cached_input"],
            "cost_output_micros": meter.parts["output"],
        }
        ready = record_unit(
            self.rt,
            claim,
            now,
            tally,
            metering,
            output_key=output_key,
            error_key=error_key,
            mean_fill=fill,
            kv_tokens_read=meter.work.kv_tokens_read,
            **self._utilization(meter.work, meter.engine_seconds, round(meter.steps)),
        )
        if ready is None:
            log.warning("unit %s: claim lost before recording; results discarded", claim.unit_id)
            return
        log.info(
            "unit %s (%s #%d): %d ok, %d failed, %d prompt (%d cached) + %d output tokens, fill %s, "
            "%.2f engine s, %d micro-$",
            claim.unit_id,
            claim.batch_id,
            claim.seq,
            tally.completed,
            tally.failed,
            tally.prompt_tokens,
            tally.cached_tokens,
            tally.completion_tokens,
            f"{fill:.2f}" if fill is not None else "-",
            meter.engine_seconds,
            meter.cost_micros,
        )
        unit_recorded(self.rt, claim, ready, self.model)

    def _release(self, unit: ActiveUnit, why: str = "unfinished at shutdown") -> None:
        """Give a unit back to pending, unrecorded and its attempt not counted."""
        with self.rt.db.write() as s:
            move_units(
                s,
                held(unit.claim),
                from_=UnitStatus.RUNNING,
                to=UnitStatus.PENDING,
                worker=None,
                pack_id=None,
                attempts=WorkUnit.attempts - 1,
                **NO_LIVE_COUNTS,  # its live counts: these results are given back unrecorded
            )
        log.info("unit %s released %s", unit.claim.unit_id, why)

    # ------------------------------------------------------------------ watcher

    def _watch_loop(self) -> None:
        last_beat = last_sample = last_ask = time.time()
        while not self._stopped.wait(CHECK_SECONDS):
            try:
                now = time.time()
                # renewed with the heartbeats: an ask lapses only with its process (or a broker
                # that lost its data, which this brings back)
                if not self._closing.is_set() and now - last_ask >= self.rt.settings.heartbeat_seconds:
                    last_ask = now
                    self._ask(renewal=True)
                with self._lock:
                    units = [u for u in self._units.values() if not u.stopping]
                if units:
                    self._check(units)
                if units and self.failure is None and now - last_beat >= self.rt.settings.heartbeat_seconds:
                    last_beat = now
                    self._heartbeat(units, now)
                if now - last_sample >= self.rt.settings.sample_seconds:
                    last_sample = now
                    self._flush_sample()
            except Exception:
                log.exception("watcher pass failed; retrying")
        self._flush_sample()

    def _check(self, units: list[ActiveUnit]) -> None:
        ids = [u.claim.unit_id for u in units]
        with self.rt.db.read() as s:
            rows = {
                row.id: row
                for row in s.execute(
                    select(
                        WorkUnit.id,
                        WorkUnit.worker,
                        WorkUnit.status,
                        Batch.status.label("batch_status"),
                        Batch.final_status,
                    )
                    .join(Batch, Batch.id == WorkUnit.batch_id)
                    .where(WorkUnit.id.in_(ids))
                )
            }
        for unit in units:
            row = rows.get(unit.claim.unit_id)
            if row is None or row.worker != unit.claim.token or row.status != UnitStatus.RUNNING:
                unit.lost = True
            else:
                unit.reason = abort_reason(row.batch_status, row.final_status)
            if unit.stopping:
                self._stops.put(unit)
                with self._lock:
                    self._lock.notify_all()

    def _heartbeat(self, units: list[ActiveUnit], now: float) -> None:
        """Renew the claims, with each unit's results so far: the API adds running units' counts
        to the batch's request_counts, and the console's throughput chart their output tokens (an
        embeddings batch's: input tokens), so both move within a unit, not only at its end."""
        heartbeat(self.rt, [(u.claim, u.tally) for u in units], now)

    def _flush_sample(self) -> None:
        with self._sample_lock:
            sample, self._sample = self._sample, _Sample()
        if sample.steps == 0 or sample.seconds <= 0:
            return  # idle periods are not samples: rates measure capacity while busy
        utilization = self._utilization(sample.work, sample.seconds, sample.steps)
        utilization.pop("model_parameters")
        utilization.pop("bytes_per_parameter")
        with self.rt.db.write() as s:
            s.add(
                EngineSample(
                    worker=self.worker,
                    model=self.model,
                    started_at=sample.started_at,
                    seconds=sample.seconds,
                    steps=sample.steps,
                    running_mean=sample.running / sample.seconds,
                    waiting_mean=sample.waiting / sample.seconds,
                    max_num_seqs=self.engine.config.max_num_seqs,
                    prompt_tokens=sample.prompt_tokens,
                    cached_tokens=sample.cached_tokens,
                    output_tokens=sample.output_tokens,
                    requests=sample.requests,
                    kv_tokens_read=sample.kv_tokens_read,
                    cost_micros=engine_cost_micros(sample.seconds, self.price_per_hour),
                    **utilization,
                )
            )

    def _utilization(self, work: TokenWork, seconds: float, steps: int) -> dict[str, float | int | None]:
        """MFU and MBU estimates (None without the model's shape or the accelerator's figures)."""
        shape, acc = self.shape, self.rt.settings.accelerator
        if shape is None:
            return {"model_parameters": None, "bytes_per_parameter": None, "mfu": None, "mbu": None}
        return {
            "model_parameters": shape.parameters,
            "bytes_per_parameter": shape.bytes_per_parameter,
            "mfu": mfu(work, seconds, shape, acc),
            "mbu": mbu(steps, work, seconds, shape, acc),
        }
