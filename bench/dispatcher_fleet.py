"""The processes of the fleet-scale dispatcher benchmark: the dispatcher's tick loop, and fleet
processes that each drive many simulated engine workers.

A simulated worker does an engine worker's database and broker work and nothing else (its state is
modelled by the process's clock thread, its operations run on a small pool of threads): it takes pack messages off its model's real Redis queue (the ones ``enqueue_units`` sent),
claims their units with ``workers.unit_claims.claim_unit``, "runs" them for a modelled time (a unit's
requests at ``worker_rps``, one unit after another), records each through
``workers.unit_claims.record_unit`` and ``unit_recorded`` (which refills the queue, as an engine
worker does), and asks for the next pack while one pack's worth of requests is still ahead of it
(the feed's look-ahead). Per process, one thread renews the claims (``heartbeat``) every
``FREIGHT_HEARTBEAT_SECONDS`` and writes each busy worker's ``engine_samples`` row every
``FREIGHT_SAMPLE_SECONDS``, in one transaction for all of the process's workers (a real fleet
makes one per worker: the rows are the same, the transactions fewer). A transaction per worker
from one thread could not keep up with 250 workers on a loaded box (leases ran out, 1,741 units
were claimed twice); one of ~2,000 statements held their rows locked for seconds, and the
records of those units waited for it (the record's unit UPDATE: 293 ms mean, 5.9 s max at scale
0.25), which ``heartbeat``'s single executemany now avoids.
"""

from __future__ import annotations

import base64
import heapq
import json
import math
import queue
import random
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, insert, select

from bench.dispatcher_load import OUTPUT_TOKENS, PROMPT_TOKENS
from storage.broker import model_queue
from storage.models import EngineSample, UnitStatus, WorkUnit
from storage.runtime import Runtime
from storage.settings import Settings
from workers import dispatcher
from workers.unit_claims import Claim, UnitTally, claim_unit, heartbeat, record_unit, unit_recorded


def runtime(config: dict[str, Any]) -> Runtime:
    return Runtime(Settings.from_env({}, **config["settings"]))


def _dump(path: str, data: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(data))


# ------------------------------------------------------------------------------- the dispatcher


def run_dispatcher(config: dict[str, Any], stop: Any, out: str) -> None:
    """The periodic tick (``workers.dispatcher.tick``, as ``freight beat`` runs it) every
    ``tick_seconds``; each tick's wall time, what it did, and its phases' times. The phases are
    timed by wrapping the dispatcher module's functions in this process only: ``tick`` looks them
    up at call time, so the tick timed is the real one, unchanged."""
    rt = runtime(config)
    phases: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0

        return wrapper

    for name in (
        "expire_overdue",
        "redeliver_stale",
        "measured_throughput",
        "requeue_lost",
        "resend_lost_validations",
        "assess_deadlines",
        "enqueue_units",
        "start_finalization",
    ):
        setattr(dispatcher, name, timed(name, getattr(dispatcher, name)))
    ticks: list[dict[str, Any]] = []
    period = config["tick_seconds"]
    while not stop.is_set():
        phases.clear()
        started = time.time()
        t0 = time.perf_counter()
        error = None
        try:
            report = dispatcher.tick(rt, started)
        except Exception as exc:  # beat sends the next tick all the same: counted, not fatal
            error, report = repr(exc), dispatcher.TickReport()
        seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        with rt.db.read() as s:  # outside the timed tick: what was waiting when it ran
            waiting = s.scalar(
                select(func.coalesce(func.sum(WorkUnit.n_requests), 0)).where(
                    WorkUnit.status.in_([UnitStatus.PENDING, UnitStatus.QUEUED])
                )
            )
        ticks.append(
            {
                "at": started,
                "seconds": seconds,
                "waiting_requests": int(waiting or 0),
                "waiting_query_s": round(time.perf_counter() - t1, 4),
                "packs": len(report.packs),
                "enqueued": len(report.enqueued),
                "requeued": len(report.requeued),
                "redelivered": len(report.redelivered),
                "finalizing": len(report.finalizing),
                "expired": len(report.expired),
                "phases": {k: round(v, 4) for k, v in phases.items()},
                "error": error,
            }
        )
        stop.wait(max(0.0, period - (time.time() - started)))
    rt.db.dispose()
    _dump(out, {"ticks": ticks})


