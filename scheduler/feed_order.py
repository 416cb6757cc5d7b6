"""The order an engine worker feeds its requests in: an elevator over prompt keys.

A worker's feed holds the not-yet-started requests of every pack it has claimed, from many jobs
and tenants. Packs arrive while earlier ones run: a job that passed validation seconds after
another reaches the worker while the first one's requests are still running. A first-in,
first-out feed would run the later pack's requests after the earlier pack's, so every shared
prefix that the KV cache could not keep would be computed once per pack. Instead the feed sweeps
upward through the key order, like a disk elevator:

* a request whose key is at or past the cursor (the key of the request started last) joins the
  current sweep, next to its prefix-mates;
* a request whose key is behind the cursor waits for the next sweep, where later arrivals with
  the same prefix meet it;
* urgent requests (their batch is at risk of missing its deadline) skip the elevator: they run
  first, in key order among themselves.

No request waits longer than one sweep, and a sweep holds no more than the feed, which the worker
bounds. Keys are tuples, compared as tuples: the worker uses (cache domain, prompt key, line), so
requests of different cache-sharing domains never interleave within a sweep.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# (key, arrival number, item): the arrival number breaks ties between equal keys (first in, first
# out) so items themselves are never compared
_Entry = tuple[tuple[Any, ...], int, T]


class ElevatorFeed(Generic[T]):
    """Items pushed with a key, popped in elevator order (see the module docstring)."""

    def __init__(self) -> None:
        self._urgent: list[_Entry[T]] = []
        self._ahead: list[_Entry[T]] = []  # this sweep: keys >= cursor
        self._behind: list[_Entry[T]] = []  # the next sweep: keys < cursor
        self._cursor: tuple[Any, ...] | None = None  # None: a sweep is about to start
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._urgent) + len(self._ahead) + len(self._behind)

    def push(self, key: tuple[Any, ...], item: T, *, urgent: bool = False) -> None:
        entry = (key, next(self._arrivals), item)
        if urgent:
            heapq.heappush(self._urgent, entry)
        elif self._cursor is None or key >= self._cursor:
            heapq.heappush(self._ahead, entry)
        else:
            heapq.heappush(self._behind, entry)

    def pop(self) -> T:
        """The next item: urgent ones first, then the current sweep; IndexError when empty."""
        if self._urgent:
            return heapq.heappop(self._urgent)[2]
        if not self._ahead:  # the sweep is over: the next one starts from the lowest key waiting
            self._ahead, self._behind = self._behind, []
            self._cursor = None
        key, _, item = heapq.heappop(self._ahead)
        self._cursor = key
        return item

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
