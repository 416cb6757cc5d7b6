"""The engine worker's database writes apart from the engine (claim renewal), and its engine's
restart at a safe point against scripted engines (tests/workers/scripted_engine.py)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from sqlalchemy import select

from bench.dispatcher_load import Sizes, load
from storage.models import WorkUnit
from storage.runtime import Runtime
from storage.status import UnitStatus
from tests.conftest import now
from tests.workers.scripted_engine import ScriptedEngine
from workers.engine import EngineConfig, EngineStartFailed
from workers.execution import PackRunner
from workers.runner_state import ActiveUnit, new_spool
from workers.unit_claims import Claim, UnitTally, claim_unit, heartbeat


def test_a_heartbeat_renews_the_claims_still_held_with_their_counts(settings):
    """One executemany renews every claim given (in unit order, whatever order they come in); a
    claim another worker took over in the meantime is left alone."""
    rt = Runtime(replace(settings, unit_size=2))
    try:
        load(rt.db, Sizes(requests=6, batches=1, tenants=1, models=1, workers=1), now(), unit_size=2)
        with rt.db.read() as s:
            ids = list(s.scalars(select(WorkUnit.id).order_by(WorkUnit.id)))
        t0 = float(now())
        claims = [claim_unit(rt, unit_id, t0, "w:1:a") for unit_id in ids]
        assert all(claims)
        with rt.db.write() as s:  # the last unit's claim was lost to another worker
            s.get(WorkUnit, ids[-1]).worker = "other:1:b"
        so_far = UnitTally(completed=1, failed=1, prompt_tokens=40, completion_tokens=7)
        heartbeat(rt, [(c, so_far) for c in reversed(claims) if c is not None], t0 + 30)
        heartbeat(rt, [], t0 + 31)  # nothing held: nothing written
        with rt.db.read() as s:
            rows = {u.id: u for u in s.scalars(select(WorkUnit).where(WorkUnit.id.in_(ids)))}
        for unit_id in ids[:-1]:
            row = rows[unit_id]
            assert (row.heartbeat_at, row.completed, row.failed, row.prompt_tokens, row.completion_tokens) == (
                t0 + 30, 1, 1, 40, 7
            )  # fmt: skip
        assert (rows[ids[-1]].heartbeat_at, rows[ids[-1]].completed, rows[ids[-1]].completion_tokens) == (
            t0,
            0,
            0,
        )
    finally:
        rt.db.dispose()


def test_a_unit_taken_by_a_late_pack_message_records_that_pack(settings):
    """A unit packed again after its message waited too long is pending with no pack; its old
    message may still deliver it (the claim lets one delivery run it), and then the unit names the
    pack it ran in. A delivery without a pack (a direct claim) leaves the pack as it was."""
    rt = Runtime(replace(settings, unit_size=2))
    try:
        load(rt.db, Sizes(requests=4, batches=1, tenants=1, models=1, workers=1), now(), unit_size=2)
        with rt.db.write() as s:
            units = list(s.scalars(select(WorkUnit).order_by(WorkUnit.id)))
            for unit in units:
                unit.pack_id = None  # requeued: pending, its pack cleared
        late, direct = (u.id for u in units)
        assert claim_unit(rt, late, float(now()), "w:1:a", pack_id="pack_late") is not None
        assert claim_unit(rt, direct, float(now()), "w:1:a") is not None
        assert claim_unit(rt, late, float(now()), "w:2:b", pack_id="pack_new") is None  # one delivery runs it
        with rt.db.read() as s:
            rows = {u.id: u for u in s.scalars(select(WorkUnit).where(WorkUnit.id.in_([late, direct])))}
        assert rows[late].pack_id == "pack_late" and rows[late].status == UnitStatus.RUNNING
        assert rows[direct].pack_id is None
    finally:
        rt.db.dispose()


class _Restartable(ScriptedEngine):
    """A scripted engine with what ``PackRunner`` reads of a real one besides the loop's surface."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(max_num_seqs=config.max_num_seqs)
        self.config = config  # type: ignore[assignment]
        self.dtype = "float32"
        self.loras: object = None
        self.shut = False
        self.driven = threading.Event()  # the engine loop has read this engine's load: it drives it

    @property
    def load(self) -> int:
        self.driven.set()
        return super().load

    def shutdown(self) -> None:
        self.shut = True


