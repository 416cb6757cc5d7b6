"""bench.freight_runner.run_phases: a run's wall time split at its work units' timestamps, on a
database Alembic migrated (the schema the stack's workers write)."""

from __future__ import annotations

import shutil
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import Session

from bench.freight_runner import run_phases
from storage.models import WorkUnit


def _unit(
    batch_id: str, seq: int, enqueued: float, started: float | None, finished: float | None
) -> WorkUnit:
    return WorkUnit(batch_id=batch_id, seq=seq, model="demo", shard_key=f"s/{seq}", first_line=1, n_requests=8,
                    enqueued_at=enqueued, started_at=started, finished_at=finished)  # fmt: skip


def test_the_phases_split_the_wall_time_at_the_units_of_the_runs_batches(
    tmp_path: Path, migrated_sqlite: Path
) -> None:
    shutil.copyfile(migrated_sqlite, tmp_path / "freight.db")
    url = f"sqlite:///{tmp_path / 'freight.db'}"
    engine = sa.create_engine(url)  # no foreign keys enforced: units without their batches' rows
    with Session(engine) as s:
        s.add_all([
            _unit("batch_a", 0, 100.5, 101.0, 110.0),
            _unit("batch_a", 1, 100.5, 102.0, 111.0),
            _unit("batch_b", 0, 100.7, 101.5, 112.5),
            _unit("batch_other", 0, 50.0, 51.0, 200.0),  # another run's: not counted
        ])  # fmt: skip
        s.commit()
    engine.dispose()
    phases = run_phases(url, ["batch_a", "batch_b"], 100.0, 113.0)
    assert phases == {"to_units": 0.5, "to_engine": 0.5, "engine": 11.5, "to_final": 0.5}
    assert sum(phases.values()) == 113.0 - 100.0
    assert run_phases(url, ["batch_none"], 100.0, 113.0) is None  # no units: nothing to split
    assert run_phases(f"sqlite:///{tmp_path / 'missing' / 'x.db'}", ["batch_a"], 0, 1) is None
