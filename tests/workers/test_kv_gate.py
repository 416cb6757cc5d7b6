"""Admission by KV footprint in the engine loop (workers/kv_gate.py, workers/engine_loop.py): the
gate's figures from shard rows, and the loop against a scripted engine that describes a KV cache
(no vLLM here; the real engine at tight KV is tests/workers/test_kv_admission_engine.py)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace

import pytest

from scheduler.ordering import prompt_key
from storage.shards import ShardRow
from tests.workers.scripted_engine import ScriptedEngine
from tests.workers.test_engine_loop import active, rig_of, spooled, until  # noqa: F401  (rig_of: a fixture)
from workers.kv_gate import KvGate
from workers.request_bodies import CHAT, EMBEDDINGS

BS = 16  # tokens per KV block of the scripted cache


def row(
    line: int, tokens: list[int], max_tokens: int | None = 16, tag: str = "r", **body: object
) -> ShardRow:
    ids = prompt_key(tokens, len(tokens))
    return ShardRow(
        line=line,
        custom_id=f"{tag}-{line}",
        body_json=json.dumps({"n": line, **body}),
        key=ids,
        prompt_token_ids=ids,
        prompt_len=len(tokens),
        max_tokens=max_tokens,
    )


def test_the_gate_counts_a_shared_prefix_once_and_plans_the_cache_hits_of_the_sorted_order() -> None:
    gate = KvGate(capacity_blocks=12, block_size=BS, default_max_tokens=64, max_model_len=1000)
    doc = list(range(48))  # 3 whole blocks
    q = [row(i, [*doc, 100 + i, 100 + i], max_tokens=14) for i in range(4)]  # 50 + 14 tokens: 4 blocks
    assert gate.admits("a", CHAT, "salt", q[0], empty=True)
    gate.hold("a")
    assert gate.ledger.used == 4
    assert gate.admits("b", CHAT, "salt", q[1], empty=False)
    gate.hold("b")
    assert gate.ledger.used == 5  # the document's 3 blocks once, and each its own last block
    assert gate.admits("c", CHAT, "other-salt", q[2], empty=False)  # another tenant's salt shares nothing
    gate.hold("c")
    assert gate.ledger.used == 9
    big = row(9, list(range(500, 560)), max_tokens=20)  # 80 tokens: 5 blocks
    assert not gate.admits("d", CHAT, "salt", big, empty=False)  # 9 + 5 > 12
    assert gate.admits("d", CHAT, "salt", big, empty=True)  # an empty engine always takes one
    with pytest.raises(ValueError):
        gate.hold("e")  # only the request asked about can be held
    # planned hits: the whole blocks shared with the request handed over before it in its domain
    assert gate.release("a", 14) == 0  # the first of its domain
    assert gate.release("b", 14) == 48
    assert gate.release("c", None) == 0  # the first of the other salt's; failed: nothing learned
    assert gate.release("c", 3) is None and gate.ledger.used == 0
    # a pooling line grows no KV cache: by count alone, kept out of the ledger
    assert gate.admits("p", EMBEDDINGS, "salt", big, empty=False)
    gate.hold("p")
    assert gate.ledger.used == 0 and gate.release("p", None) is None


def test_the_gate_predicts_from_the_group_and_bounds_by_the_context() -> None:
    gate = KvGate(capacity_blocks=100, block_size=BS, default_max_tokens=512, max_model_len=100)
    doc = list(range(32))
    unset = row(0, [*doc, 1], max_tokens=None)  # 33 tokens, max_tokens unset: the model's room, 67
    assert gate.admits("u", CHAT, None, unset, empty=True)
    gate.hold("u")
    assert gate.ledger.used == 7  # ceil(100 / 16)
    gate.release("u", 2)
    for i in range(4):
        asked = row(i + 1, [*doc, 2 + i], max_tokens=60)
        gate.admits(f"k{i}", CHAT, None, asked, empty=True)
        gate.hold(f"k{i}")
        gate.release(f"k{i}", 2)
    # five of the document's requests finished with 2 tokens: 33 + 2 tokens, 3 blocks, not 6
    gate.admits("next", CHAT, None, row(9, [*doc, 9], max_tokens=60), empty=True)
    gate.hold("next")
    assert gate.ledger.used == 3


def test_a_request_waiting_at_the_gate_is_predicted_afresh_as_its_group_finishes() -> None:
    """Asked again while it waits, a request's output is predicted from what finished meanwhile:
    refused at its max_tokens, it fits once four of its document's requests finished short."""
    gate = KvGate(capacity_blocks=8, block_size=BS, default_max_tokens=512, max_model_len=1000)
    doc = list(range(32))  # 2 blocks
    lines = [row(i, [*doc, 100 + i], max_tokens=200) for i in range(6)]  # 33 + 200 tokens: 15 blocks
    for i in range(4):  # an empty engine takes any: forced in here
        assert gate.admits(f"k{i}", CHAT, None, lines[i], empty=True)
        gate.hold(f"k{i}")
    gate.admits("s", CHAT, None, row(9, list(range(500, 510)), max_tokens=6), empty=True)
    gate.hold("s")  # 16 tokens: 1 block of its own
    assert not gate.admits("w", CHAT, None, lines[5], empty=False)
    for i in range(4):
        gate.release(f"k{i}", 3)
    assert gate.ledger.used == 1
    assert gate.admits("w", CHAT, None, lines[5], empty=False)  # 3 tokens predicted now
    gate.hold("w")
    assert gate.ledger.used == 1 + 3  # the document's 2 blocks and 1 of its own