# ------------------------------------------------------------------------------- the fleet


@dataclass(frozen=True)
class PackMessage:
    pack_id: str
    unit_ids: list[int]
    urgent: list[int]
    received_at: float


def decode(raw: bytes) -> PackMessage:
    """A ``freight.run_pack`` message as kombu's Redis transport stores it (base64 body of
    Celery's ``[args, kwargs, embed]``)."""
    body = json.loads(base64.b64decode(json.loads(raw)["body"]))
    pack_id, unit_ids, _more_coming, urgent = body[0][:4]  # then newest_batch_at: a real worker's gather
    return PackMessage(pack_id, list(unit_ids), list(urgent or ()), time.time())


@dataclass
class SimWorker:
    name: str
    model: str
    rps: float  # modelled requests per second of its engine
    work: deque[Claim] = field(default_factory=deque)  # claimed, not yet finished (first: running)
    running_since: float | None = None
    running_seconds: float = 0.0  # the running unit's modelled engine time
    joins_at: float = 0.0  # when its engine has loaded: it asks for nothing before
    asked: bool = False  # its request for a pack is with the fetcher
    asked_at: float = 0.0  # when it last asked
    idle_from: float | None = None  # when it last had nothing to run (None: it has work)
    busy_seconds: float = 0.0  # modelled engine time of the units it finished
    # its ask in the broker, as PackRunner keeps it: asking, under ask_lock held over the broker
    # call, so a renewal never lands after the withdrawal a take makes
    asking: bool = False
    ask_lock: threading.Lock = field(default_factory=threading.Lock)
    sample: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # started, seconds, requests

    def waiting(self) -> int:
        """Requests claimed and not started (the feed): the running unit is the engine's."""
        return sum(c.n_requests for c in self.work) - (self.work[0].n_requests if self.running_since else 0)


