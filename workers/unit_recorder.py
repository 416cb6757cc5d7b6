"""The recorder: a finished unit's result spools uploaded and the unit recorded, once.

The engine loop hands it each unit whose every request has an outcome (or that stopped), on a
queue of its own, so no upload or database write runs on the engine's thread. A unit is recorded
compare-and-set on its claim (``workers.unit_claims.record_unit``): whatever else happened, its
results are recorded exactly once, and a lost claim's are discarded. A unit given back at shutdown
is released unrecorded. A database outage is retried for up to a lease.
"""

from __future__ import annotations

import logging
import queue
import time

from scheduler.utilization import ModelShape, utilization_columns
from storage.db import is_transient
from storage.runtime import Runtime
from workers import unit_spans
from workers.runner_state import ActiveUnit, RunnerState
from workers.unit_claims import record_unit, release_unit, unit_recorded

log = logging.getLogger(__name__)


class UnitRecorder:
    """See the module docstring. ``run`` is the thread's body; it ends on ``None`` in ``finished``."""

    def __init__(self, rt: Runtime, state: RunnerState, model: str, shape: ModelShape | None) -> None:
        self.rt = rt
        self.model = model
        self.shape = shape
        self._state = state
        self.finished: queue.Queue[ActiveUnit | None] = queue.Queue()  # units for the recorder

    def run(self) -> None:
        while True:
            unit = self.finished.get()
            if unit is None:
                return
            try:
                with unit_spans.recording(unit):
                    self._record_retrying(unit)
            except Exception:
                # the claim stays RUNNING without heartbeats: the dispatcher redelivers it
                log.exception("recording unit %s failed", unit.claim.unit_id)
            finally:
                self._state.forget(unit)

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
            release_unit(self.rt, claim)
            return
        base = f"batches/{claim.batch_id}/units/{claim.seq:06d}.{claim.attempt}"
        output_key, error_key = f"{base}.output.jsonl", f"{base}.errors.jsonl"
        results = []  # (key, bytes): charged to the tenant's stored bytes with the record
        for key, spool in ((output_key, unit.out), (error_key, unit.err)):
            spool.seek(0)
            results.append((key, self.rt.store.put_stream(key, spool)))
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
        utilization = utilization_columns(
            meter.work, meter.engine_seconds, round(meter.steps), self.shape, self.rt.settings.accelerator
        )
        ready = record_unit(
            self.rt,
            claim,
            now,
            tally,
            metering,
            results,
            output_key=output_key,
            error_key=error_key,
            mean_fill=fill,
            kv_tokens_read=meter.work.kv_tokens_read,
            **utilization,
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
