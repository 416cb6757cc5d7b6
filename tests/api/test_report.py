"""The usage report (``usage_report``, ``parse_since``, its formats and ``freight report``) over a
database seeded through the ORM, on SQLite and PostgreSQL."""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import asdict, fields
from datetime import UTC, datetime

import pytest
from click.testing import CliRunner

from api.cli import main
from api.report_format import format_csv, format_json, format_parquet, format_table
from api.services.reports import ReportRow, parse_since, usage_report
from api.services.tenants import create_tenant
from storage.models import Batch, StoredFile, WorkUnit
from storage.runtime import Runtime

T = int(datetime(2027, 1, 15, tzinfo=UTC).timestamp())  # window [T, T + 2 h)
UNTIL = T + 7200
STAMP = {
    "completed": "completed_at",
    "failed": "failed_at",
    "expired": "expired_at",
    "cancelled": "cancelled_at",
}


def add_batch(s, tenant_id: str, model: str | None, status: str, at: int | None, units=(), **columns):
    """A batch in ``status``, stamped final at ``at``, with work units of (engine_seconds, fill, mfu, mbu)."""
    f = StoredFile(
        tenant_id=tenant_id, purpose="batch", filename="in.jsonl", bytes=1, object_key="k", created_at=T
    )
    s.add(f)
    s.flush()
    b = Batch(
        tenant_id=tenant_id, endpoint="/v1/chat/completions", model=model, input_file_id=f.id,
        completion_window="24h", status=status, created_at=T - 3600, expires_at=T + 86400, **columns,
    )  # fmt: skip
    if status in STAMP:
        setattr(b, STAMP[status], at)
    s.add(b)
    s.flush()
    for seq, (secs, fill, mfu, mbu) in enumerate(units):
        s.add(
            WorkUnit(
                batch_id=b.id, seq=seq, model=model or "demo", shard_key="x", first_line=0, n_requests=1,
                status="done", engine_seconds=secs, mean_fill=fill, mfu=mfu, mbu=mbu,
            )
        )  # fmt: skip
    return b


def seed(rt: Runtime) -> None:
    alpha, _ = create_tenant(rt.db, "alpha", T)
    beta, _ = create_tenant(rt.db, "beta", T)
    a, b = alpha.id, beta.id
    with rt.db.write() as s:
        # alpha/demo: two batches at x1.5 with odd costs, so each charge rounds half up on its own
        add_batch(
            s, a, "demo", "completed", T, units=[(15.0, 0.8, 0.3, 0.5), (5.0, 0.4, None, 0.1)],
            sla_met=True, request_total=10, request_completed=10, prompt_tokens=1000, cached_tokens=400,
            completion_tokens=500, engine_seconds=20.0, cost_micros=3001, cost_input_micros=1001,
            cost_cached_micros=500, cost_output_micros=1500, price_multiplier=1.5, list_price_micros=10_000,
            planned_prompt_tokens=1000, planned_cached_tokens=700,
        )  # fmt: skip
        add_batch(
            s, a, "demo", "expired", T + 200, units=[(10.0, None, 0.2, None)],
            sla_met=False, request_total=8, request_completed=5, request_failed=3, prompt_tokens=600,
            completion_tokens=300, engine_seconds=10.0, cost_micros=1003, cost_input_micros=501,
            cost_output_micros=502, price_multiplier=1.5, planned_prompt_tokens=600, planned_cached_tokens=260,
        )  # fmt: skip
        # alpha/other: the last second of the window
        add_batch(
            s, a, "other", "completed", UNTIL - 1, sla_met=True, request_total=4, request_completed=4,
            prompt_tokens=200, cached_tokens=100, completion_tokens=100, engine_seconds=5.0, cost_micros=1000,
            cost_input_micros=400, cost_cached_micros=100, cost_output_micros=500, list_price_micros=1500,
        )  # fmt: skip
        # alpha: a file that failed validation (no model, no verdict)
        add_batch(s, a, None, "failed", T + 50)
        # beta/demo at x0.75, and a cancelled batch (no verdict)
        add_batch(
            s, b, "demo", "completed", T + 3600, units=[(40.0, 0.5, 0.1, 0.2)],
            sla_met=True, request_total=20, request_completed=20, prompt_tokens=2000, cached_tokens=1000,
            completion_tokens=1000, engine_seconds=40.0, cost_micros=7000, cost_input_micros=3000,
            cost_cached_micros=1000, cost_output_micros=3000, price_multiplier=0.75, list_price_micros=20_000,
            planned_prompt_tokens=2000, planned_cached_tokens=1600,
        )  # fmt: skip
        add_batch(s, b, "demo", "cancelled", T + 300)
        # left out: finished at the window's end, before its start, still running, still cancelling
        noise = dict(
            request_total=99, request_completed=99, prompt_tokens=9999, completion_tokens=9999, sla_met=False,
            engine_seconds=999.0, cost_micros=999_999, price_multiplier=1.0, list_price_micros=1,
            units=[(500.0, 0.01, 0.01, 0.01)], planned_prompt_tokens=9999, planned_cached_tokens=1,
        )  # fmt: skip
        add_batch(s, a, "demo", "completed", UNTIL, **noise)
        add_batch(s, a, "demo", "completed", T - 1, **noise)
        add_batch(s, b, "demo", "in_progress", None, in_progress_at=T + 10, **noise)
        add_batch(s, b, "demo", "cancelling", None, cancelling_at=T + 10, **noise)
        add_batch(s, b, "demo", "finalizing", None, finalizing_at=T + 10, **noise)


