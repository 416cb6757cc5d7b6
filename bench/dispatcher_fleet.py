"""The processes of the fleet-scale dispatcher benchmark: the dispatcher's tick loop, and fleet
processes that each drive many simulated engine workers.

A simulated worker is a thread that does an engine worker's database and broker work and nothing
else: it takes pack messages off its model's real Redis queue (the ones ``enqueue_units`` sent),
claims their units with ``workers.execution.claim_unit``, "runs" them for a modelled time (a unit's
requests at ``worker_rps``, one unit after another), records each through
``workers.execution.record_unit`` and ``unit_recorded`` (which refills the queue, as an engine
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
import json
import queue
import threading
import time
from collections import deque
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
from workers.execution import Claim, UnitTally, claim_unit, heartbeat, record_unit, unit_recorded


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
    pack_id, unit_ids, _more_coming, urgent = body[0]
    return PackMessage(pack_id, list(unit_ids), list(urgent or ()), time.time())


@dataclass
class SimWorker:
    name: str
    model: str
    rps: float  # modelled requests per second of its engine
    inbox: queue.Queue[PackMessage | None] = field(default_factory=queue.Queue)
    work: deque[Claim] = field(default_factory=deque)  # claimed, not yet recorded (first: running)
    running_since: float | None = None
    asked: bool = False  # its request for a pack is with the fetcher
    busy_seconds: float = 0.0  # modelled engine time of the units it finished
    sample: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # started, seconds, requests

    def waiting(self) -> int:
        """Requests claimed and not started (the feed): the running unit is the engine's."""
        return sum(c.n_requests for c in self.work) - (self.work[0].n_requests if self.running_since else 0)


class Fleet:
    """One process's simulated workers, its pack fetchers (one per model: a Redis BRPOP for the
    next hungry worker) and its heartbeat/sample thread."""

    def __init__(self, config: dict[str, Any], index: int, stop: Any) -> None:
        self.config = config
        self.rt = runtime(config)
        # the run's stop is a multiprocessing Event: every is_set() takes its lock, shared by every
        # process of the run. A thousand worker threads asking it in their loops made a lock
        # convoy on a loaded box, in which the dispatcher's process waited 10-30 s between
        # ticks for the same lock. The threads ask a process-local event; one thread waits on
        # the run's and sets it
        self.stop = threading.Event()
        threading.Thread(target=lambda: (stop.wait(), self.stop.set()), daemon=True).start()
        self.lock = threading.Lock()
        self.look_ahead = self.rt.settings.pack_requests
        models = config["models"]
        first, count = config["fleet_slices"][index]
        self.workers = [
            SimWorker(f"sim{index}-{i}", models[i % len(models)], config["worker_rps"])
            for i in range(first, first + count)
        ]
        self.hungry: dict[str, queue.Queue[SimWorker]] = {m: queue.Queue() for m in models}
        # measurements, each (time, value...) appended under self.lock
        self.claims: list[tuple[int, float, float]] = []  # unit, at, claim_unit's seconds
        self.lost_claims = 0
        self.records: list[tuple[int, float, float, float, int]] = []  # unit, at, record s, refill s, n
        self.pokes: list[float] = []  # the refill after a pack is taken (tasks.run_pack's poke)
        self.idle: list[tuple[float, float]] = []  # (from, seconds): a worker with nothing to run
        self.errors: list[str] = []

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
                    worker.inbox.put(decode(item[1]))
                    break
        for worker in self.workers:
            worker.inbox.put(None)

    def run_worker(self, w: SimWorker) -> None:
        idle_from: float | None = time.time()
        while not self.stop.is_set():
            if not w.asked and w.waiting() <= self.look_ahead:
                w.asked = True
                self.hungry[w.model].put(w)
            now = time.time()
            if w.work and w.running_since is None:
                w.running_since = now
            finish = w.running_since + w.work[0].n_requests / w.rps if w.work and w.running_since else None
            timeout = 1.0 if finish is None else max(0.0, min(1.0, finish - now))
            try:
                message = w.inbox.get(timeout=timeout)
            except queue.Empty:
                message = None
            if message is not None:
                w.asked = False
                if idle_from is not None:
                    with self.lock:
                        self.idle.append((idle_from, max(0.0, message.received_at - idle_from)))
                    idle_from = None
                self.take(w, message)
            if finish is not None and time.time() >= finish:
                with self.lock:  # the heartbeat thread reads the deques
                    done = w.work.popleft()
                self.finish(w, done, w.running_since or finish)
                w.running_since = finish if w.work else None
                if not w.work:
                    idle_from = time.time()

    def take(self, w: SimWorker, message: PackMessage) -> None:
        urgent = set(message.urgent)
        for unit_id in message.unit_ids:
            t0 = time.perf_counter()
            at = time.time()
            claim = claim_unit(self.rt, unit_id, at, w.name, unit_id in urgent)
            spent = time.perf_counter() - t0
            if claim is None:
                with self.lock:
                    self.lost_claims += 1
                continue
            with self.lock:
                w.work.append(claim)
                self.claims.append((unit_id, at, spent))
        t0 = time.perf_counter()
        dispatcher.enqueue_units(self.rt, time.time(), dispatcher.TickReport(), model=w.model)  # tasks.poke
        with self.lock:
            self.pokes.append(time.perf_counter() - t0)

    def finish(self, w: SimWorker, claim: Claim, started: float) -> None:
        n = claim.n_requests
        seconds = n / w.rps
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
            self.records.append((claim.unit_id, at, recorded, refill, n if ready is not None else -1))
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
                if now - last_sample >= settings.sample_seconds:
                    last_sample = now
                    self.write_samples()
            except Exception as exc:  # measured, not fatal: a missed beat is what leases are for
                self.errors.append(f"heartbeat: {exc!r}")

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
        """Run a thread's loop; one that raises is counted and run again (a worker whose pack
        failed goes on, its units left to the dispatcher's lease, as a real worker's would be)."""
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
        threads += [
            threading.Thread(target=self.guarded, args=(self.run_worker, w), daemon=True)
            for w in self.workers
        ]
        threads.append(threading.Thread(target=self.guarded, args=(self.beats,), daemon=True))
        for t in threads:
            t.start()
        self.stop.wait()
        for t in threads:
            t.join(timeout=30)
        self.rt.db.dispose()
        return {
            "claims": self.claims,
            "lost_claims": self.lost_claims,
            "records": self.records,
            "pokes": self.pokes,
            "idle": self.idle,
            "errors": self.errors[:50],
            "busy_seconds": {w.name: w.busy_seconds for w in self.workers},
            "workers": len(self.workers),
        }


def run_fleet(config: dict[str, Any], index: int, stop: Any, out: str) -> None:
    _dump(out, Fleet(config, index, stop).run())
