"""The engine loop: the one thread that drives vLLM, and the only code on it.

Each pass applies the stops the watcher or ``close`` asked for, tops the engine up to its window
from the feed (``workers/pack_feed.py``), steps it, writes each result to its unit's spool files,
and accounts the step's busy time and fill to the units in the engine and to the engine sample.
A unit whose every request has an outcome goes to the recorder once its share of the engine's
time is settled (``workers/cost_meter.py``).

Everything here runs per request or per step: it takes the runner's lock only to pop from or
prune the feed, the sample's lock only to add to the sample, and makes no database or store call.
The engine is anything with ``SteppedEngine``'s surface (``workers.engine.Engine`` in a worker).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable

from scheduler.cost import TokenWork, kv_reads
from scheduler.duplicate_requests import RequestKey
from storage.shards import ShardRow
from workers.cost_meter import CostMeter
from workers.duplicate_lines import RECENT_RESULT, SHARED_RUN, DuplicateLines, copied_body
from workers.engine import ABORTED_STATUS, EngineRequest, EngineResult
from workers.images import images_in
from workers.kv_gate import KvGate
from workers.media_files import AUDIO_REF
from workers.pack_feed import IDLE_WAIT_SECONDS, PackFeed, feed_key
from workers.results import encode, request_error_line, stopped_line, success_line
from workers.runner_state import ActiveUnit, RunnerState
from workers.stepped_engine import SteppedEngine, StepSample

log = logging.getLogger(__name__)


class EngineLoop:
    """See the module docstring. ``run`` is the thread's body; ``failed`` is called on the same
    thread with what ended it (the engine died: nothing more runs in this process)."""

    def __init__(
        self,
        engine: SteppedEngine,
        state: RunnerState,
        feed: PackFeed,
        finished: queue.Queue[ActiveUnit | None],  # the recorder's
        meter: CostMeter,
        failed: Callable[[BaseException], None],
    ) -> None:
        self.engine = engine
        self._stopped = state.stopped
        self._lock = state.lock
        self._pack_feed = feed
        self._images = feed.images  # decoded once per worker, read ahead with each pack
        self._audio = feed.audio  # read ahead with each pack, like the images
        self._feed = feed.requests  # popped under _lock
        self._high_water = feed.high_water
        self._finished = finished
        self._failed = failed
        self._keys: dict[str, tuple[ActiveUnit, str]] = {}  # engine key -> (unit, custom_id)
        self._dups = DuplicateLines()  # lines waiting on the run of the same request (or copying it)
        self.stops: queue.SimpleQueue[ActiveUnit] = queue.SimpleQueue()  # units to abort and drop
        self._sample = StepSample()
        self._sample_lock = threading.Lock()
        self._meter = meter
        self._done: list[ActiveUnit] = []  # finished units, handed on once their share is settled
        self._gather_since: float | None = None  # an idle engine began waiting for packs (monotonic)
        self._gathered = 0.0  # how long the last idle start waited for packs (seconds)
        # ``park``: the loop is asked to hold, and holds, off the engine while it is swapped
        self._park = threading.Event()
        self._parked = threading.Event()
        self._running = threading.Event()  # ``run`` is on its thread
        # admission by KV footprint (workers/kv_gate.py; None: by count alone) and the feed's
        # request it held back for want of room, handed over first once there is (a popped
        # (unit, row); guarded by _lock, like the feed)
        self._kv_on = feed.rt.settings.kv_admission
        self._kv = KvGate.of(engine) if self._kv_on else None
        self._held: tuple[ActiveUnit, ShardRow] | None = None
        self._preempted = getattr(engine, "preemptions", None)  # vLLM's count at the last step

    def take_sample(self) -> StepSample:
        """The sample so far, a new one begun (the watcher's, every ``sample_seconds``)."""
        with self._sample_lock:
            sample, self._sample = self._sample, StepSample()
        return sample

    def park(self) -> bool:
        """Hold the loop at the start of its next pass, touching no engine, until ``resume``; on
        another thread (``PackRunner.restart_engine``, with no unit held). False if the loop has
        ended instead."""
        self._park.set()
        with self._lock:
            self._lock.notify_all()
        while not self._parked.wait(IDLE_WAIT_SECONDS):
            if self._stopped.is_set() or not self._running.is_set():
                return False
        return True

    def resume(self, engine: SteppedEngine) -> None:
        """Let a parked loop go on, driving ``engine`` from now on."""
        self.engine = engine
        self._dups.forget_recent()  # answers of the engine before (its adapters may have changed)
        self._parked.clear()
        self._park.clear()
        with self._lock:
            self._lock.notify_all()

    def _hold(self) -> None:
        with self._lock:
            # set on every pass, not once before: a resume clears it, and a park that follows
            # before this thread wakes must see it set again, or it waits for ever
            while self._park.is_set() and not self._stopped.is_set():
                self._parked.set()
                self._lock.wait(IDLE_WAIT_SECONDS)

    def run(self) -> None:
        self._running.set()
        try:
            self._run()
        finally:
            self._running.clear()

    def _run(self) -> None:
        engine = self.engine
        gathering = self._pack_feed.gathering
        # busy time runs on from the last step's end while the engine has work: vLLM's engine core
        # (a process of its own) computes the next step while this thread delivers the last one's
        # results, so a step's time alone undercounted the engine's (MFU past 1 was seen)
        busy_since: float | None = None
        try:
            while not self._stopped.is_set():
                if self._park.is_set():  # the engine is being swapped (nothing is in it)
                    self._hold()
                    engine, busy_since = self.engine, None
                    self._kv = KvGate.of(engine) if self._kv_on else None
                    self._preempted = getattr(engine, "preemptions", None)
                    continue
                started = time.monotonic() if busy_since is None else busy_since
                busy_since = None
                self._apply_stops()
                if engine.load == 0:
                    waited, self._gather_since = gathering(self._gather_since)
                    if waited:
                        continue
                    if self._gather_since is not None:  # the wait ends here, before the top-up
                        self._gathered = time.monotonic() - self._gather_since
                self._top_up()
                self._settle()
                if engine.load == 0:
                    with self._lock:
                        if not self._feed and not self._stopped.is_set():
                            self._lock.wait(IDLE_WAIT_SECONDS)
                    continue
                if self._gather_since is not None:  # an idle start: busy now; the next one gathers afresh
                    # one line per idle start (a job alone, or a burst of them): the wait it took
                    # is idle engine time, and 0.00 s is what a job alone should show
                    log.info(
                        "engine starting: %d requests in after gathering packs for %.2f s",
                        engine.load,
                        self._gathered,
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
            self._failed(exc)

    def _top_up(self) -> None:
        engine = self.engine
        kv = self._kv
        while engine.load < engine.window:
            with self._lock:
                held, self._held = self._held, None
                if held is not None and self._feed.urgent_waiting and not held[0].claim.urgent:
                    # an urgent request came while this one waited at the KV gate: it goes first,
                    # as the feed orders them, and this one back to the feed
                    self._feed.push(feed_key(*held), held)
                    held = None
                if held is not None:
                    unit, row = held
                elif not self._feed:
                    self._lock.notify_all()
                    return
                else:
                    unit, row = self._feed.pop()
                    if len(self._feed) <= self._high_water:
                        self._lock.notify_all()  # run_pack may return: the next pack is wanted
            if unit.stopping:
                self._deliver_to(unit, row.custom_id, None)
                continue
            body = row.body
            request_key = self._dups.key(unit.claim, body, row.body_json)
            if request_key is not None and self._copies(request_key, unit, row.custom_id):
                continue
            # unique per claim: a lost attempt's requests may still be in the engine when this
            # process claims the unit again
            key = f"{unit.claim.token}/{row.line}"
            if kv is not None and not kv.admits(
                key, unit.claim.endpoint, unit.claim.cache_salt, row, engine.load == 0
            ):
                with self._lock:
                    self._held = (unit, row)  # first in once enough of the engine's requests finish
                return
            request = EngineRequest(
                key=key,
                endpoint=unit.claim.endpoint,
                body=body,
                prompt_token_ids=row.prompt_token_ids,
                validated=True,
                cache_salt=unit.claim.cache_salt,
                images=self._images.lookup(unit.claim.batch_id) if images_in(row.body_json) else None,
                audio=self._audio.reader(unit.claim.batch_id) if AUDIO_REF in row.body_json else None,
                trace_headers=None if unit.trace is None else unit.trace.headers,  # tracing off: None
            )
            rejected = engine.add(request)
            if rejected is not None:
                self._deliver_to(unit, row.custom_id, rejected)
            else:
                self._keys[key] = (unit, row.custom_id)
                unit.in_engine += 1
                if request_key is not None:
                    self._dups.started(request_key, key)
                if kv is not None:
                    kv.hold(key)

    def _copies(self, request_key: RequestKey, unit: ActiveUnit, custom_id: str) -> bool:
        """The line needs no run of its own: it waits on its request's run, or copies its
        recent answer now (workers/duplicate_lines.py)."""
        joined = self._dups.join(request_key, unit, custom_id)
        if isinstance(joined, bool):
            return joined
        self._deliver_to(unit, custom_id, joined, copy=RECENT_RESULT)
        return True

    def _hand_over(self, key: str) -> bool:
        """A stopping unit's run goes on for a line waiting on it, if one's unit goes on."""
        heir = self._dups.heir(key)
        if heir is None:
            return False
        unit, custom_id = self._keys[key]
        self._keys[key] = heir
        unit.in_engine -= 1
        heir[0].in_engine += 1
        self._deliver_to(unit, custom_id, None)
        return True

    def _apply_stops(self) -> None:
        while True:
            try:
                unit = self.stops.get_nowait()
            except queue.Empty:
                return
            for custom_id in self._dups.leave(unit):
                self._deliver_to(unit, custom_id, None)
            keys = [k for k, (u, _) in self._keys.items() if u is unit]
            keys = [k for k in keys if not self._hand_over(k)]
            for result in self.engine.abort(keys):
                self._deliver(result)
            with self._lock:
                mine = self._feed.remove_if(functools.partial(_of_unit, unit))
                if self._held is not None and self._held[0] is unit:
                    mine.insert(0, self._held)
                    self._held = None
            for _, row in mine:
                self._deliver_to(unit, row.custom_id, None)

    def _account(self, elapsed: float) -> None:
        stats = self.engine.stats
        fill = min(1.0, stats.running / max(1, self.engine.config.max_num_seqs))
        preempted, self._preempted = self._preempted, getattr(self.engine, "preemptions", None)
        with self._sample_lock:
            sample = self._sample
            if preempted is not None and self._preempted is not None:
                sample.preemptions = (sample.preemptions or 0) + self._preempted - preempted
            if sample.steps == 0:
                # the period's busy time begins at its first step, not when the last one was
                # taken: [started_at, started_at + seconds] is then when it ran (one busy stretch)
                sample.started_at = time.time() - elapsed
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
        if self._kv is not None:
            finished = result.ok and result.body is not None
            planned = self._kv.release(result.key, result.completion_tokens if finished else None)
            if finished and planned is not None:
                with self._sample_lock:
                    self._sample.planned_cached_tokens += planned
        written = self._deliver_to(unit, custom_id, result)
        aborted = result.status_code == ABORTED_STATUS  # only once no unit that goes on waits
        for waiter, waiter_id in self._dups.finished(result, written):
            self._deliver_to(waiter, waiter_id, None if aborted else result, copy=SHARED_RUN)

    def _deliver_to(
        self, unit: ActiveUnit, custom_id: str, result: EngineResult | None, copy: str | None = None
    ) -> int:
        """Write one request's outcome to its unit's spool (None: stopped before it ran); returns
        the line's bytes. ``copy``: the result of another line's run (x_freight.copy), which did
        the engine's work and is metered: the copy adds none (workers/duplicate_lines.py)."""
        tally = unit.tally
        if result is not None and result.ok and result.body is not None:
            tally.completed += 1
            tally.prompt_tokens += result.prompt_tokens
            tally.cached_tokens += result.cached_tokens
            tally.completion_tokens += result.completion_tokens
            if result.adapter is not None:  # a LoRA adapter's line: its usage apart (workers/lora.py)
                tally.count_adapter(
                    result.adapter, result.prompt_tokens, result.cached_tokens, result.completion_tokens
                )
            body = result.body if copy is None else copied_body(result.body, copy)
            line = encode(success_line(custom_id, body))
            unit.out.write(line)
            if copy is not None:
                unit.results += 1
                if unit.done:
                    self._done.append(unit)
                return len(line)
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
            line = encode(stopped_line(custom_id, unit.reason or "batch_cancelled"))
            unit.err.write(line)
        else:
            tally.failed += 1
            error = request_error_line(custom_id, result.status_code or 500, result.error or {})
            if copy is not None:
                error["response"]["body"]["x_freight"] = {"copy": copy}
            line = encode(error)
            unit.err.write(line)
        unit.results += 1
        if unit.done:
            self._done.append(unit)
        return len(line)

    def _settle(self) -> None:
        """Close the metering period when a unit finished or it is due, then hand finished units
        to the recorder: a unit's share of the engine's time is settled before it is recorded."""
        if self._done or self._meter.due:
            self._meter.close()
        done, self._done = self._done, []
        for unit in done:
            self._finished.put(unit)


def _of_unit(unit: ActiveUnit, entry: tuple[ActiveUnit, ShardRow]) -> bool:
    """A feed entry of ``unit`` (the requests of a stopped unit are taken off the feed)."""
    return entry[0] is unit
