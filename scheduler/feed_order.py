"""The order an engine worker feeds its requests in: an elevator over prompt keys.

A worker's feed holds the not-yet-started requests of every pack it has claimed, from many jobs
and tenants. Packs arrive while earlier ones run: a job that passed validation seconds after
another reaches the worker while the first one's requests are still running. A first-in,
first-out feed would run the later pack's requests after the earlier pack's, so every shared
prefix that the KV cache could not keep would be computed once per pack. Instead the feed sweeps
upward through the key order, like a disk elevator:

* a request whose prompt is at or past the prompt started last joins the current sweep, next to
  its prefix-mates;
* a request whose prompt is behind it waits for the next sweep, where later arrivals with the same
  prefix meet it. (Letting it join prompts started earlier and still in the engine was tried and
  measured worse: the engine runs what it already holds first, so the late request reached a
  prefix the small KV cache had dropped, and the jobs after it no longer met in one sweep:
  in `tests/e2e/test_shared_prefix_jobs.py` three jobs reached 75.6% cache hits against 85.2% as
  one job, under the 90% of it the test asks.)
* urgent requests (their batch is at risk of missing its deadline) skip the elevator: they run
  first, in key order among themselves.

Keys are tuples, compared as tuples; their first ``prompt_fields`` fields name the prompt (the
rest only order the requests of one prompt, first in, first out), and their first
``domain_fields`` the cache domain. The worker uses (cache domain, prompt key, line, unit): a late
request of a running prompt joins it whatever its line number, and each cache domain (a tenant,
when prefix caches are per tenant) sweeps on its own. Domains take turns of up to ``quantum``
requests (the worker: one pack's worth) and up to ``turn_seconds`` from the turn's first request
while another domain waits: they share no cache entries,
so a turn separates no prefix-mates (the domains only share the cache's room), and a tenant whose packs keep arriving ahead of its cursor cannot hold
the engine while another tenant's requests wait. (Measured before the turns: in
`tests/e2e/test_urgent_share.py` a tenant's 8-request batch, packed early by the dispatcher's fair
share, waited behind 224 of the 352 flood requests left when it came, its domain sorting after
the flood's.) The time bound matters where a pack's worth of requests runs long: on a loaded CPU
engine a tenant's 8-request batch waited 12.9 s for another tenant's turn of 968 requests.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

Key = tuple[Any, ...]
# (key, arrival number, item): the arrival number breaks ties between equal keys (first in, first
# out) so items themselves are never compared
_Entry = tuple[Key, int, T]


class _Lane(Generic[T]):
    """One cache domain's elevator: its own sweep, cursor and waiting requests."""

    def __init__(self) -> None:
        self.ahead: list[_Entry[T]] = []  # this sweep: prompts at or past the cursor
        self.behind: list[_Entry[T]] = []  # the next sweep: prompts behind it
        self.cursor: Key | None = None  # the prompt started last; None: a sweep is about to start
        self.sweeps = 0

    def __len__(self) -> int:
        return len(self.ahead) + len(self.behind)

    def push(self, entry: _Entry[T], prompt: Key) -> None:
        if self.cursor is None or prompt >= self.cursor:
            heapq.heappush(self.ahead, entry)
        else:
            heapq.heappush(self.behind, entry)

    def pop(self) -> _Entry[T]:
        if not self.ahead:  # the sweep is over: the next one starts from the lowest key waiting
            self.ahead, self.behind = self.behind, []
            self.cursor = None
        if self.cursor is None:
            self.sweeps += 1
        return heapq.heappop(self.ahead)


