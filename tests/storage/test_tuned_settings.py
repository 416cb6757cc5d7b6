"""Tuned engine settings in the registry (``freight models tune``): stored per model and shape
class, replaced by a later tuning of the same class, applied to the checkpoint they were measured
on, under the model's explicit engine args; migration 0033 down and up. SQLite and PostgreSQL."""

from __future__ import annotations

from dataclasses import replace

from storage.models import Model
from storage.registry import (
    TunedSettings,
    applied_engine_args,
    applied_tuning,
    record_tuning,
    require,
    tunings,
)
from tests.conftest import DEMO_MODEL

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _tuned(shape_class: str, measured_at: int, **extra: object) -> TunedSettings:
    values: dict = {
        "model": "demo",
        "shape_class": shape_class,
        "checkpoint": str(DEMO_MODEL),
        "engine_args": {"max_num_seqs": 32, "speculative_config": SPEC},
        "tokens_per_second": 212.5,
        "baseline_tokens_per_second": 170.0,
        "baseline_args": {"max_num_seqs": 16, "max_num_batched_tokens": 4096},
        "sample": "shape:extract (32 lines)",
        "device": "cpu",
        "points": [{"label": "the previous defaults", "tokens_per_second": 170.0, "seconds": 12.0}],
        "notes": ["gpu_memory_utilization and CUDA graph capture sizes: not tried, no GPU on this host"],
        "measured_at": measured_at,
    }
    return TunedSettings(**(values | extra))


def test_tunings_round_trip_and_the_latest_of_the_checkpoint_applies(runtime) -> None:
    rt = runtime
    demo = require(rt.db, rt.settings, "demo")  # the FREIGHT_MODELS declaration
    assert applied_tuning(rt.db, demo) is None and applied_engine_args(rt.db, demo) == {}

    first = _tuned("prompt-medium.output-medium.unique", 100)
    record_tuning(rt.db, first)
    assert tunings(rt.db, "demo") == [first]  # JSON, floats and all, read back as written
    assert tunings(rt.db, "other") == []
    assert applied_tuning(rt.db, demo) == first and first.gain == 1.25
    assert applied_engine_args(rt.db, demo) == first.engine_args

    later = _tuned("prompt-short.output-short.shared", 200, engine_args={"max_num_batched_tokens": 8192})
    record_tuning(rt.db, later)
    assert [t.shape_class for t in tunings(rt.db, "demo")] == [later.shape_class, first.shape_class]
    assert applied_engine_args(rt.db, demo) == {"max_num_batched_tokens": 8192}

    again = replace(first, measured_at=300, engine_args={}, tokens_per_second=171.0)  # the defaults won
    record_tuning(rt.db, again)  # same class: replaces the row
    assert tunings(rt.db, "demo") == [again, later]
    assert applied_engine_args(rt.db, demo) == {}


def test_explicit_engine_args_win_and_another_checkpoint_starts_untuned(runtime) -> None:
    rt = runtime
    record_tuning(rt.db, _tuned("prompt-short.output-short.unique", 100))
    with rt.db.write() as s:  # the operator's row over the declaration, on the same checkpoint
        s.add(Model(name="demo", source=str(DEMO_MODEL), checkpoint=str(DEMO_MODEL), requested_quantization="none",
                    quantization="none", engine_args={"max_num_seqs": 8, "block_size": 32}, created_at=1))  # fmt: skip
    demo = require(rt.db, rt.settings, "demo")
    assert applied_engine_args(rt.db, demo) == {
        "max_num_seqs": 8,
        "block_size": 32,
        "speculative_config": SPEC,
    }
    with rt.db.write() as s:
        row = s.get(Model, "demo")
        assert row is not None
        row.checkpoint = "/srv/other-checkpoint"
    moved = require(rt.db, rt.settings, "demo")
    assert applied_tuning(rt.db, moved) is None
    assert applied_engine_args(rt.db, moved) == {"max_num_seqs": 8, "block_size": 32}


def test_migration_0033_goes_down_and_up(runtime, settings) -> None:
    from alembic import command
    from sqlalchemy import inspect

    from storage.migrate import alembic_config, check, upgrade

    record_tuning(runtime.db, _tuned("prompt-short.output-short.unique", 100))
    runtime.db.dispose()
    command.downgrade(alembic_config(settings.database_url), "0032")
    assert "tuned_engine_settings" not in inspect(runtime.db.engine).get_table_names()
    upgrade(settings.database_url)
    check(settings.database_url)  # the table matches the model again
    assert tunings(runtime.db, "demo") == []
