"""What the parts of an engine worker's pack runner share: the units it holds and its lifecycle.

The feed (``workers/pack_feed.py``) adds the units it claims; the engine loop writes their results
to their spools; the recorder records them and forgets them; the watcher reads the list to check
and heartbeat the claims. One ``Condition`` guards the list and the feed's waiting requests: the
engine loop waits on it when it has nothing to run, ``run_pack`` while the feed is full.
"""

from __future__ import annotations

import tempfile
import threading
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

from workers.cost_meter import UnitMeter
from workers.unit_claims import Claim, UnitTally

if TYPE_CHECKING:
    from workers.unit_spans import UnitTrace


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
    trace: UnitTrace | None = None  # its spans while tracing is on (workers/unit_spans.py)

    @property
    def done(self) -> bool:
        return self.results >= self.total

    @property
    def stopping(self) -> bool:
        return self.reason is not None or self.lost or self.released


def new_spool() -> IO[bytes]:
    """A unit's result spool; closed by the recorder once the unit is recorded or dropped."""
    return tempfile.TemporaryFile()


class RunnerState:
    """The runner's books and flags, shared by its threads (see the module docstring)."""

    def __init__(self) -> None:
        # guards ``units`` here and the feed's requests and pack times (workers/pack_feed.py)
        self.lock = threading.Condition()
        # by claim token: a unit lost and claimed again by this process is two entries; guarded by lock
        self.units: dict[str, ActiveUnit] = {}
        self.closing = threading.Event()  # no more packs: the worker is shutting down
        self.stopped = threading.Event()  # the engine loop and the watcher end
        self.failure: BaseException | None = None  # what ended the engine loop: nothing more runs

    def hold(self, units: list[ActiveUnit]) -> None:
        with self.lock:
            for unit in units:
                self.units[unit.claim.token] = unit

    def forget(self, unit: ActiveUnit) -> None:
        """Drop a unit from the worker's books: its spools closed, its claim no longer
        heartbeated, and ``run_pack`` woken in case it waits for room."""
        unit.out.close()
        unit.err.close()
        with self.lock:
            self.units.pop(unit.claim.token, None)
            self.lock.notify_all()

    def held(self) -> list[ActiveUnit]:
        with self.lock:
            return list(self.units.values())

    def running(self) -> list[ActiveUnit]:
        """The units held and not stopping: the ones the watcher checks and heartbeats."""
        with self.lock:
            return [u for u in self.units.values() if not u.stopping]

    def busy(self) -> bool:
        with self.lock:
            return bool(self.units)

    def wake(self) -> None:
        with self.lock:
            self.lock.notify_all()