@dataclass(frozen=True)
class KvConfig:
    max_num_seqs: int
    default_max_tokens: int = 64


class KvScriptedEngine(ScriptedEngine):
    """The scripted engine with a KV cache of ``blocks`` blocks of ``BS`` tokens; it records the
    KV blocks its requests would hold at their ends (each shared prompt block once)."""

    max_model_len = 4096

    def __init__(self, blocks: int, max_num_seqs: int = 8, window: int = 16) -> None:
        super().__init__(max_num_seqs=max_num_seqs, window=window)
        self.config = KvConfig(max_num_seqs)
        self.kv_blocks = (blocks, BS)
        self.most_blocks = 0
        self.rows: dict[str, ShardRow] = {}

    def add(self, request):  # type: ignore[no-untyped-def]
        rejected = super().add(request)
        if rejected is None:
            blocks: set[tuple[int, bytes]] = set()
            own = 0
            for key in self.live:
                r = self.rows[key]
                ids = bytes(r.prompt_token_ids or b"")
                whole = r.prompt_len // BS
                blocks |= {(i, ids[: (i + 1) * BS * 4]) for i in range(whole)}
                own += -(-(r.prompt_len + (r.max_tokens or 0)) // BS) - whole
            self.most_blocks = max(self.most_blocks, len(blocks) + own)
        return rejected


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # no database is read
def test_the_loop_admits_by_footprint_in_feed_order_and_a_stopped_unit_takes_back_its_held_request(
    rig_of,  # noqa: F811
) -> None:
    """A cache of 10 blocks of 16 tokens, a window of 16: requests of 40 prompt tokens and 8
    output tokens (3 blocks each) go in three at a time, never past the cache, in the feed's
    order; requests sharing a 2-block prefix go in more at a time. A unit stopped while its request
    waits at the gate gets that request's stopped line, and the next unit runs."""
    engine = KvScriptedEngine(blocks=10)
    rig = rig_of(engine)
    lone = [row(i, [1000 + i] * 40, max_tokens=8, tag="u") for i in range(7)]
    shared = [
        row(i, [*range(32), 500 + i, 501, 502, 503, 504, 505, 506, 507], max_tokens=8, tag="s")
        for i in range(6)
    ]
    a, b = active(1, lone), active(2, shared)
    for unit, rows in ((a, lone), (b, shared)):
        for r in rows:
            engine.rows[f"{unit.claim.token}/{r.line}"] = r
    rig.push(a, lone)
    (done,) = rig.recorded(1)
    assert done is a and a.tally.completed == 7
    assert engine.most_blocks <= 10 and engine.most_held == 3  # by count alone it would be 7
    assert [r.key for r in engine.added] == [f"w:1:t1/{i}" for i in range(7)]  # the feed's order
    rig.push(b, shared)
    assert rig.recorded(1) == [b]
    assert engine.most_blocks <= 10 and engine.most_held == 6  # 2 shared blocks + one each: 8 of 10

    held = [row(i, [2000 + i] * 40, max_tokens=8, tag="h", hold=True) for i in range(5)]
    c = active(3, held)
    for r in held:
        engine.rows[f"{c.claim.token}/{r.line}"] = r
    rig.push(c, held)
    until(lambda: engine.load == 3)  # three in, held there; the fourth waits at the gate
    c.reason = "batch_cancelled"
    rig.loop.stops.put(c)
    rig.state.wake()
    assert rig.recorded(1) == [c]
    assert sorted(e["custom_id"] for e in spooled(c.err)) == [f"h-{i}" for i in range(5)]
    assert len(engine.added) == 7 + 6 + 3  # the one at the gate and the one behind it never ran
    last = active(4, lone[:2])
    for r in lone[:2]:
        engine.rows[f"{last.claim.token}/{r.line}"] = r
    rig.push(last, lone[:2])
    assert rig.recorded(1) == [last] and last.tally.completed == 2


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # no database is read
def test_an_urgent_request_goes_before_the_one_waiting_at_the_gate(rig_of) -> None:  # noqa: F811
    """Three requests held in the engine fill the cache; the next unit's first request waits at the
    gate; an urgent unit's request arrives. When room comes, the urgent one goes in first, then the
    waiting one and its unit's next, as the feed orders them."""
    engine = KvScriptedEngine(blocks=10)
    rig = rig_of(engine)
    hold = [row(i, [3000 + i] * 40, max_tokens=8, tag="h", hold=True) for i in range(3)]
    later = [row(i, [4000 + i] * 40, max_tokens=8, tag="a") for i in range(2)]
    quick = [row(0, [5000] * 40, max_tokens=8, tag="u")]
    h, a = active(1, hold), active(2, later)
    u = active(3, quick)
    u.claim = replace(u.claim, urgent=True)
    for unit, rows in ((h, hold), (a, later), (u, quick)):
        for r in rows:
            engine.rows[f"{unit.claim.token}/{r.line}"] = r
    rig.push(h, hold)
    until(lambda: engine.load == 3)
    rig.push(a, later)
    until(lambda: rig.loop._held is not None)  # a's first request waits at the gate
    rig.push(u, quick)
    h.reason = "batch_cancelled"
    rig.loop.stops.put(h)
    rig.state.wake()
    assert {x.claim.unit_id for x in rig.recorded(3)} == {1, 2, 3}
    assert [r.key for r in engine.added[3:]] == ["w:1:t3/0", "w:1:t2/0", "w:1:t2/1"]
    assert engine.most_blocks <= 10


def test_the_watcher_warns_of_preemptions_and_of_a_hit_rate_under_plan(caplog) -> None:
    """The engine sample's KV figures in the worker's log: a warning when vLLM preempted or the
    cache served more than a point under plan, at debug when on plan."""
    from workers.pack_watcher import _log_kv_report
    from workers.stepped_engine import StepSample

    caplog.set_level(logging.DEBUG, logger="workers.pack_watcher")
    on_plan = StepSample(prompt_tokens=1000, cached_tokens=795, planned_cached_tokens=800)
    under = StepSample(prompt_tokens=1000, cached_tokens=700, planned_cached_tokens=800)
    preempted = StepSample(prompt_tokens=1000, preemptions=3)
    for sample in (on_plan, under, preempted):
        _log_kv_report(sample)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "workers.pack_watcher"]
    assert said == [
        (
            logging.DEBUG,
            "engine sample: 0 preemptions; prefix-cache hits 79.5% of prompt tokens, planned 80.0% (gap 0.5 points)",
        ),
        (
            logging.WARNING,
            "engine sample: 0 preemptions; prefix-cache hits 70.0% of prompt tokens, planned 80.0% (gap 10.0 points)",
        ),
        (logging.WARNING, "engine sample: vLLM preempted 3 requests"),
    ]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # no database is read
