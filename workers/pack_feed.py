"""The engine worker's feed: packs claimed, their requests merged in prefix order, asks for more.

``run_pack`` (on Celery's thread) claims a pack's units, reads their rows and pushes them onto the
feed, an elevator over prompt keys (``scheduler.feed_order``) that the engine loop pops from. It
returns once no more requests wait than the look-ahead, so Celery delivers the next pack while the
engine still has work. Between packs the worker's ask (``storage.broker``) tells the dispatcher it
takes one next; an idle engine waits a moment for packs of jobs submitted together
(``gathering``), so their shared prefixes run once.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.feed_order import ElevatorFeed, gather_deadline
from storage.runtime import Runtime
from storage.shards import ShardRow, read_rows
from workers import task_policy, unit_spans
from workers.images import ImageCache
from workers.media_files import AudioCache
from workers.runner_state import ActiveUnit, RunnerState, new_spool
from workers.unit_claims import claim_unit, release_unit

log = logging.getLogger(__name__)

IDLE_WAIT_SECONDS = 0.2
# the feed's keys: (cache domain, prompt key, line, unit id); the first two name the prompt
FeedKey = tuple[str, bytes, int, int]
FEED_PROMPT_FIELDS = 2


@dataclass(frozen=True)
class PackOrder:
    """A ``freight.run_pack`` message as the worker reads it (``storage.broker.Queue.run_pack``
    sends its fields): the pack's units and the dispatcher's word on what else may come.

    ``more_coming``: the dispatcher knew of work that may be of this model on its way to the
    pack's cache domains (batches validating, batch files not yet named by a batch:
    ``workers/arrivals.py``);
    ``urgent``: the units run ahead of the elevator; ``newest_batch_at``: when the newest batch of
    the model it saw was created (epoch seconds; None: not known). The latest pack's word decides
    how long an idle engine waits for more (``PackFeed.gathering``)."""

    pack_id: str
    unit_ids: list[int]
    more_coming: bool = False
    urgent: Iterable[int] = ()
    newest_batch_at: float | None = None


def feed_key(unit: ActiveUnit, row: ShardRow) -> FeedKey:
    return (unit.claim.cache_domain, row.key, row.line, unit.claim.unit_id)


class PackFeed:
    """Claims, the elevator feed and the ask for the next pack; see the module docstring."""

    def __init__(
        self,
        rt: Runtime,
        state: RunnerState,
        finished: queue.Queue[ActiveUnit | None],  # the recorder's: a unit with no rows is done at once
        model: str,
        holder: str,
        max_num_seqs: int,
    ) -> None:
        self.rt = rt
        self.images = ImageCache(rt)  # the images of chat lines, decoded once (workers/images.py)
        self.audio = AudioCache(rt)  # audio lines' stored audio (workers/media_files.py)
        self.model = model
        self.holder = holder
        self._state = state
        self._lock = state.lock
        self._finished = finished
        # not-yet-started requests of every claimed unit, in elevator order; guarded by the lock
        self.requests: ElevatorFeed[tuple[ActiveUnit, ShardRow]] = ElevatorFeed(
            prompt_fields=FEED_PROMPT_FIELDS,
            domain_fields=1,
            quantum=rt.settings.pack_requests,
            turn_seconds=rt.settings.feed_turn_seconds or None,
        )
        # the next pack is wanted once no more requests wait than this look-ahead (at least the
        # engine's batch): a later job then reaches the feed while its prefix-mates still run
        self.high_water = max(max_num_seqs, rt.settings.feed_requests or rt.settings.pack_requests)
        self._last_pack_at = 0.0  # the last pack's requests reached the feed (monotonic; guarded by the lock)
        self._more_coming = False  # the last pack's: other batches were validating (guarded by the lock)
        # the last pack's: when the newest batch of the model was created, on the monotonic clock
        # (None: not said); the settle window counts from it (guarded by the lock)
        self._newest_batch_at: float | None = None
        # when an idle engine last started on the feed's requests (monotonic; guarded by the lock):
        # requests that waited once are not waited for again, whatever the last pack said
        self._started_at = -math.inf
        # this process waits for a pack (its ask, renewed by the watcher); guarded by _ask_lock, held
        # over the broker call so a renewal never lands after the withdrawal that a claim makes
        self._asking = False
        self._ask_lock = threading.Lock()

    def run_pack(self, order: PackOrder) -> int:
        """Claim the pack's units, put their requests on the feed in prefix order, and return
        once the feed is low enough that the engine needs the next pack. Returns units claimed."""
        state = self._state
        if state.closing.is_set():
            return 0
        self.withdraw_ask()  # before the claims: see dispatcher.pack_model on the order
        try:
            return self._feed_pack(order)
        finally:
            # whatever became of this pack, the worker takes the next message now: it waits for a
            # pack, so one is made for it (the task's refill right after this, or the next tick)
            if not state.closing.is_set() and state.failure is None:
                self.ask()

    def _feed_pack(self, order: PackOrder) -> int:
        pack_id, more_coming, newest_batch_at = order.pack_id, order.more_coming, order.newest_batch_at
        hurry = set(order.urgent)
        units: list[ActiveUnit] = []
        for u in order.unit_ids:
            started = time.time()
            if (c := claim_unit(self.rt, u, started, self.holder, u in hurry, pack_id)) is not None:
                units.append(ActiveUnit(c, new_spool(), new_spool(), c.n_requests))
                units[-1].trace = unit_spans.claimed(c, self.model, started)
        if not units:
            return 0
        # on the watcher's list from the claim: heartbeated while their rows are read
        self._state.hold(units)
        try:
            rows = [
                list(read_rows(self.rt.store, u.claim.shard_key, u.claim.row_start, u.claim.n_requests))
                for u in units
            ]
            for unit, unit_rows in zip(units, rows, strict=True):  # off the engine loop's thread
                self.images.prefetch(unit.claim.batch_id, (row.body_json for row in unit_rows))
                self.audio.prefetch(unit.claim.batch_id, (row.body_json for row in unit_rows))
        except Exception as exc:
            self._give_back_unread(units, exc)
            raise
        with self._lock:
            self._more_coming = more_coming
            self._last_pack_at = time.monotonic()
            # its age on this host's wall clock, on the monotonic one (a clock behind the
            # creator's reads age 0: the window then counts from this pack, as without the word)
            self._newest_batch_at = (
                None
                if newest_batch_at is None
                else self._last_pack_at - max(0.0, time.time() - newest_batch_at)
            )
            for unit, unit_rows in zip(units, rows, strict=True):
                unit.total = len(unit_rows)
                if unit.total == 0:
                    self._finished.put(unit)
                # each shard is prefix-sorted already; the feed merges them with every request
                # waiting from earlier packs, whatever batch or tenant (see scheduler.feed_order)
                for row in unit_rows:
                    self.requests.push(feed_key(unit, row), (unit, row), urgent=unit.claim.urgent)
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
        state = self._state
        with self._lock:
            while (
                len(self.requests) > self.high_water and not state.closing.is_set() and state.failure is None
            ):
                self._lock.wait(1.0)
        if state.failure is not None:
            raise RuntimeError("the engine loop failed") from state.failure
        return len(units)

    def _give_back_unread(self, units: list[ActiveUnit], exc: Exception) -> None:
        """The pack's rows could not be read. An outage of the store (the reads retried for as long
        as the store's retry policy allows): the units go back to pending with the attempt not
        counted, for the dispatcher to pack again, so an outage never uses up a unit's attempts.
        Anything else is the pack's fault: the units stay claimed for the task's exception policy
        to fail (``task_policy.fail_pack``)."""
        for unit in units:
            self._state.forget(unit)
        if not task_policy.is_transient(exc):
            return
        for unit in units:
            try:
                release_unit(self.rt, unit.claim, f"because its rows could not be read: {exc}")
            except Exception:
                log.exception("giving unit %s back failed; its lease will expire", unit.claim.unit_id)

    def ask(self, renewal: bool = False) -> None:
        """Tell the dispatcher this process takes a pack of its model next (storage.broker's asks).
        ``renewal``: only if it still waits, and asking afresh only if the broker lost the ask. A
        failure is only logged: the watcher asks again within a heartbeat."""
        settings = self.rt.settings
        with self._ask_lock:
            if renewal and not self._asking:
                return
            self._asking = True
            try:
                ask = self.rt.queue.asks.keep if renewal else self.rt.queue.asks.add
                ask(self.model, self.holder, time.time(), settings.ask_lifetime_seconds)
            except Exception:
                log.warning("asking for a pack failed; asking again with the next heartbeat", exc_info=True)

    def withdraw_ask(self) -> None:
        with self._ask_lock:
            self._asking = False
            try:
                self.rt.queue.asks.withdraw(self.model, self.holder)
            except Exception:  # the ask lapses by itself: at worst one pack is made that waits
                log.warning("withdrawing the ask for a pack failed", exc_info=True)

    def gathering(self, since: float | None) -> tuple[bool, float | None]:
        """Whether an idle engine should wait a moment more for packs before it starts: never
        once the feed holds the look-ahead or anything urgent, nor when no pack came since it last
        started (its requests had their wait: an engine emptied by the KV gate, its next requests
        held back until the last ones finished, found them waiting and, on a pack's stale word that
        more would come, waited the merge window again before each start); else until
        ``scheduler.feed_order.gather_deadline`` (which says when, and why). Without the wait, jobs
        of one model submitted together run apart, and the prefixes the late ones share with the
        first are computed again once the KV cache has dropped them (issue #24).

        ``since``: when the idle engine began waiting for packs (monotonic; None: it has not yet);
        returned with the answer, set to now once requests are waiting (the engine loop logs each
        idle start with the wait it took, 0.00 s for a job with nothing on its way). Called by the engine loop only while
        the engine is empty, never per request or per step."""
        merge = self.rt.settings.feed_merge_seconds
        settle = self.rt.settings.feed_settle_seconds
        with self._lock:
            if not self.requests:
                return False, since
            now = time.monotonic()
            if since is None:  # requests are waiting: the engine starts now, or once this returns False
                since = now
            until = gather_deadline(
                since, self._last_pack_at, self._more_coming, merge, settle, self._newest_batch_at
            )
            if (
                self._last_pack_at <= self._started_at  # no pack since the engine last started
                or self.requests.urgent_waiting
                or len(self.requests) >= self.high_water
                or self._state.closing.is_set()
                or now >= until
            ):
                self._started_at = now
                return False, since
            self._lock.wait(min(IDLE_WAIT_SECONDS, until - now))
            return True, since