def test_a_park_right_after_a_resume_is_seen(settings, demo_model_dir):
    """Two engine restarts in a row (workers/lora_refit.py's): the second park is seen even when
    it comes before the loop thread has woken from the first hold."""
    rt = Runtime(settings)
    engine = _Restartable(EngineConfig(model_path=str(demo_model_dir), served_name="demo", max_num_seqs=2))
    runner = PackRunner(rt, engine, "demo", "park-test")
    runner.on_fatal = lambda: None
    loop = runner.loop
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        assert loop.park()
        with runner._state.lock:  # the loop thread cannot leave its hold before the next park
            loop.resume(engine)
            loop._park.set()  # the next park's first step
        answered: list[bool] = []
        second = threading.Thread(target=lambda: answered.append(loop.park()), daemon=True)
        second.start()
        second.join(timeout=3)
        assert answered == [True]
    finally:
        runner._state.stopped.set()
        runner._state.wake()
        thread.join(timeout=5)
        rt.db.dispose()


def test_an_engine_restarts_once_its_units_are_recorded_and_as_it_was_if_the_new_one_fails(
    settings, demo_model_dir
):
    """``PackRunner.restart_engine`` (workers/lora_refit.py's restart): it waits while the worker
    holds a unit, then shuts the engine down and starts the new one, which the engine loop drives
    from then on; a new engine that does not start is followed by the old configuration's."""
    rt = Runtime(settings)
    first = _Restartable(EngineConfig(model_path=str(demo_model_dir), served_name="demo", max_num_seqs=2))
    runner = PackRunner(rt, first, "demo", "restart-test")
    runner.on_fatal = lambda: None
    loop = threading.Thread(target=runner.loop.run, daemon=True)
    loop.start()
    started: list[dict] = []

    def start(config: EngineConfig) -> _Restartable:
        started.append(config.engine_args)
        if config.engine_args.get("max_loras") == 99:
            raise EngineStartFailed("no room for 99 adapters")
        return _Restartable(config)

    runner.start_engine = start
    try:
        held = ActiveUnit(
            Claim(1, "t", 1, "b", "/v1/chat/completions", "s", 1, 0), new_spool(), new_spool(), 0
        )
        runner._state.hold([held])
        done: list[bool] = []
        lora_on = replace(first.config, engine_args={"enable_lora": True, "max_loras": 2})
        restart = threading.Thread(target=lambda: done.append(runner.restart_engine(lora_on, "L", "a test")))
        restart.start()
        time.sleep(0.5)
        assert not first.shut and not started and not done  # a unit is held: no restart yet
        runner._state.forget(held)
        restart.join(timeout=10)
        assert done == [True] and first.shut and started == [lora_on.engine_args]
        second = runner.engine
        assert second is not first and second.loras == "L" and runner.loop.engine is second
        assert second.driven.wait(10)  # the loop drives the new engine
        # a new engine that fails to start: the old configuration again, its adapters as they were
        too_many = replace(first.config, engine_args={"enable_lora": True, "max_loras": 99})
        assert runner.restart_engine(too_many, "M", "another test") is False
        third = runner.engine
        assert second.shut and started[1:] == [too_many.engine_args, lora_on.engine_args]
        assert third.config == lora_on and third.loras == "L" and runner.loop.engine is third
        assert runner.failure is None
    finally:
        runner._state.stopped.set()
        runner._state.wake()
        loop.join(timeout=5)
        rt.db.dispose()
