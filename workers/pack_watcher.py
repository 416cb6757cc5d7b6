"""The watcher: every second (or every heartbeat, if that is shorter), what the database says
about the units an engine worker runs.

It reads unit and batch state (cancellation, expiry, a claim taken over) and hands a unit that
must stop to the engine loop, heartbeats the claims with their results so far, renews the
worker's ask for a pack while it waits, and writes the engine's fill and throughput samples
(``engine_samples``) with their utilization estimates. None of it runs on the engine's thread.
"""

from __future__ import annotations

import logging
import time

from sqlalchemy import select

from scheduler.cost import engine_cost_micros
from scheduler.utilization import ModelShape, utilization_columns
from storage.lifecycle import abort_reason
from storage.models import Batch, EngineSample, UnitStatus, WorkUnit
from storage.runtime import Runtime
from workers.engine_loop import EngineLoop
from workers.pack_feed import PackFeed
from workers.runner_state import ActiveUnit, RunnerState
from workers.stepped_engine import StepSample
from workers.unit_claims import heartbeat

log = logging.getLogger(__name__)

CHECK_SECONDS = 1.0  # how often the watcher reads unit/batch state (cancellation latency)


def check_period(heartbeat_seconds: float) -> float:
    """Seconds between the watcher's passes: a heartbeat shorter than a check is kept too. (It
    was not: passes a second apart renewed a 0.25 s heartbeat's claims once a second, and a
    2 s lease, a pass slowed a second under load, ran out in CI while the claims' rows were
    read through a store outage.)"""
    return min(CHECK_SECONDS, heartbeat_seconds)


class PackWatcher:
    """See the module docstring. ``run`` is the thread's body, until the runner stops."""

    def __init__(
        self,
        rt: Runtime,
        state: RunnerState,
        loop: EngineLoop,
        feed: PackFeed,
        worker: str,  # the stable name: the label of its samples (workers/identity.py)
        model: str,
        shape: ModelShape | None,
        price_per_hour: float,
        max_num_seqs: int,
    ) -> None:
        self.rt = rt
        self._state = state
        self._loop = loop
        self._feed = feed
        self.worker = worker
        self.model = model
        self.shape = shape
        self.price_per_hour = price_per_hour
        self.max_num_seqs = max_num_seqs

    def run(self) -> None:
        state = self._state
        last_beat = last_sample = last_ask = time.time()
        period = check_period(self.rt.settings.heartbeat_seconds)
        # a beat is due half a pass early: a pass as long as the heartbeat, its wait ending a hair
        # short on the wall clock, would otherwise skip every other beat
        beat_every = self.rt.settings.heartbeat_seconds - period / 2
        while not state.stopped.wait(period):
            try:
                now = time.time()
                # renewed with the heartbeats: an ask lapses only with its process (or a broker
                # that lost its data, which this brings back)
                if not state.closing.is_set() and now - last_ask >= beat_every:
                    last_ask = now
                    self._feed.ask(renewal=True)
                units = state.running()
                if units:
                    self._check(units)
                if units and state.failure is None and now - last_beat >= beat_every:
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
                self._loop.stops.put(unit)
                self._state.wake()

    def _heartbeat(self, units: list[ActiveUnit], now: float) -> None:
        """Renew the claims, with each unit's results so far: the API adds running units' counts
        to the batch's request_counts, and the console's throughput chart their output tokens (an
        embeddings batch's: input tokens), so both move within a unit, not only at its end."""
        heartbeat(self.rt, [(u.claim, u.tally) for u in units], now)

    def _flush_sample(self) -> None:
        sample = self._loop.take_sample()
        if sample.steps == 0 or sample.seconds <= 0:
            return  # idle periods are not samples: rates measure capacity while busy
        _log_kv_report(sample)
        utilization = utilization_columns(
            sample.work, sample.seconds, sample.steps, self.shape, self.rt.settings.accelerator
        )
        utilization.pop("model_parameters")
        utilization.pop("bytes_per_parameter")
        # no plan where admission is by count (FREIGHT_KV_ADMISSION off)
        planned = sample.planned_cached_tokens if self.rt.settings.kv_admission else None
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
                    max_num_seqs=self.max_num_seqs,
                    prompt_tokens=sample.prompt_tokens,
                    cached_tokens=sample.cached_tokens,
                    output_tokens=sample.output_tokens,
                    requests=sample.requests,
                    kv_tokens_read=sample.kv_tokens_read,
                    cost_micros=engine_cost_micros(sample.seconds, self.price_per_hour),
                    preemptions=sample.preemptions,
                    planned_cached_tokens=planned,
                    **utilization,
                )
            )


def _log_kv_report(sample: StepSample) -> None:
    """KV-aware admission's figures of the period (workers/kv_gate.py): vLLM's preemptions, and
    the prefix-cache hit rate of the requests finished against the plan's (the whole blocks each
    shares with the request handed over before it). A warning when vLLM preempted or the cache
    served more than a point less than planned; else at debug."""
    if not sample.prompt_tokens or not sample.planned_cached_tokens:
        if sample.preemptions:
            log.warning("engine sample: vLLM preempted %d requests", sample.preemptions)
        return
    measured = sample.cached_tokens / sample.prompt_tokens
    planned = sample.planned_cached_tokens / sample.prompt_tokens
    gap = 100 * (planned - measured)
    level = logging.WARNING if sample.preemptions or gap > 1.0 else logging.DEBUG
    log.log(
        level,
        "engine sample: %d preemptions; prefix-cache hits %.1f%% of prompt tokens, planned %.1f%% (gap %.1f points)",
        sample.preemptions or 0,  # None: not counted (a core in its own process)
        100 * measured,
        100 * planned,
        gap,
    )
