"""Duplicate request lines on the engine worker: one engine run, a result line for each.

A line whose request is identical and deterministic (``scheduler.duplicate_requests``) to one
the engine is running right now does not go into the engine: it waits on that run, and when the
run finishes the engine loop writes the same answer (or the same request error) to each waiting
line, each under its own result line id, request id and response id, marked in the body's
``x_freight.copy``. The feed pops requests in prompt-key order, so a job's duplicates leave it one
after another while the first of them runs; jobs of one scope meet the same way when their packs
are on the feed together. A line whose request finished a moment ago (the run was over when it
left the feed) copies that result from a small bounded memory of recent successes instead.

Why no result is lost or duplicated: a copy is written to its own unit's spool like any result, so
a unit is still recorded once, by its claim, with every line's result (``workers/unit_recorder``).
If the worker dies, every unit it held is redelivered and runs again, copies included. If the
unit of the run's own line stops (its batch cancelled or expired, the claim lost, the worker
releasing it), the run is handed to a waiting line of a unit that goes on instead of being
aborted; a stopping unit's waiting lines get their stopped lines at once.

Cost: a copy's engine work is zero (the engine did none), so the cost meter gives it no engine
time or cost; the line that ran is metered as any line. Its usage (the answer's tokens) is in its
body and in its batch's usage like any answered line's. See docs/usage.md "Duplicate lines".

All of it runs on the engine loop's thread.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from scheduler.duplicate_requests import RequestKey, request_key
from workers.engine import EngineResult
from workers.runner_state import ActiveUnit
from workers.unit_claims import Claim

SHARED_RUN = "shared_run"  # x_freight.copy: the line waited on the same request's run
RECENT_RESULT = "recent_result"  # x_freight.copy: the same request had just finished
RECENT_RESULTS = 1024  # successes remembered for lines that leave the feed just after their run
RECENT_BYTES = 8 * 1024 * 1024  # of their result lines as written and their request bodies

Waiter = tuple[ActiveUnit, str]  # a line waiting on a run: its unit and custom_id


def copied_body(body: dict[str, Any], source: str) -> dict[str, Any]:
    """A copy of an answer for another line: its own response id (same prefix), marked."""
    copy = dict(body)
    old = body.get("id")
    if isinstance(old, str):
        cut = max(old.rfind("-"), old.rfind("_"))
        copy["id"] = old[: cut + 1] + uuid.uuid4().hex
    extra = body.get("x_freight")
    copy["x_freight"] = {**(extra if isinstance(extra, dict) else {}), "copy": source}
    return copy


def copied_result(result: EngineResult, source: str) -> EngineResult:
    if result.body is None:
        return result
    return replace(result, body=copied_body(result.body, source))


class DuplicateLines:
    """The runs duplicates wait on and the recent results they may copy (see the module)."""

    def __init__(self, recent_results: int = RECENT_RESULTS, recent_bytes: int = RECENT_BYTES) -> None:
        self._running: dict[RequestKey, str] = {}  # request key -> engine key of its run
        self._request_of: dict[str, RequestKey] = {}  # engine key -> request key
        self._waiting: dict[str, list[Waiter]] = {}  # engine key -> lines waiting on its result
        self._recent: OrderedDict[RequestKey, tuple[EngineResult, int]] = OrderedDict()  # LRU, with sizes
        self._recent_limit = recent_results
        self._recent_limit_bytes = recent_bytes
        self._recent_bytes = 0
        self.copies = 0  # lines answered by a copy (a count for the log and the tests)

    @staticmethod
    def key(claim: Claim, body: dict[str, Any], body_json: str) -> RequestKey | None:
        return request_key(claim.cache_domain, claim.endpoint, body, body_json)

    def join(self, request: RequestKey, unit: ActiveUnit, custom_id: str) -> EngineResult | bool:
        """True: the line waits on the run of its request in the engine; a result: a copy of the
        request's recent answer, to write now; False: the line runs."""
        engine_key = self._running.get(request)
        if engine_key is not None:
            self._waiting.setdefault(engine_key, []).append((unit, custom_id))
            self.copies += 1
            return True
        recent = self._recent.get(request)
        if recent is None:
            return False
        self._recent.move_to_end(request)
        self.copies += 1
        return copied_result(recent[0], RECENT_RESULT)

    def started(self, request: RequestKey, engine_key: str) -> None:
        self._running[request] = engine_key
        self._request_of[engine_key] = request

    def finished(self, result: EngineResult, written: int) -> list[Waiter]:
        """The lines waiting on this run, taken off; a success is remembered (``written``: the
        bytes of its result line)."""
        request = self._request_of.pop(result.key, None)
        if request is None:
            return []
        del self._running[request]
        size = written + len(request[2])  # its result line and the body its key holds
        if result.ok and size <= self._recent_limit_bytes:
            self._remember(request, result, size)
        return self._waiting.pop(result.key, [])

    def _remember(self, request: RequestKey, result: EngineResult, size: int) -> None:
        old = self._recent.pop(request, None)
        if old is not None:
            self._recent_bytes -= old[1]
        self._recent[request] = (result, size)
        self._recent_bytes += size
        while len(self._recent) > self._recent_limit or self._recent_bytes > self._recent_limit_bytes:
            _, (_, dropped) = self._recent.popitem(last=False)
            self._recent_bytes -= dropped

    def forget_recent(self) -> None:
        """Drop the remembered answers (the engine is replaced: nothing runs in it meanwhile)."""
        self._recent.clear()
        self._recent_bytes = 0

    def leave(self, unit: ActiveUnit) -> list[str]:
        """A stopping unit's waiting lines, taken off every run (their custom_ids)."""
        gone: list[str] = []
        for engine_key, waiters in list(self._waiting.items()):
            kept = [w for w in waiters if w[0] is not unit]
            gone.extend(cid for u, cid in waiters if u is unit)
            if kept:
                self._waiting[engine_key] = kept
            else:
                del self._waiting[engine_key]
        return gone

    def heir(self, engine_key: str) -> Waiter | None:
        """A waiting line of a unit that goes on, taken off, to own the run in place of a
        stopping unit's line; None: the run may be aborted."""
        waiters = self._waiting.get(engine_key, [])
        for i, (unit, custom_id) in enumerate(waiters):
            if not unit.stopping:
                del waiters[i]
                if not waiters:
                    del self._waiting[engine_key]
                self.copies -= 1  # it is the run's own line now
                return unit, custom_id
        return None

    def waiting(self) -> int:
        return sum(map(len, self._waiting.values()))
