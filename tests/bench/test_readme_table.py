"""bench/readme_table.py: how a result file's target becomes a row of the README's table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import readme_table
from bench.readme_table import Row, bound_of, render_row


def test_every_form_of_bound_the_result_files_hold_is_read() -> None:
    assert bound_of({"bound": 1.0, "op": "<="}) == ("<=", 1.0)
    assert bound_of({"min": 0.95, "value": 1.0}) == (">=", 0.95)
    assert bound_of({"max": 2.0, "value": 0.0}) == ("<=", 2.0)
    assert bound_of({"bound": ">= 1.2"}) == (">=", 1.2)
    assert bound_of({"bound": "<= 1.5 (pass 2: max of run/estimate and its inverse)"}) == ("<=", 1.5)
    assert bound_of({"bound": 0.95}, ">=") == (">=", 0.95)
    assert bound_of({"bound": "true"}) == ("==", True)
    with pytest.raises(ValueError, match="cannot read"):
        bound_of({"bound": "about 3"})


def _row(target: dict, **data: object) -> list[str]:
    line = render_row(
        Row("a label", "x.json", "k", **({"op": ">="} if "op" not in target else {})),
        {"targets": {"k": target}, **data},
    )
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_a_row_shows_the_files_figure_bound_pass_machine_and_date() -> None:
    prov = {"machine": {"cpu_flags": {"avx512_bf16": False}}, "finished_at": "2026-12-01T10:00:00+0000"}
    row = _row(
        {"value": 0.9031, "bound": 0.9, "op": ">=", "pass": True}, provenance=prov, generated_at="2026-11-01"
    )
    assert row == ["a label", "≥ 0.9", "0.90", "yes, at the bound", "AVX2, 2026-12-01", "`x.json`: `k`"]
    # a failing value is never rounded into a pass: 0.8955 shows 0.90, and "no"
    row = _row(
        {"value": 0.8955, "bound": 0.9, "op": ">=", "pass": False},
        machine={"cpu_flags": {"avx512_bf16": True}},
    )
    assert row[2:5] == ["0.90", "**no**", "BF16, date not recorded"]
    assert _row({"value": 3, "bound": 0.95, "pass": True})[1:5] == [
        "≥ 0.95",
        "3",
        "yes",
        "machine not recorded, date not recorded",
    ]


def test_the_estimate_row_quotes_the_last_pass_and_reports_the_first(tmp_path: Path) -> None:
    runs = [
        {"pass": 1, "cost": {"over_mid": 0.3118}},
        {"pass": 1, "cost": {"over_mid": 0.9}},
        {"pass": 2, "cost": {"over_mid": 1.2}},
    ]
    target = {"value": 1.2, "bound": "<= 1.5 (pass 2: ...)", "pass": True}
    line = render_row(
        Row("est", "estimates.json", "k", passes=True), {"targets": {"k": target}, "runs": runs}
    )
    assert "| 1.20 (pass 2; pass 1: 3.21, **no**) | yes |" in line
    (tmp_path / "estimates.json").write_text(json.dumps({"targets": {"k": target}, "runs": runs}))
    assert readme_table.unmapped(tmp_path, ("estimates.json",)) == ["estimates.json: k"]


def test_a_target_shown_from_a_later_run_or_left_empty_needs_no_row_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row of multi_job.freight_over_single_job quotes scheduler-cache-modes.json, the latest run
    of that target: scheduler.json's older figure of it needs no row; a partial run's empty targets
    (workloads it did not run) need none; a measured target shown nowhere still does."""
    shown = Row("multi-job", "scheduler-cache-modes.json", "multi_job.freight_over_single_job")
    monkeypatch.setattr(readme_table, "ROWS", (shown,))
    measured = {"value": 0.9, "bound": ">= 0.95", "pass": False}
    (tmp_path / "scheduler.json").write_text(json.dumps({"targets": {shown.key: measured}}))
    (tmp_path / "scheduler-x.json").write_text(
        json.dumps({"targets": {"blend.freight_over_limit": {"value": None}, "new.key": measured}})
    )
    assert readme_table.unmapped(tmp_path, ("scheduler.json", "scheduler-x.json")) == [
        "scheduler-x.json: new.key"
    ]


def test_a_scheduler_row_quotes_the_latest_run_that_measured_its_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run of some workloads after the full run (scheduler-kv-recheck.json) is what the rows of
    its targets quote; the others stay with the full run, and a later smoke run counts for none."""
    rows = (
        Row("dups", readme_table.SCHEDULER, "dups.freight_over_limit"),
        Row("blend", readme_table.SCHEDULER, "blend.freight_over_limit"),
    )
    monkeypatch.setattr(readme_table, "ROWS", rows)
    machine = {"cpu_flags": {"avx512_bf16": True}}

    def write(name: str, date: str, values: dict[str, float | None], **extra: object) -> None:
        targets = {
            k: {"value": v, "bound": ">= 1.2", "pass": bool(v and v >= 1.2)} for k, v in values.items()
        }
        data = {"generated_at": date, "machine": machine, "targets": targets, **extra}
        (tmp_path / name).write_text(json.dumps(data))

    write(
        "scheduler.json",
        "2026-11-30T06:42:11+0000",
        {"dups.freight_over_limit": 1.0, "blend.freight_over_limit": 0.98},
    )
    write(
        "scheduler-recheck.json",
        "2026-12-01T00:09:18+0000",
        {"dups.freight_over_limit": 1.16, "blend.freight_over_limit": None},
    )
    write("scheduler-quick.json", "2026-12-02T00:00:00+0000", {"dups.freight_over_limit": 9.0}, quick=True)
    table = readme_table.render(tmp_path)
    assert "| 1.16 |" in table and "`scheduler-recheck.json`: `dups.freight_over_limit`" in table
    assert "| 0.98 |" in table and "`scheduler.json`: `blend.freight_over_limit`" in table
    assert "9.00" not in table


def test_every_scheduler_target_has_a_row_in_its_workloads_order() -> None:
    from bench.scheduler import TARGETS

    rows = readme_table.scheduler_rows(
        (
            "dups.freight_over_limit",
            "unique_tight_kv.freight_over_limit",
            "blend_tight_kv.preemptions",
            "unique.freight_over_limit",
            "unique.freight_over_engine",
        )
    )
    assert [r.key for r in rows] == [
        "unique.freight_over_engine",
        "unique.freight_over_limit",
        "unique_tight_kv.freight_over_limit",
        "blend_tight_kv.preemptions",
        "dups.freight_over_limit",
    ]
    assert rows[2].label == "unique prompts, tight KV: Freight / the limit"
    assert rows[3].digits == 0 and rows[4].digits == 2
    assert {r.key for r in readme_table.ROWS if r.file == "scheduler.json"} == set(TARGETS)
