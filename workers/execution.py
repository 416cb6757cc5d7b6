"""Running packs of work units on one warm engine, fed continuously.

An engine worker holds one `PackRunner`. Celery hands it packs (units of one model from any
batches); `run_pack` claims the units, merges their requests in prompt-prefix order onto the
runner's feed, and returns as soon as the feed runs low, so Celery delivers the next pack while
the engine still has work: the running batch never drains at a unit or pack boundary.

The runner wires four parts, each a module that owns its state, and three threads besides
Celery's:

* the **feed and asks** (``workers/pack_feed.py``, on Celery's thread): claims, the elevator feed,
  the give-back of units whose rows could not be read, the ask for the next pack;
* the **engine loop** (``workers/engine_loop.py``, its own thread) owns the engine: tops it up to
  its window from the feed, steps it, routes each result to its unit's spool files, and samples
  the batch fill;
* the **watcher** (``workers/pack_watcher.py``) reads unit and batch state every second
  (cancellation, expiry, a claim taken over), heartbeats the claims, renews the ask and writes the
  fill/throughput samples;
* the **recorder** (``workers/unit_recorder.py``) uploads a finished unit's result files and
  records it, compare-and-set on the claim (``workers/unit_claims.py``), so a unit's results are
  recorded exactly once whatever else happened.

They share the units held and one lock (``workers/runner_state.py``). A worker that dies records
nothing: its units' heartbeats go stale and the dispatcher queues them again. Results are keyed by
``custom_id``, never by position, so the order of running is free.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from storage.runtime import Runtime
from workers.checkpoint import model_shape
from workers.cost_meter import CostMeter
from workers.engine import Engine, EngineConfig
from workers.engine_loop import EngineLoop
from workers.identity import holder_id, new_incarnation
from workers.lora import LoraAdapters
from workers.pack_feed import PackFeed, PackOrder
from workers.pack_watcher import PackWatcher
from workers.runner_state import RunnerState
from workers.unit_claims import release_unit
from workers.unit_recorder import UnitRecorder

if TYPE_CHECKING:
    from workers.lora_refit import LoraRefit

log = logging.getLogger(__name__)


def _exit_process() -> None:
    """A worker whose engine died cannot serve its queue: exit so the supervisor restarts it."""
    logging.shutdown()
    os._exit(70)


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
        self.shape = model_shape(engine.config.model_path, served_dtype=engine.dtype)
        max_num_seqs = engine.config.max_num_seqs
        self._state = state = RunnerState()
        self.recorder = UnitRecorder(rt, state, model, self.shape)
        self.feed = PackFeed(rt, state, self.recorder.finished, model, self.holder, max_num_seqs)
        meter = CostMeter(self.price_per_hour, rt.settings.sample_seconds)
        self.loop = EngineLoop(engine, state, self.feed, self.recorder.finished, meter, self._engine_failed)
        self.watcher = PackWatcher(
            rt, state, self.loop, self.feed, worker, model, self.shape, self.price_per_hour, max_num_seqs
        )
        self._threads: list[threading.Thread] = []
        self.on_fatal: Callable[[], None] = _exit_process
        # how this worker starts an engine (workers.bootstrap's: vLLM's logs through Freight's)
        self.start_engine: Callable[[EngineConfig], Engine] = Engine.start
        # restarts the engine for adapters of its base it cannot serve (workers/lora_refit.py)
        self.lora_refit: LoraRefit | None = None

    @property
    def failure(self) -> BaseException | None:
        """What ended the engine loop (None while it runs): nothing more runs in this process."""
        return self._state.failure

    def start(self) -> PackRunner:
        for name, target in (
            ("engine", self.loop.run),
            ("watcher", self.watcher.run),
            ("recorder", self.recorder.run),
        ):
            thread = threading.Thread(target=target, name=f"freight-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self.feed.ask()  # an engine up and idle: the next tick makes it a pack
        return self

    def run_pack(self, order: PackOrder) -> int:
        """See ``PackFeed.run_pack``: claims the pack's units, feeds their requests, and returns
        the units claimed once the engine needs the next pack. First, an engine that cannot
        serve its base's adapters restarts (``workers/lora_refit.py``)."""
        if self.lora_refit is not None and not self._state.closing.is_set():
            try:
                self.lora_refit.before_pack(self)
            except Exception:
                if self.failure is not None:  # no engine any more: the pack fails as when it dies
                    raise
                # the registry unread (the claims that follow meet the same outage their own way)
                log.exception(
                    "checking %s's adapters before pack %s failed; running it as is",
                    self.model,
                    order.pack_id,
                )
        return self.feed.run_pack(order)

    def restart_engine(self, config: EngineConfig, loras: LoraAdapters | None, why: str) -> bool:
        """Replace the engine by one started with ``config`` at a safe point: no ask out, every
        unit held recorded (or handed back), the engine loop parked. On Celery's thread, the one
        that started the first engine and lives as long as the worker (workers/engine_lifetime.py).
        A new engine that does not start is logged and the old configuration started again
        (False); if that fails too, the worker ends as when its engine dies."""
        state = self._state
        self.feed.withdraw_ask()  # no pack is made for this worker meanwhile
        held = len(state.held())
        log.info("restarting the engine: %s; first the %d units it holds finish", why, held)
        waited = time.monotonic()
        with state.lock:
            while state.units and state.failure is None and not state.stopped.is_set():
                state.lock.wait(1.0)
        if state.failure is not None or state.stopped.is_set() or not self.loop.park():
            return False
        old, started = self.engine, time.monotonic()
        try:
            old.shutdown()
            try:
                engine, restarted = self.start_engine(config), True
                engine.loras = loras
            except Exception:
                log.exception("the engine did not restart with %s; starting it as it was", why)
                engine, restarted = self.start_engine(old.config), False
                engine.loras = old.loras
        except BaseException as exc:  # no engine: as if it died
            self._engine_failed(exc)
            raise
        self.engine = engine
        self.loop.resume(engine)
        log.info(
            "engine %s in %.1f s after %.1f s waiting for its units: %s",
            "restarted" if restarted else "started again as it was",
            time.monotonic() - started,
            started - waited,
            why,
        )
        return restarted

    def busy(self) -> bool:
        return self._state.busy()

    def close(self, drain_seconds: float) -> None:
        """Stop taking packs; let running units finish for ``drain_seconds``, then give the rest
        back to the dispatcher unrecorded (their requests run again elsewhere, exactly once)."""
        state = self._state
        state.closing.set()
        self.feed.withdraw_ask()
        deadline = time.monotonic() + drain_seconds
        while self.busy() and time.monotonic() < deadline and self.failure is None:
            time.sleep(0.2)
        for unit in state.held():
            unit.released = True
            self.loop.stops.put(unit)
        deadline = time.monotonic() + 10
        while self.busy() and time.monotonic() < deadline and self.failure is None:
            time.sleep(0.1)
        state.stopped.set()
        self.recorder.finished.put(None)
        state.wake()
        for thread in self._threads:
            thread.join(timeout=10)

    def _engine_failed(self, exc: BaseException) -> None:
        """The engine loop died (on its thread): no more packs are fed, the units held go back
        to pending unrecorded, and the process ends (``on_fatal``)."""
        state = self._state
        state.failure = exc
        units = state.held()
        state.wake()
        for unit in units:
            try:
                release_unit(self.rt, unit.claim)
            except Exception:
                log.exception("releasing unit %s failed; its lease will expire", unit.claim.unit_id)
        self.on_fatal()