@pytest.fixture
def seeded(runtime):
    seed(runtime)
    return runtime


def by_key(rows: list[ReportRow]) -> dict[tuple[str, str], ReportRow]:
    return {(r.tenant, r.model): r for r in rows}


def test_report_rows_totals_and_window(seeded):
    rows = usage_report(seeded, T, UNTIL, None, None)
    assert [(r.tenant, r.model) for r in rows] == [
        ("alpha", "-"), ("alpha", "demo"), ("alpha", "other"), ("beta", "demo"), ("*", "*"),
    ]  # fmt: skip
    rows_by = by_key(rows)

    ad = rows_by[("alpha", "demo")]
    assert (ad.batches, ad.requests_completed, ad.requests_failed) == (2, 15, 3)
    assert (ad.prompt_tokens, ad.cached_tokens, ad.output_tokens, ad.engine_seconds) == (1600, 400, 800, 30.0)
    # 3001 x 1.5 = 4501.5 -> 4502 and 1003 x 1.5 = 1504.5 -> 1505 (rounding the sum would give 6006)
    assert ad.cost == 6007 / 1e6
    assert ad.cost_per_1m_tokens == 6007 / 2400
    assert ad.cost_per_1m_input == (1502 + 752) / 1200  # over uncached prompt tokens
    assert ad.cost_per_1m_cached_input == 750 / 400
    assert ad.cost_per_1m_output == (2250 + 753) / 800
    assert ad.list_price == 0.01
    assert ad.saving == 1 - 4502 / 10_000  # only the batch that has a list price
    assert ad.cache_hit_rate == 0.25
    assert ad.planned_cache_hit_rate == (700 + 260) / 1600  # what the plans predicted, beside it
    assert ad.mean_fill == pytest.approx((0.8 * 15 + 0.4 * 5) / 20)
    assert ad.mfu == pytest.approx((0.3 * 15 + 0.2 * 10) / 25)
    assert ad.mbu == pytest.approx((0.5 * 15 + 0.1 * 5) / 20)
    assert ad.output_tok_s == 800 / 30
    assert (ad.sla_batches, ad.sla_met, ad.sla_attainment) == (2, 1, 0.5)
    assert (ad.goodput_batches_per_hour, ad.goodput_requests_per_hour) == (0.5, 5.0)

    ao = rows_by[("alpha", "other")]
    assert ao.cost == 0.001 and ao.saving == 1 - 1000 / 1500 and ao.list_price == 0.0015
    assert ao.mean_fill is None and ao.mfu is None and ao.mbu is None  # no work units
    assert (ao.sla_batches, ao.sla_attainment, ao.goodput_requests_per_hour) == (1, 1.0, 2.0)

    invalid = rows_by[("alpha", "-")]
    assert invalid.batches == 1 and invalid.cost == 0 and invalid.cost_per_1m_tokens is None
    assert invalid.list_price is None and invalid.saving is None and invalid.cache_hit_rate is None
    assert (
        invalid.planned_cache_hit_rate is None and rows_by[("alpha", "other")].planned_cache_hit_rate is None
    )
    assert (invalid.sla_batches, invalid.sla_attainment, invalid.goodput_batches_per_hour) == (0, None, 0.0)

    bd = rows_by[("beta", "demo")]
    assert (bd.batches, bd.requests_completed, bd.cost, bd.list_price) == (2, 20, 5250 / 1e6, 0.02)
    assert (bd.sla_batches, bd.sla_met, bd.sla_attainment) == (1, 1, 1.0)  # the cancelled one has no verdict
    assert bd.mean_fill == pytest.approx(0.5)
    assert bd.planned_cache_hit_rate == 0.8

    total = rows_by[("*", "*")]
    assert (total.batches, total.requests_completed, total.requests_failed) == (6, 39, 3)
    assert (total.prompt_tokens, total.cached_tokens, total.output_tokens) == (3800, 1500, 1900)
    assert total.engine_seconds == pytest.approx(75.0)
    assert total.cost == 12_257 / 1e6
    assert total.cost_per_1m_tokens == 12_257 / 5700
    assert total.list_price == 0.0315 and total.saving == 1 - 10_752 / 31_500
    assert (total.sla_batches, total.sla_met, total.sla_attainment) == (4, 3, 0.75)
    assert total.goodput_batches_per_hour == 1.5
    assert total.goodput_requests_per_hour == (10 + 4 + 20) / 2
    assert total.mean_fill == pytest.approx((12 + 2 + 20) / 60)
    assert total.planned_cache_hit_rate == (960 + 1600) / 3600

    # the bounds: [since, until)
    later = by_key(usage_report(seeded, T + 1, UNTIL, None, None))
    assert later[("alpha", "demo")].batches == 1 and later[("*", "*")].batches == 5
    wider = by_key(usage_report(seeded, T, UNTIL + 1, None, None))
    assert wider[("alpha", "demo")].batches == 3 and wider[("*", "*")].batches == 7