def test_the_gate_keeps_the_turns_of_cache_domains(rig_of) -> None:  # noqa: F811
    """Two tenants' units (cache domains) on the feed, taking turns of 3 requests, with the cache
    holding 3 requests at a time: the engine gets them in exactly the order the feed alone gives."""
    from scheduler.feed_order import ElevatorFeed
    from workers.pack_feed import FEED_PROMPT_FIELDS, feed_key

    engine = KvScriptedEngine(blocks=10)
    rig = rig_of(engine, pack_requests=3)
    a_rows = [row(i, [6000 + i] * 40, max_tokens=8, tag="a") for i in range(7)]
    b_rows = [row(i, [7000 + i] * 40, max_tokens=8, tag="b") for i in range(5)]
    a, b = active(1, a_rows, domain="alpha"), active(2, b_rows, domain="beta")
    alone: ElevatorFeed = ElevatorFeed(prompt_fields=FEED_PROMPT_FIELDS, domain_fields=1, quantum=3)
    for unit, rows in ((a, a_rows), (b, b_rows)):
        for r in rows:
            engine.rows[f"{unit.claim.token}/{r.line}"] = r
            alone.push(feed_key(unit, r), f"{unit.claim.token}/{r.line}")
    with rig.state.lock:  # both on the feed before the loop takes any
        rig.state.hold([a, b])
        for unit, rows in ((a, a_rows), (b, b_rows)):
            for r in rows:
                rig.feed.requests.push(feed_key(unit, r), (unit, r))
        rig.state.lock.notify_all()
    assert {u.claim.unit_id for u in rig.recorded(2)} == {1, 2}
    assert [r.key for r in engine.added] == [alone.pop() for _ in range(12)]
    assert engine.most_held == 3 and engine.most_blocks <= 10
