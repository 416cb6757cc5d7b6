"""Duplicate lines on the engine loop (workers/duplicate_lines.py) against the scripted engine:
one run, a result line for each, copies marked and not metered, and every line's result written
once whatever stops. The real engine's run is tests/workers/test_duplicate_runs.py."""

from __future__ import annotations

import json

import pytest

from storage.shards import ShardRow
from tests.workers.scripted_engine import COMPLETION_TOKENS, PROMPT_TOKENS, ScriptedEngine
from tests.workers.test_engine_loop import active, rig_of, spooled, until  # noqa: F401 (a fixture)
from workers.duplicate_lines import RECENT_RESULT, SHARED_RUN, DuplicateLines, copied_body
from workers.engine import EngineResult

on_rig = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the rig reads no database


def line(tag: str, i: int, text: str, **body: object) -> ShardRow:
    """A greedy chat line (its body: the text and ``body``); the key orders lines as validation's."""
    return ShardRow(
        line=i,
        custom_id=f"{tag}-{i}",
        body_json=json.dumps({"model": "demo", "text": text, "temperature": 0, **body}),
        key=text.encode(),
    )


class FailingStepEngine(ScriptedEngine):
    """A request whose body says ``"fail": true`` finishes with a 400 from its step."""

    def step(self) -> list[EngineResult]:
        failing = {k for k, r in self.live.items() if r.body.get("fail")}
        return [
            EngineResult(r.key, 400, error={"message": "too long", "code": "bad"}) if r.key in failing else r
            for r in super().step()
        ]


@on_rig
def test_identical_greedy_lines_run_once_and_each_gets_its_own_marked_result_line(rig_of) -> None:  # noqa: F811
    """Three identical greedy lines and a fourth: two runs; four result lines, each with its own
    line id and request id; the two copies carry the run's answer, marked x_freight.copy; usage
    counts every line, the meter only the runs."""
    rig = rig_of(ScriptedEngine(max_num_seqs=4, window=4))
    unit_rows = [line("d", 0, "alpha"), line("d", 1, "alpha"), line("d", 2, "alpha"), line("d", 3, "beta")]
    unit = active(1, unit_rows)
    rig.push(unit, unit_rows)
    (done,) = rig.recorded(1)
    assert [r.key for r in rig.engine.added] == ["w:1:t1/0", "w:1:t1/3"]
    out = {o["custom_id"]: o for o in spooled(done.out)}
    assert sorted(out) == ["d-0", "d-1", "d-2", "d-3"]
    assert len({o["id"] for o in out.values()}) == 4
    assert len({o["response"]["request_id"] for o in out.values()}) == 4
    bodies = {cid: o["response"]["body"] for cid, o in out.items()}
    assert bodies["d-1"]["echo"] == bodies["d-2"]["echo"] == bodies["d-0"]["echo"] == "w:1:t1/0"
    assert bodies["d-1"]["x_freight"] == bodies["d-2"]["x_freight"] == {"copy": SHARED_RUN}
    assert "x_freight" not in bodies["d-0"] and "x_freight" not in bodies["d-3"]
    assert (done.tally.completed, done.tally.prompt_tokens) == (4, 4 * PROMPT_TOKENS)
    assert done.tally.completion_tokens == 4 * COMPLETION_TOKENS
    assert done.meter.work.requests == 2  # the engine's work: two runs, the copies none
    assert done.meter.work.output_tokens == 2 * COMPLETION_TOKENS
    assert rig.loop.take_sample().requests == 2
    assert rig.loop._dups.copies == 2 and rig.loop._dups.waiting() == 0


@on_rig
@pytest.mark.parametrize(
    "extra",
    [{"temperature": 0.7}, {"temperature": 0.7, "seed": None}, {"n": 2}, {"best_of": 2}],
    ids=["sampled", "no-seed", "n2", "best_of2"],
)
def test_sampled_or_many_answer_duplicates_each_run(rig_of, extra: dict) -> None:  # noqa: F811
    rig = rig_of(ScriptedEngine(max_num_seqs=4, window=4))
    unit_rows = [line("s", i, "same", **extra) for i in range(3)]
    unit = active(1, unit_rows)
    rig.push(unit, unit_rows)
    (done,) = rig.recorded(1)
    assert len(rig.engine.added) == 3
    assert all("x_freight" not in o["response"]["body"] for o in spooled(done.out))


@on_rig
def test_seeded_duplicates_share_a_run_and_other_seeds_do_not(rig_of) -> None:  # noqa: F811
    rig = rig_of(ScriptedEngine(max_num_seqs=4, window=4))
    unit_rows = [
        line("s", 0, "same", temperature=0.9, seed=5),
        line("s", 1, "same", temperature=0.9, seed=5),
        line("s", 2, "same", temperature=0.9, seed=6),
    ]
    unit = active(1, unit_rows)
    rig.push(unit, unit_rows)
    rig.recorded(1)
    assert [r.key for r in rig.engine.added] == ["w:1:t1/0", "w:1:t1/2"]


