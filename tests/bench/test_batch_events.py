"""bench/batch_events.py: the benchmarks' webhook receiver wakes the client's poll at once."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

from bench.batch_events import BatchEvents


def _post(url: str, body: bytes) -> int:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return int(response.status)


def test_an_event_cuts_the_nap_short_and_is_kept() -> None:
    events = BatchEvents()
    try:
        assert events.url.startswith("http://127.0.0.1:")
        began = time.monotonic()
        assert events.nap(0.2) is False and time.monotonic() - began >= 0.19  # nothing came

        event = {"type": "batch.completed", "data": {"id": "batch_1"}}
        timer = threading.Timer(0.2, _post, (events.url, json.dumps(event).encode()))
        timer.start()
        began = time.monotonic()
        assert events.nap(10) is True
        assert time.monotonic() - began < 5  # woken, not slept through
        timer.join()
        assert events.events == [event]
        # an event that came between two naps wakes the next one at once; then it is spent
        assert _post(events.url, b"not json") == 204
        began = time.monotonic()
        assert events.nap(10) is True and time.monotonic() - began < 1
        assert events.nap(0.05) is False
        assert events.events[-1] == {}
    finally:
        events.close()
