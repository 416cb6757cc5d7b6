"""The measuring side of bench/refill_pass.py, run as a script by the code under test (its
directory first on ``sys.path``): it needs no module of bench/, so a revision from before this
benchmark existed can be measured with it.

argv: settings (JSON), passes, case, output path. The case is the queue a pass finds: ``empty``
(a hungry fleet took every pack) or ``one_taken`` (a worker just took one of ``queue_depth``
packs: the refill after a take, the most common). Writes each pass's wall and CPU seconds, units
queued, and which dispatcher module ran.
"""

from __future__ import annotations

import json
import sys
import time

from sqlalchemy import select, update

from storage.models import WorkUnit
from storage.runtime import Runtime
from storage.settings import Settings
from storage.status import UnitStatus
from workers import dispatcher


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": round(ordered[(len(ordered) - 1) // 2], 3), "max": round(ordered[-1], 3)}


def main() -> None:
    settings, passes, case, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    rt = Runtime(Settings.from_env({}, **settings))
    client = rt.queue.celery.connection_for_read().default_channel.client
    with rt.db.read() as s:
        models = sorted(m for m in s.scalars(select(WorkUnit.model).distinct()) if m)

    def reset(model: str | None = None) -> None:
        """Every unit queued or taken back to pending and the broker empty; then, for
        ``one_taken``, a full queue of ``model`` of which the first pack was taken."""
        with rt.db.write() as s:
            s.execute(
                update(WorkUnit)
                .where(WorkUnit.status.in_([UnitStatus.QUEUED, UnitStatus.RUNNING]))
                .values(status=UnitStatus.PENDING, pack_id=None, enqueued_at=None, worker=None)
            )
        client.flushdb()
        if case == "one_taken" and model is not None:
            report = dispatcher.TickReport()
            dispatcher.enqueue_units(rt, time.time(), report, model=model)
            with rt.db.write() as s:
                s.execute(
                    update(WorkUnit)
                    .where(WorkUnit.pack_id == report.packs[0])
                    .values(status=UnitStatus.RUNNING, worker="refill-bench")
                )

    reset()
    dispatcher.enqueue_units(rt, time.time(), dispatcher.TickReport(), model=models[0])  # warm caches
    wall: list[float] = []
    cpu: list[float] = []
    units: list[int] = []
    for i in range(passes):
        model = models[i % len(models)]
        reset(model)
        report = dispatcher.TickReport()
        c0, t0 = time.process_time(), time.perf_counter()
        dispatcher.enqueue_units(rt, time.time(), report, model=model)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        units.append(len(report.enqueued))
    reset()
    rt.db.dispose()
    result = {
        "wall_s": wall,
        "cpu_s": cpu,
        "units": units,
        "wall_ms": percentiles([v * 1000 for v in wall]),
        "cpu_ms": percentiles([v * 1000 for v in cpu]),
        "dispatcher": dispatcher.__file__,
    }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
