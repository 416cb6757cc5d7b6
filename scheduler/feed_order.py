"""The order an engine worker feeds its requests in: an elevator over prompt keys.

A worker's feed holds the not-yet-started requests of every pack it has claimed, from many jobs
and tenants. Packs arrive while earlier ones run: a job that passed validation seconds after
another reaches the worker while the first one's requests are still running. A first-in,
first-out feed would run the later pack's requests after the earlier pack's, so every shared
prefix that the KV cache could not keep would be computed once per pack. Instead the feed sweeps
upward through the key order, like a disk elevator:

* a request whose prompt is at or past the sweep's trailing edge joins the current sweep, next to
  its prefix-mates. The trailing edge is the prompt started last, or lower: the lowest prompt
  among the requests this feed started that have not finished (the caller reports them with
  `done`), whose prefixes the KV cache holds for the requests using them, so a late arrival
  sharing one is computed from cache;
* a request whose prompt is behind the edge waits for the next sweep, where later arrivals with
  the same prefix meet it;
* urgent requests (their batch is at risk of missing its deadline) skip the elevator: they run
  first, in key order among themselves.

Keys are tuples, compared as tuples; their first ``prompt_fields`` fields name the prompt (the
rest only order the requests of one prompt, first in, first out). The worker uses (cache domain,
prompt key, line, unit), so requests of different cache-sharing domains never interleave within
a sweep, and a late request of a running prompt joins it whatever its line number.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

Key = tuple[Any, ...]
# (key, arrival number, item): the arrival number breaks ties between equal keys (first in, first
# out) so items themselves are never compared
_Entry = tuple[Key, int, T]


class ElevatorFeed(Generic[T]):
    """Items pushed with a key, popped in elevator order (see the module docstring)."""

    def __init__(self, prompt_fields: int | None = None) -> None:
        self._prompt_fields = prompt_fields  # None: the whole key names the prompt
        self._urgent: list[_Entry[T]] = []
        self._ahead: list[_Entry[T]] = []  # this sweep: prompts at or past the trailing edge
        self._behind: list[_Entry[T]] = []  # the next sweep: prompts behind it
        self._cursor: Key | None = None  # the prompt started last; None: a sweep is about to start
        self._arrivals = itertools.count()
        self.sweeps = 0  # sweeps begun (the elevator went back to the lowest key waiting)
        # prompts of started, unfinished requests: a count per prompt and a heap of them whose
        # entries are dropped lazily once their count is zero (the heap's top is the trailing edge)
        self._started: Counter[Key] = Counter()
        self._started_heap: list[Key] = []

    def __len__(self) -> int:
        return len(self._urgent) + len(self._ahead) + len(self._behind)

    @property
    def urgent_waiting(self) -> bool:
        return bool(self._urgent)

    def prompt(self, key: Key) -> Key:
        return key if self._prompt_fields is None else key[: self._prompt_fields]

    @property
    def trailing_edge(self) -> Key | None:
        """The lowest prompt a newcomer may have to join this sweep (None: anything joins)."""
        heap = self._started_heap
        while heap and self._started[heap[0]] <= 0:
            self._started.pop(heapq.heappop(heap), None)
        if self._cursor is None:
            return None
        return min(heap[0], self._cursor) if heap else self._cursor

    def push(self, key: Key, item: T, *, urgent: bool = False) -> None:
        entry = (key, next(self._arrivals), item)
        if urgent:
            heapq.heappush(self._urgent, entry)
            return
        edge = self.trailing_edge
        if edge is None or self.prompt(key) >= edge:
            heapq.heappush(self._ahead, entry)
        else:
            heapq.heappush(self._behind, entry)

    def pop(self) -> T:
        """The next item: urgent ones first, then the current sweep; IndexError when empty.

        A popped item counts as started (holding its prompt's prefix) until `done` is called with
        its key; urgent items do not move the sweep."""
        if self._urgent:
            return heapq.heappop(self._urgent)[2]
        if not self._ahead:  # the sweep is over: the next one starts from the lowest key waiting
            self._ahead, self._behind = self._behind, []
            self._cursor = None
        if self._cursor is None:
            self.sweeps += 1
        key, _, item = heapq.heappop(self._ahead)
        prompt = self.prompt(key)
        self._cursor = prompt
        if self._started[prompt] <= 0:  # (a stale heap entry for it may remain: dropped lazily)
            heapq.heappush(self._started_heap, prompt)
        self._started[prompt] += 1
        return item

    def done(self, key: Key) -> None:
        """A request popped with ``key`` has finished (or was stopped): its prompt no longer holds
        the sweep's trailing edge. Keys never popped, or popped as urgent, are ignored."""
        prompt = self.prompt(key)
        if self._started.get(prompt, 0) > 0:
            self._started[prompt] -= 1

    def remove_if(self, unwanted: Callable[[T], bool]) -> list[T]:
        """Take out every item for which ``unwanted`` is true (a stopped unit's requests); they are
        returned in the order they would have run."""
        removed: list[_Entry[T]] = []
        for heap in (self._urgent, self._ahead, self._behind):
            keep = [e for e in heap if not unwanted(e[2])]
            if len(keep) != len(heap):
                removed.extend(sorted(e for e in heap if unwanted(e[2])))
                heap[:] = keep
                heapq.heapify(heap)
        return [e[2] for e in removed]