def test_report_filters(seeded):
    beta = usage_report(seeded, T, UNTIL, "beta", None)
    assert [(r.tenant, r.model) for r in beta] == [("beta", "demo"), ("*", "*")]
    assert asdict(beta[1]) == {**asdict(beta[0]), "tenant": "*", "model": "*"}

    demo = usage_report(seeded, T, UNTIL, None, "demo")
    assert [(r.tenant, r.model) for r in demo] == [("alpha", "demo"), ("beta", "demo"), ("*", "*")]
    assert demo[-1].cost == (6007 + 5250) / 1e6 and demo[-1].sla_attainment == 2 / 3

    other = usage_report(seeded, T, UNTIL, "alpha", "other")
    assert [(r.tenant, r.model, r.batches) for r in other] == [("alpha", "other", 1), ("*", "*", 1)]

    nobody = usage_report(seeded, T, UNTIL, "nobody", None)
    assert [(r.tenant, r.batches, r.cost, r.sla_attainment) for r in nobody] == [("*", 0, 0.0, None)]
    with pytest.raises(ValueError, match="empty window"):
        usage_report(seeded, UNTIL, T, None, None)


NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7d", NOW - 7 * 86400),
        ("24h", NOW - 86400),
        ("90m", NOW - 5400),
        ("3600s", NOW - 3600),
        (" 1.5h ", NOW - 5400),
        ("2026-11-01", datetime(2026, 11, 1, tzinfo=UTC).timestamp()),
        ("2026-11-01T12:00:00Z", datetime(2026, 11, 1, 12, tzinfo=UTC).timestamp()),
        ("2026-11-01T12:00:00", datetime(2026, 11, 1, 12, tzinfo=UTC).timestamp()),  # naive: UTC
        ("2026-11-01T14:00:00+02:00", datetime(2026, 11, 1, 12, tzinfo=UTC).timestamp()),
    ],
)
def test_parse_since(text: str, expected: float) -> None:
    assert parse_since(text, NOW) == expected


