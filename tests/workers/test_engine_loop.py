"""The engine loop against a scripted engine (tests/workers/scripted_engine.py): what it does with
each request and each result, with no vLLM. The live runs on the real engine are
tests/workers/test_pack_faults.py, test_cache_isolation.py and the e2e suite."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import pytest

from storage.runtime import Runtime
from storage.settings import Settings
from storage.shards import ShardRow
from tests.workers.scripted_engine import COMPLETION_TOKENS, PROMPT_TOKENS, ScriptedEngine
from workers.cost_meter import CostMeter
from workers.engine_loop import EngineLoop
from workers.pack_feed import PackFeed, feed_key
from workers.runner_state import ActiveUnit, RunnerState, new_spool
from workers.unit_claims import Claim

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # no database is read

CHAT = "/v1/chat/completions"


@dataclass
class Rig:
    engine: ScriptedEngine
    state: RunnerState
    feed: PackFeed
    loop: EngineLoop
    finished: queue.Queue[ActiveUnit | None]
    failures: list[BaseException]

    def push(self, unit: ActiveUnit, rows: list[ShardRow]) -> None:
        """Rows onto the feed as ``run_pack`` puts them, the unit on the books."""
        self.state.hold([unit])
        with self.state.lock:
            for row in rows:
                self.feed.requests.push(feed_key(unit, row), (unit, row), urgent=unit.claim.urgent)
            self.state.lock.notify_all()

    def recorded(self, n: int) -> list[ActiveUnit]:
        """The next ``n`` units handed to the recorder."""
        return [u for u in (self.finished.get(timeout=10) for _ in range(n)) if u is not None]


@pytest.fixture
def rig_of(settings: Settings) -> Iterator:
    started: list[tuple[RunnerState, threading.Thread]] = []

    def make(engine: ScriptedEngine, **overrides: object) -> Rig:
        rt = Runtime(replace(settings, **overrides))  # type: ignore[arg-type]
        state = RunnerState()
        finished: queue.Queue[ActiveUnit | None] = queue.Queue()
        feed = PackFeed(rt, state, finished, "demo", "w:1", engine.config.max_num_seqs)
        failures: list[BaseException] = []
        loop = EngineLoop(engine, state, feed, finished, CostMeter(3.6, 0.0), failures.append)
        thread = threading.Thread(target=loop.run, daemon=True)
        thread.start()
        started.append((state, thread))
        return Rig(engine, state, feed, loop, finished, failures)

    yield make
    for state, thread in started:
        state.stopped.set()
        state.wake()
        thread.join(timeout=5)
        assert not thread.is_alive()


def active(unit_id: int, rows: list[ShardRow], domain: str = "") -> ActiveUnit:
    claim = Claim(
        unit_id, f"w:1:t{unit_id}", 1, "batch_x", CHAT, "shard", unit_id, len(rows), cache_domain=domain
    )
    return ActiveUnit(claim, new_spool(), new_spool(), len(rows))


def rows(tag: str, n: int, **body: object) -> list[ShardRow]:
    return [
        ShardRow(
            line=i,
            custom_id=f"{tag}-{i}",
            body_json=json.dumps({"n": i, **body}),
            key=f"{tag}{i:03d}".encode(),
        )
        for i in range(n)
    ]


def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def spooled(spool) -> list[dict]:
    spool.seek(0)
    return [json.loads(line) for line in spool.read().splitlines()]


def test_every_request_of_each_unit_runs_once_and_its_unit_goes_to_the_recorder_when_all_are_in(
    rig_of,
) -> None:
    """Two units' requests through an engine with a window of 4: the engine never holds more, each
    result lands in its own unit's output spool under its custom_id, each unit reaches the
    recorder once (when its last result is in) with its tally, a metered share and its fill; the
    engine sample counts the steps and the requests finished."""
    rig = rig_of(ScriptedEngine(max_num_seqs=2, window=4))
    a, b = active(1, rows("a", 5)), active(2, rows("b", 3))
    rig.push(a, rows("a", 5))
    rig.push(b, rows("b", 3))
    done = rig.recorded(2)
    assert {u.claim.unit_id for u in done} == {1, 2}
    assert rig.engine.most_held <= 4
    assert sorted(r.key for r in rig.engine.added) == sorted(
        [f"w:1:t1/{i}" for i in range(5)] + [f"w:1:t2/{i}" for i in range(3)]
    )  # one engine key per claim and line
    for unit, tag, n in ((a, "a", 5), (b, "b", 3)):
        out = spooled(unit.out)
        assert sorted(line["custom_id"] for line in out) == [f"{tag}-{i}" for i in range(n)]
        assert all(line["response"]["status_code"] == 200 for line in out)
        assert spooled(unit.err) == []
        assert (unit.tally.completed, unit.tally.failed) == (n, 0)
        assert (unit.tally.prompt_tokens, unit.tally.completion_tokens) == (
            n * PROMPT_TOKENS,
            n * COMPLETION_TOKENS,
        )
        assert unit.in_engine == 0 and unit.done
        assert unit.meter.work.requests == n  # its period closed before it was handed on
        assert unit.seconds > 0 and 0 < unit.fill_seconds / unit.seconds <= 1
    sample = rig.loop.take_sample()
    assert sample.steps == rig.engine.steps and sample.requests == 8
    assert sample.output_tokens == 8 * COMPLETION_TOKENS
    assert rig.loop.take_sample().steps == 0  # taken: a new sample begins


def test_a_sample_starts_at_its_first_step_not_when_the_last_was_taken(rig_of) -> None:
    """engine_samples rows place a period's busy seconds at [started_at, started_at + seconds]:
    a period that began idle starts at its first step (the benchmarks' per-step CPU and fill
    share rows out over a run's window by that span)."""
    rig = rig_of(ScriptedEngine(max_num_seqs=2, window=4))
    rig.loop.take_sample()  # a period begins, idle
    idle_until = time.time()  # (the clock has nanoseconds: a period begun before reads earlier)
    unit = active(1, rows("a", 3))
    rig.push(unit, rows("a", 3))
    rig.recorded(1)
    sample = rig.loop.take_sample()
    assert sample.steps > 0
    assert sample.started_at >= idle_until
    assert sample.started_at + sample.seconds <= time.time()


def test_a_request_the_engine_refuses_is_an_error_line_of_its_unit(rig_of) -> None:
    rig = rig_of(ScriptedEngine())
    unit_rows = [
        *rows("r", 2),
        ShardRow(line=2, custom_id="r-bad", body_json='{"refuse": true}', key=b"r002"),
    ]
    unit = active(7, unit_rows)
    rig.push(unit, unit_rows)
    (done,) = rig.recorded(1)
    assert done is unit
    (error,) = spooled(unit.err)
    assert error["custom_id"] == "r-bad" and error["response"]["status_code"] == 400
    assert (unit.tally.completed, unit.tally.failed) == (2, 1)


def test_a_stopped_unit_is_aborted_in_the_engine_and_taken_off_the_feed(rig_of) -> None:
    """The watcher stops a unit (its batch cancelled): its requests in the engine are aborted, the
    ones still on the feed never reach the engine, all of them error lines with the reason; the
    other unit on the feed runs on."""
    rig = rig_of(ScriptedEngine(max_num_seqs=2, window=2))
    held = rows("h", 4, hold=True)
    stopped, other = active(1, held), active(2, rows("o", 2))
    rig.push(stopped, held)
    until(lambda: rig.engine.load == 2)  # the first two are in the engine, held there
    stopped.reason = "batch_cancelled"
    rig.loop.stops.put(stopped)
    rig.state.wake()
    (done,) = rig.recorded(1)
    assert done is stopped
    assert sorted(rig.engine.aborted) == ["w:1:t1/0", "w:1:t1/1"]
    assert len(rig.engine.added) == 2  # the two left on the feed never ran
    errors = spooled(stopped.err)
    assert sorted(e["custom_id"] for e in errors) == [f"h-{i}" for i in range(4)]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert (stopped.tally.completed, stopped.tally.failed) == (0, 4)
    rig.push(other, rows("o", 2))
    assert rig.recorded(1) == [other] and other.tally.completed == 2


def test_an_engine_that_dies_ends_the_loop_and_reports_why(rig_of) -> None:
    rig = rig_of(ScriptedEngine(fail_at_step=2))
    unit = active(3, rows("f", 6))
    rig.push(unit, rows("f", 6))
    until(lambda: bool(rig.failures))
    (failure,) = rig.failures
    assert isinstance(failure, RuntimeError) and str(failure) == "the engine core died"
    assert rig.finished.empty()  # the unit was not finished: it is the runner's to give back


def test_an_idle_engine_waits_for_the_packs_of_jobs_submitted_together(rig_of) -> None:
    """A pack that says more may come (batches of the model still validating) holds an idle
    engine for the merge window: a second pack within it is on the feed before the first step, so
    the two run as one sweep."""
    rig = rig_of(ScriptedEngine(max_num_seqs=8, window=16), feed_merge_seconds=0.5, feed_settle_seconds=0.0)
    first, second = active(1, rows("b", 2)), active(2, rows("a", 2))
    with rig.state.lock:
        rig.feed._more_coming = True  # as run_pack records the pack's word (tests/workers/test_pack_feed.py)
    rig.push(first, rows("b", 2))
    time.sleep(0.2)
    assert rig.engine.steps == 0  # gathering
    rig.push(second, rows("a", 2))
    rig.recorded(2)
    assert [r.key for r in rig.engine.added] == [
        "w:1:t2/0",
        "w:1:t2/1",
        "w:1:t1/0",
        "w:1:t1/1",
    ]  # in key order


def test_a_parked_loop_touches_no_engine_and_drives_the_one_it_is_resumed_with(rig_of) -> None:
    """``PackRunner.restart_engine``'s swap: an idle loop parks (no step, no add while parked, so
    the engine may be shut down and another started) and, resumed with another engine, runs the
    next unit's requests on that one alone."""
    rig = rig_of(ScriptedEngine())
    first = active(1, rows("a", 2))
    rig.push(first, rows("a", 2))
    rig.recorded(1)
    assert rig.loop.park()
    old_steps, second_engine = rig.engine.steps, ScriptedEngine()
    second = active(2, rows("b", 3))
    rig.push(second, rows("b", 3))  # nothing is pushed while parked in a worker; here it waits
    time.sleep(0.5)
    assert rig.engine.steps == old_steps and len(rig.engine.added) == 2 and not second.results
    rig.loop.resume(second_engine)
    (done,) = rig.recorded(1)
    assert done is second and (second.tally.completed, second.tally.failed) == (3, 0)
    assert len(rig.engine.added) == 2 and sorted(r.key for r in second_engine.added) == [
        f"w:1:t2/{i}" for i in range(3)
    ]
    assert not rig.failures