class Fleet:
    """One process's simulated workers: a clock thread that models every worker's engine (a heap
    of the times its running units finish), a bounded pool of operation threads that does their
    database and broker work (claims and the refill after a pack is taken; records and the refill
    after them), one pack fetcher per model (a Redis BRPOP for the next hungry worker) and the
    heartbeat/sample thread.

    Why not a thread per worker: 250 threads per process on one core, each taking connections
    from a pool of 15, stalled whole processes under load. A thread holding a connection waited
    behind the others for the GIL, the pool ran dry (QueuePool timeouts of 30 s), the heartbeat
    thread waited for a connection too, leases lapsed, and thousands of units were redelivered
    and run twice (4,134 in one pinned run). Here the threads that touch the database are
    ``op_threads`` plus the heartbeat, under the pool's size, so no operation waits for a
    connection; the modelled engine time does not wait for the operations either (a unit's
    successor starts when it finishes, whenever its record commits)."""

    def __init__(self, config: dict[str, Any], index: int, stop: Any) -> None:
        self.config = config
        self.rt = runtime(config)
        # the run's stop is a multiprocessing Event: every is_set() takes its lock, shared by every
        # process of the run. Threads asking it in their loops made a lock convoy on a loaded box,
        # in which the dispatcher's process waited 10-30 s between ticks for the same lock. The
        # threads ask a process-local event; one thread waits on the run's and sets it
        self.stop = threading.Event()
        threading.Thread(target=lambda: (stop.wait(), self.stop.set()), daemon=True).start()
        self.lock = threading.Lock()
        self.look_ahead = self.rt.settings.pack_requests
        models = config["models"]
        first, count = config["fleet_slices"][index]
        # seeded per process: every run at one configuration models the same fleet
        self.rng = random.Random(config.get("seed", 21) * 1000 + index)
        self.spread = config.get("unit_time_spread", 0.0)
        began = time.time()
        self.workers = [
            SimWorker(
                f"sim{index}-{i}",
                models[i % len(models)],
                config["worker_rps"],
                joins_at=began + self.rng.uniform(0.0, config.get("join_seconds", 0.0)),
            )
            for i in range(first, first + count)
        ]
        for w in self.workers:
            w.idle_from = w.joins_at
        self.hungry: dict[str, queue.Queue[SimWorker]] = {m: queue.Queue() for m in models}
        # claims a take made, for the clock to put on their worker's feed: (worker, claims)
        self.arrivals: queue.Queue[tuple[SimWorker, list[Claim]]] = queue.Queue()
        # records (an engine worker's recorder thread) on one pool; taking a pack and asking for the
        # next (its Celery main thread) on another, so a take never queues behind other workers'
        # records: in one run it did, for up to 12 s, which no real worker's claim waits
        self.ops = ThreadPoolExecutor(config.get("op_threads", 8), thread_name_prefix="op")
        self.takes = ThreadPoolExecutor(config.get("take_threads", 4), thread_name_prefix="take")
        self.op_waits: dict[str, list[float]] = {"record": [], "take": [], "ask": []}  # queued, s
        # measurements, each (time, value...) appended under self.lock
        self.claims: list[tuple[int, float, float]] = []  # unit, at, claim_unit's seconds
        self.lost_claims = 0
        # unit, at, record s, refill s, n (-1: refused), urgent (the dispatcher sent it as urgent: 1)
        self.records: list[tuple[int, float, float, float, int, int]] = []
        self.pokes: list[float] = []  # the refill after an ask (tasks.run_pack's poke)
        self.asks: list[tuple[float, float]] = []  # (asked at, seconds until its pack's first claim)
        self.idle: list[tuple[float, float]] = []  # (from, seconds): a worker with nothing to run
        self.errors: list[str] = []
        self.asks_lapsed = 0  # asks found lapsed at their renewal, and made again

    # -- threads

    def fetcher(self, model: str) -> None:
        client = self.rt.queue.celery.connection_for_read().default_channel.client
        waiting = self.hungry[model]
        while not self.stop.is_set():
            try:
                worker = waiting.get(timeout=0.5)
            except queue.Empty:
                continue
            while not self.stop.is_set():
                item = client.brpop(model_queue(model), timeout=1)
                if item:
                    self.submit(self.takes, "take", self.take, worker, decode(item[1]))
                    break

    def clock(self) -> None:
        """Every worker's modelled engine: starts a worker's next unit when the one before it
        finishes (or when claims arrive for an idle worker), hands each finished unit to the
        operation threads to record, and puts a worker whose feed is short with its fetcher."""
        due: list[tuple[float, int, SimWorker]] = []  # (running unit finishes at, tie-break, worker)
        joining = sorted(self.workers, key=lambda w: w.joins_at, reverse=True)  # the next one last
        while not self.stop.is_set():
            while joining and joining[-1].joins_at <= time.time():
                self.ask(joining.pop())
            soonest = min([d[0] for d in due[:1]] + [w.joins_at for w in joining[-1:]], default=None)
            timeout = 0.5 if soonest is None else max(0.0, min(0.5, soonest - time.time()))
            try:
                w, claims = self.arrivals.get(timeout=timeout)
            except queue.Empty:
                pass
            else:
                with self.lock:
                    w.work.extend(claims)
                    w.asked = False
                    if w.work and w.running_since is None:
                        w.running_since = time.time()
                        w.running_seconds = self.engine_seconds(w, w.work[0])
                        heapq.heappush(due, (w.running_since + w.running_seconds, id(w), w))
                self.ask(w)
            now = time.time()
            while due and due[0][0] <= now:
                finish, _, w = heapq.heappop(due)
                with self.lock:  # the heartbeat thread reads the deques
                    done, seconds = w.work.popleft(), w.running_seconds
                    started = w.running_since or finish
                    w.running_since = finish if w.work else None
                    if w.work:
                        w.running_seconds = self.engine_seconds(w, w.work[0])
                        heapq.heappush(due, (finish + w.running_seconds, id(w), w))
                    else:
                        w.idle_from = now
                self.submit(self.ops, "record", self.finish, w, done, started, seconds)
                self.ask(w)

    def engine_seconds(self, w: SimWorker, claim: Claim) -> float:
        """A unit's modelled engine time: its requests at the worker's rate, times a lognormal
        factor of mean 1 (``unit_time_spread``: its sigma; 0: every unit of a size alike)."""
        base = claim.n_requests / w.rps
        if not self.spread:
            return base
        return base * math.exp(self.rng.gauss(0.0, self.spread) - self.spread**2 / 2)

    def ask(self, w: SimWorker) -> None:
        """The feed's look-ahead: a worker asks for a pack while no more than one pack's requests
        wait on it. As ``PackRunner.run_pack`` ends: the ask (``PackAsks.add``), then the
        refill that makes its pack (``tasks.run_pack``'s poke), then the wait on the queue."""
        with self.lock:
            if w.asked or w.waiting() > self.look_ahead:
                return
            w.asked, w.asked_at = True, time.time()
        self.submit(self.takes, "ask", self.ask_and_refill, w)

    def ask_and_refill(self, w: SimWorker) -> None:
        with w.ask_lock:
            w.asking = True
            self.rt.queue.asks.add(w.model, w.name, time.time(), self.rt.settings.ask_lifetime_seconds)
        self.hungry[w.model].put(w)
        t0 = time.perf_counter()
        dispatcher.enqueue_units(self.rt, time.time(), dispatcher.TickReport(), model=w.model)  # tasks.poke
        with self.lock:
            self.pokes.append(time.perf_counter() - t0)

    def submit(self, pool: ThreadPoolExecutor, kind: str, target: Any, *args: Any) -> None:
        pool.submit(self.op, target, *args, kind=kind, queued_at=time.perf_counter())

    def op(self, target: Any, *args: Any, kind: str = "", queued_at: float | None = None) -> None:
        """One operation on a pool thread; one that raises is counted (its units are left to the
        dispatcher's lease, as a real worker's would be). ``queued_at``: when it was submitted (its
        wait for a thread is measured by ``kind``)."""
        if queued_at is not None:
            waited = time.perf_counter() - queued_at
            with self.lock:
                self.op_waits[kind].append(waited)
        try:
            target(*args)
        except Exception as exc:
            with self.lock:
                self.errors.append(f"{target.__name__}: {exc!r}")

    def take(self, w: SimWorker, message: PackMessage) -> None:
        with self.lock:
            if w.idle_from is not None:
                self.idle.append((w.idle_from, max(0.0, message.received_at - w.idle_from)))
                w.idle_from = None
        with w.ask_lock:  # before the claims, as PackRunner.run_pack
            w.asking = False
            self.rt.queue.asks.withdraw(w.model, w.name)
        urgent = set(message.urgent)
        claims = []
        for unit_id in message.unit_ids:
            t0 = time.perf_counter()
            at = time.time()
            claim = claim_unit(self.rt, unit_id, at, w.name, unit_id in urgent)
            spent = time.perf_counter() - t0
            with self.lock:
                if claim is None:
                    self.lost_claims += 1
                else:
                    if not claims:
                        self.asks.append((w.asked_at, at + spent - w.asked_at))
                    self.claims.append((unit_id, at, spent))
            if claim is not None:
                claims.append(claim)
        self.arrivals.put((w, claims))

    def finish(self, w: SimWorker, claim: Claim, started: float, seconds: float) -> None:
        n = claim.n_requests
        tally = UnitTally(n, 0, n * PROMPT_TOKENS, 0, n * OUTPUT_TOKENS)
        metering = {
            "engine_seconds": seconds,
            "cost_micros": 0,
            "cost_input_micros": 0,
            "cost_cached_micros": 0,
            "cost_output_micros": 0,
        }
        base = f"batches/{claim.batch_id}/units/{claim.seq:06d}.{claim.attempt}"
        t0 = time.perf_counter()
        at = time.time()
        ready = record_unit(
            self.rt,
            claim,
            at,
            tally,
            metering,
            output_key=f"{base}.output.jsonl",
            error_key=f"{base}.errors.jsonl",
            mean_fill=1.0,
        )
        recorded = time.perf_counter() - t0
        if ready is not None:
            unit_recorded(self.rt, claim, ready, w.model)
        refill = time.perf_counter() - t0 - recorded
        with self.lock:
            self.records.append(
                (claim.unit_id, at, recorded, refill, n if ready is not None else -1, int(claim.urgent))
            )
            w.busy_seconds += seconds
            if not w.sample[0]:
                w.sample[0] = started
            w.sample[1] += seconds
            w.sample[2] += n

    def beats(self) -> None:
        settings = self.rt.settings
        last_sample = time.time()
        while not self.stop.wait(settings.heartbeat_seconds):
            now = time.time()
            try:
                with self.lock:
                    held = [(c, UnitTally()) for w in self.workers for c in w.work]
                heartbeat(self.rt, held, now)
                for w in self.workers:  # PackRunner's watcher renews its ask with its heartbeats
                    self.renew(w, now)
                if now - last_sample >= settings.sample_seconds:
                    last_sample = now
                    self.write_samples()
            except Exception as exc:  # measured, not fatal: a missed beat is what leases are for
                self.errors.append(f"heartbeat: {exc!r}")

    def renew(self, w: SimWorker, now: float) -> None:
        """As ``PackFeed.ask(renewal=True)``: the ask of a worker still waiting is renewed, or
        made again if it lapsed (counted: a lapse means this process fell behind its heartbeats)."""
        with w.ask_lock:
            if not w.asking:
                return
            if self.rt.queue.asks.keep(w.model, w.name, now, self.rt.settings.ask_lifetime_seconds):
                with self.lock:
                    self.asks_lapsed += 1

    def write_samples(self) -> None:
        rows = []
        with self.lock:
            for w in self.workers:
                started, seconds, requests = w.sample
                if seconds > 0:
                    rows.append(
                        {
                            "worker": w.name,
                            "model": w.model,
                            "started_at": started,
                            "seconds": seconds,
                            "steps": max(1, int(seconds * 20)),
                            "running_mean": 64.0,
                            "waiting_mean": 0.0,
                            "max_num_seqs": 64,
                            "prompt_tokens": int(requests) * PROMPT_TOKENS,
                            "cached_tokens": 0,
                            "output_tokens": int(requests) * OUTPUT_TOKENS,
                            "requests": int(requests),
                        }
                    )
                w.sample = [0.0, 0.0, 0.0]
        if rows:
            with self.rt.db.write() as s:
                s.execute(insert(EngineSample), rows)

    def guarded(self, target: Any, *args: Any) -> None:
        """Run a thread's loop; one that raises is counted and run again."""
        while not self.stop.is_set():
            try:
                target(*args)
            except Exception as exc:
                with self.lock:
                    self.errors.append(f"{target.__name__}: {exc!r}")
            else:
                return

    def run(self) -> dict[str, Any]:
        threads = [
            threading.Thread(target=self.guarded, args=(self.fetcher, m), daemon=True) for m in self.hungry
        ]
        threads.append(threading.Thread(target=self.guarded, args=(self.clock,), daemon=True))
        threads.append(threading.Thread(target=self.guarded, args=(self.beats,), daemon=True))
        for t in threads:
            t.start()
        self.stop.wait()
        for t in threads:
            t.join(timeout=30)
        self.ops.shutdown(wait=True, cancel_futures=True)
        self.takes.shutdown(wait=True, cancel_futures=True)
        self.rt.db.dispose()
        return {
            "claims": self.claims,
            "lost_claims": self.lost_claims,
            "records": self.records,
            "pokes": self.pokes,
            "asks": self.asks,
            "op_waits": self.op_waits,
            "asks_lapsed": self.asks_lapsed,
            "idle": self.idle,
            "errors": self.errors[:50],
            "busy_seconds": {w.name: w.busy_seconds for w in self.workers},
            "workers": len(self.workers),
        }


def run_fleet(config: dict[str, Any], index: int, stop: Any, out: str) -> None:
    _dump(out, Fleet(config, index, stop).run())