@pytest.mark.parametrize("text", ["", "7", "7w", "-5d", "d7", "yesterday", "2026-13-01", "2026-11-01 junk"])
def test_parse_since_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="not a time") as err:
        parse_since(text, NOW)
    assert repr(text) in str(err.value)


def test_formats(seeded):
    rows = usage_report(seeded, T, UNTIL, None, None)

    parsed = list(csv.DictReader(io.StringIO(format_csv(rows))))
    assert [tuple(r) for r in parsed] == [tuple(f.name for f in fields(ReportRow))] * len(rows)
    assert [(r["tenant"], r["model"]) for r in parsed] == [(r.tenant, r.model) for r in rows]
    assert float(parsed[1]["cost"]) == 6007 / 1e6 and int(parsed[1]["batches"]) == 2
    assert float(parsed[-1]["sla_attainment"]) == 0.75
    assert parsed[0]["saving"] == "" and parsed[0]["sla_attainment"] == ""  # None
    assert float(parsed[1]["planned_cache_hit_rate"]) == 0.6 and parsed[0]["planned_cache_hit_rate"] == ""

    assert json.loads(format_json(rows)) == [asdict(r) for r in rows]
    assert json.loads(format_json(rows))[1]["planned_cache_hit_rate"] == 0.6

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(format_parquet(rows)))
    assert table.schema.field("planned_cache_hit_rate").type == pa.float64()
    assert table.column("planned_cache_hit_rate").to_pylist() == [r.planned_cache_hit_rate for r in rows]

    lines = format_table(rows).splitlines()
    assert len({len(line) for line in lines}) == 1  # aligned: every line as wide as the header
    assert lines[0].split()[:3] == ["tenant", "model", "batches"] and set(lines[1]) == {"-", " "}
    body = [line.split() for line in lines[2:] if set(line) != {"-", " "}]
    assert [b[:3] for b in body] == [
        ["alpha", "-", "1"], ["alpha", "demo", "2"], ["alpha", "other", "1"], ["beta", "demo", "2"],
        ["*", "*", "6"],
    ]  # fmt: skip
    assert set(lines[-2]) == {"-", " "}  # a rule above the total
    assert "$0.006007" in body[1] and "25.0%" in body[1] and "1/2" in body[1] and "50.0%" in body[1]
    assert "plan hit" in lines[0]  # the planned hit rate, right after the reported one
    assert body[1][body[1].index("25.0%") + 1] == "60.0%"
    assert "$0.01226" in body[-1] and "3/4" in body[-1] and "75.0%" in body[-1]


def test_cli_report(seeded, monkeypatch):
    for name in [n for n in os.environ if n.startswith("FREIGHT_")]:
        monkeypatch.delenv(name)
    env = {
        "FREIGHT_DATABASE_URL": seeded.settings.database_url,
        "FREIGHT_DATA_DIR": str(seeded.settings.data_dir),
    }
    runner = CliRunner()
    window = ["--since", "2027-01-15", "--until", "2027-01-15T02:00:00Z"]

    result = runner.invoke(main, ["report", *window, "--format", "json"], env=env)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [asdict(r) for r in usage_report(seeded, T, UNTIL, None, None)]

    result = runner.invoke(main, ["report", *window, "--tenant", "beta", "--format", "csv"], env=env)
    assert result.exit_code == 0, result.output
    assert [r["tenant"] for r in csv.DictReader(io.StringIO(result.output))] == ["beta", "*"]

    result = runner.invoke(main, ["report", *window, "--model", "other"], env=env)
    assert result.exit_code == 0, result.output
    assert [line.split()[:2] for line in result.output.splitlines()[2:] if set(line) != {"-", " "}] == [
        ["alpha", "other"], ["*", "*"],
    ]  # fmt: skip

    result = runner.invoke(main, ["report", "--since", "last week"], env=env)
    assert result.exit_code == 2 and "--since" in result.output and "not a time" in result.output
    result = runner.invoke(main, ["report", *window[2:], "--since", "2027-01-16"], env=env)
    assert result.exit_code == 2 and "--until" in result.output and "later than --since" in result.output