class ElevatorFeed(Generic[T]):
    """Items pushed with a key, popped in elevator order (see the module docstring).

    ``domain_fields``: the key's first fields that name its cache domain (0: one domain). Each
    domain sweeps on its own, and the domains take turns: one keeps the turn while it has requests,
    up to ``quantum`` of them and ``turn_seconds`` from its first (``clock``'s seconds) while
    another domain waits (None: no such bound; both None: until it runs dry). Requests of
    different domains share nothing in the cache, so the turns cost no cache hits; without them a
    tenant whose packs keep arriving ahead of the cursor would hold the engine while another
    tenant's requests wait behind its whole stream."""

    def __init__(
        self,
        prompt_fields: int | None = None,
        domain_fields: int = 0,
        quantum: int | None = None,
        turn_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._prompt_fields = prompt_fields  # None: the whole key names the prompt
        self._domain_fields = domain_fields
        self._quantum = quantum
        self._turn_seconds = turn_seconds
        self._clock = clock
        self._urgent: list[_Entry[T]] = []
        self._lanes: dict[Key, _Lane[T]] = {}
        self._turns: deque[Key] = deque()  # domains with requests waiting; the first has the turn
        self._spent = 0  # requests the domain with the turn has started since it got it
        self._turn_began = 0.0  # when it started the first of them (clock's seconds)
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._urgent) + sum(len(lane) for lane in self._lanes.values())

    @property
    def sweeps(self) -> int:
        """Sweeps begun over all domains (a domain's elevator went back to its lowest key)."""
        return sum(lane.sweeps for lane in self._lanes.values())

    def lane_sweeps(self, domain: Key) -> int:
        lane = self._lanes.get(domain)
        return lane.sweeps if lane is not None else 0

    @property
    def urgent_waiting(self) -> bool:
        return bool(self._urgent)

    def prompt(self, key: Key) -> Key:
        return key if self._prompt_fields is None else key[: self._prompt_fields]

    def domain(self, key: Key) -> Key:
        return key[: self._domain_fields]

    def push(self, key: Key, item: T, *, urgent: bool = False) -> None:
        entry = (key, next(self._arrivals), item)
        if urgent:
            heapq.heappush(self._urgent, entry)
            return
        domain = self.domain(key)
        lane = self._lanes.setdefault(domain, _Lane())
        if not lane:
            self._turns.append(domain)
        lane.push(entry, self.prompt(key))

    def pop(self) -> T:
        """The next item: urgent ones first, then the current sweep of the domain whose turn it
        is; IndexError when empty. Urgent items do not move the sweeps."""
        if self._urgent:
            return heapq.heappop(self._urgent)[2]
        if not self._turns:
            raise IndexError("pop from an empty feed")
        if self._spent and len(self._turns) > 1 and self._turn_spent():
            self._turns.rotate(-1)  # the turn passes on; this domain waits at the back
            self._spent = 0
        if not self._spent and self._turn_seconds is not None:
            self._turn_began = self._clock()
        lane = self._lanes[self._turns[0]]
        key, _, item = lane.pop()
        lane.cursor = self.prompt(key)
        self._spent += 1
        if not lane:
            self._turns.popleft()
            self._spent = 0
        return item

    def _turn_spent(self) -> bool:
        if self._quantum is not None and self._spent >= self._quantum:
            return True
        return self._turn_seconds is not None and self._clock() - self._turn_began >= self._turn_seconds

    def remove_if(self, unwanted: Callable[[T], bool]) -> list[T]:
        """Take out every item for which ``unwanted`` is true (a stopped unit's requests); they are
        returned in the order they would have run."""
        removed: list[_Entry[T]] = []
        holder = self._turns[0] if self._turns else None
        heaps = [self._urgent, *(h for lane in self._lanes.values() for h in (lane.ahead, lane.behind))]
        for heap in heaps:
            keep = [e for e in heap if not unwanted(e[2])]
            if len(keep) != len(heap):
                removed.extend(sorted(e for e in heap if unwanted(e[2])))
                heap[:] = keep
                heapq.heapify(heap)
        for domain in [d for d in self._turns if not self._lanes[d]]:
            self._turns.remove(domain)
        if not self._turns or self._turns[0] != holder:
            self._spent = 0
        return [e[2] for e in removed]


def gather_deadline(
    first_waiting: float,
    last_pack: float,
    more_coming: bool,
    merge_seconds: float,
    settle_seconds: float,
    newest_batch: float | None = None,
) -> float:
    """When an idle engine holding less than its look-ahead starts (same clock as the arguments).

    ``first_waiting``: when it began waiting with requests in its feed; ``last_pack``: when the
    latest pack reached the feed; ``more_coming``: that pack's word that batches of the model were
    still validating; ``newest_batch``: that pack's word of when the newest batch of the model was
    created (None: not known). Then it waits up to ``merge_seconds`` from the first request: those
    batches are known. Otherwise it starts once ``settle_seconds`` have passed since the newest
    batch was created (jobs submitted together are created a fraction of a second apart, and a
    pack knows only of batches already created), or, not knowing when that was, since the last
    pack came; never later than the larger of the two windows after the first request (a steady
    trickle of packs cannot hold it). So a job alone whose validation took longer than the settle
    window starts at once: its burst, if it had one, would be validating already. A window of 0
    is off; both off, it starts at once."""
    if more_coming and merge_seconds > 0:
        return first_waiting + merge_seconds
    if settle_seconds <= 0:
        return first_waiting
    quiet_from = last_pack if newest_batch is None else min(last_pack, newest_batch)
    return max(
        first_waiting, min(quiet_from + settle_seconds, first_waiting + max(merge_seconds, settle_seconds))
    )