@on_rig
def test_scopes_keep_tenants_apart_and_one_scope_shares_across_units(rig_of) -> None:  # noqa: F811
    """Units of two tenants in tenant mode (cache domains a and b) run the same line each; two
    units of one scope (the global mode's "") share one run."""
    rig = rig_of(ScriptedEngine(max_num_seqs=8, window=8))
    a, b = active(1, [line("a", 0, "x")], domain="a"), active(2, [line("b", 0, "x")], domain="b")
    g1, g2 = active(3, [line("g", 0, "x")]), active(4, [line("h", 0, "x")])
    for unit, tag in ((a, "a"), (b, "b"), (g1, "g"), (g2, "h")):
        rig.push(unit, [line(tag, 0, "x")])
    rig.recorded(4)
    assert sorted(r.key for r in rig.engine.added) == ["w:1:t1/0", "w:1:t2/0", "w:1:t3/0"]
    assert spooled(g2.out)[0]["response"]["body"] == {"echo": "w:1:t3/0", "x_freight": {"copy": SHARED_RUN}}
    assert g2.meter.work.requests == 0 and g2.meter.cost_micros == 0


@on_rig
def test_a_duplicate_of_a_failed_request_gets_the_same_error_line(rig_of) -> None:  # noqa: F811
    rig = rig_of(FailingStepEngine(max_num_seqs=4, window=4))
    unit_rows = [line("e", 0, "long", fail=True), line("e", 1, "long", fail=True)]
    unit = active(1, unit_rows)
    rig.push(unit, unit_rows)
    (done,) = rig.recorded(1)
    assert len(rig.engine.added) == 1
    errors = {e["custom_id"]: e for e in spooled(done.err)}
    assert sorted(errors) == ["e-0", "e-1"]
    assert errors["e-0"]["id"] != errors["e-1"]["id"]
    first, copy = errors["e-0"]["response"], errors["e-1"]["response"]
    assert first["status_code"] == copy["status_code"] == 400
    assert first["body"]["error"] == copy["body"]["error"]
    assert copy["body"]["x_freight"] == {"copy": SHARED_RUN}
    assert (done.tally.completed, done.tally.failed) == (0, 2)


@on_rig
def test_a_line_after_its_run_finished_copies_the_recent_result(rig_of) -> None:  # noqa: F811
    """A window of one: the second line leaves the feed once the first has finished, and copies
    its remembered answer."""
    rig = rig_of(ScriptedEngine(max_num_seqs=1, window=1))
    unit_rows = [line("r", 0, "q"), line("r", 1, "q")]
    unit = active(1, unit_rows)
    rig.push(unit, unit_rows)
    (done,) = rig.recorded(1)
    assert len(rig.engine.added) == 1
    copy = {o["custom_id"]: o for o in spooled(done.out)}["r-1"]["response"]["body"]
    assert copy == {"echo": "w:1:t1/0", "x_freight": {"copy": RECENT_RESULT}}


@on_rig
def test_a_resumed_loop_copies_no_answer_of_the_engine_before(rig_of) -> None:  # noqa: F811
    """A swapped engine (a LoRA refit) may answer otherwise: the same line runs on the new one."""
    rig = rig_of(ScriptedEngine(max_num_seqs=1, window=1))
    first = active(1, [line("a", 0, "q")])
    rig.push(first, [line("a", 0, "q")])
    rig.recorded(1)
    assert rig.loop.park()
    rig.loop.resume(second_engine := ScriptedEngine(max_num_seqs=1, window=1))
    again = active(2, [line("b", 0, "q")])
    rig.push(again, [line("b", 0, "q")])
    rig.recorded(1)
    assert [r.key for r in second_engine.added] == ["w:1:t2/0"]
    assert spooled(again.out)[0]["response"]["body"] == {"echo": "w:1:t2/0"}


@on_rig
def test_a_stopped_unit_hands_its_run_to_a_waiting_line_of_a_unit_that_goes_on(rig_of) -> None:  # noqa: F811
    """Unit 1's line runs (held in the engine), unit 2's identical line waits on it. Unit 1's batch
    is cancelled: its line is a stopped line, the run is not aborted and goes on as unit 2's,
    which gets the answer as its own (metered, unmarked)."""
    rig = rig_of(ScriptedEngine(max_num_seqs=2, window=2))
    first, second = active(1, [line("a", 0, "p", hold=True)]), active(2, [line("b", 0, "p", hold=True)])
    rig.push(first, [line("a", 0, "p", hold=True)])
    until(lambda: rig.engine.load == 1)
    rig.push(second, [line("b", 0, "p", hold=True)])
    until(lambda: rig.loop._dups.waiting() == 1)
    first.reason = "batch_cancelled"
    rig.loop.stops.put(first)
    rig.state.wake()
    (done,) = rig.recorded(1)
    assert done is first and spooled(first.err)[0]["error"]["code"] == "batch_cancelled"
    assert rig.engine.aborted == []
    rig.engine.live["w:1:t1/0"].body["hold"] = False  # the run finishes
    rig.state.wake()
    assert rig.recorded(1) == [second]
    (answer,) = spooled(second.out)
    assert answer["custom_id"] == "b-0" and answer["response"]["body"] == {"echo": "w:1:t1/0"}
    assert second.meter.work.requests == 1 and second.in_engine == 0


@on_rig
def test_a_stopped_waiting_unit_gets_stopped_lines_and_the_run_goes_on(rig_of) -> None:  # noqa: F811
    rig = rig_of(ScriptedEngine(max_num_seqs=2, window=2))
    first, second = active(1, [line("a", 0, "p", hold=True)]), active(2, [line("b", 0, "p", hold=True)])
    rig.push(first, [line("a", 0, "p", hold=True)])
    until(lambda: rig.engine.load == 1)
    rig.push(second, [line("b", 0, "p", hold=True)])
    until(lambda: rig.loop._dups.waiting() == 1)
    second.reason = "batch_expired"
    rig.loop.stops.put(second)
    rig.state.wake()
    assert rig.recorded(1) == [second]
    assert spooled(second.err)[0]["error"]["code"] == "batch_expired" and spooled(second.out) == []
    rig.engine.live["w:1:t1/0"].body["hold"] = False
    rig.state.wake()
    assert rig.recorded(1) == [first]
    assert spooled(first.out)[0]["custom_id"] == "a-0" and rig.engine.aborted == []


@on_rig
def test_both_units_stopped_aborts_the_run_and_each_line_is_stopped_once(rig_of) -> None:  # noqa: F811
    rig = rig_of(ScriptedEngine(max_num_seqs=2, window=2))
    first, second = active(1, [line("a", 0, "p", hold=True)]), active(2, [line("b", 0, "p", hold=True)])
    rig.push(first, [line("a", 0, "p", hold=True)])
    until(lambda: rig.engine.load == 1)
    rig.push(second, [line("b", 0, "p", hold=True)])
    until(lambda: rig.loop._dups.waiting() == 1)
    for unit in (first, second):
        unit.reason = "batch_cancelled"  # both marked before either stop is applied
    rig.loop.stops.put(first)
    rig.loop.stops.put(second)
    rig.state.wake()
    assert {u.claim.unit_id for u in rig.recorded(2)} == {1, 2}
    assert rig.engine.aborted == ["w:1:t1/0"]
    for unit in (first, second):
        assert len(spooled(unit.err)) == 1 and spooled(unit.out) == []
        assert unit.results == 1


@on_rig
def test_an_engine_that_dies_with_lines_waiting_finishes_no_unit(rig_of) -> None:  # noqa: F811
    """The engine dies while a run has lines of two units waiting on it: neither unit reaches the
    recorder (the runner gives both back, and they run again elsewhere, copies included)."""
    rig = rig_of(ScriptedEngine(max_num_seqs=2, window=2, fail_at_step=3))
    first, second = active(1, [line("a", 0, "p", hold=True)]), active(2, [line("b", 0, "p", hold=True)])
    rig.push(first, [line("a", 0, "p", hold=True)])
    rig.push(second, [line("b", 0, "p", hold=True)])
    until(lambda: bool(rig.failures))
    assert len(rig.engine.added) == 1 and rig.loop._dups.waiting() == 1
    assert rig.finished.empty() and first.results == second.results == 0


def test_a_copy_has_its_own_response_id_and_the_recent_results_stay_bounded() -> None:
    body = {"id": "chatcmpl-abc", "choices": [], "x_freight": {"other": 1}}
    copy = copied_body(body, SHARED_RUN)
    assert copy["id"].startswith("chatcmpl-") and copy["id"] != body["id"]
    assert copy["x_freight"] == {"other": 1, "copy": SHARED_RUN} and body["x_freight"] == {"other": 1}
    assert copied_body({"id": "resp_1"}, RECENT_RESULT)["id"].startswith("resp_")
    dups = DuplicateLines(recent_results=2, recent_bytes=100)
    for i in range(4):
        request = ("", "/v1/chat/completions", str(i))
        dups.started(request, f"k{i}")
        dups.finished(EngineResult(f"k{i}", 200, body={}), 40)  # 41 bytes with its body
    assert [r[2] for r in dups._recent] == ["2", "3"] and dups._recent_bytes == 82
    big = ("", "/v1/chat/completions", "x" * 61)
    dups.started(big, "kb")
    dups.finished(EngineResult("kb", 200, body={}), 40)  # 101: larger than the whole memory, not kept
    assert big not in dups._recent
    failed = ("", "/v1/chat/completions", "f")
    dups.started(failed, "kx")
    dups.finished(EngineResult("kx", 500, error={}), 10)  # an engine failure is not remembered
    assert failed not in dups._recent
