"""The monthly usage statement (api/services/statements.py): ``freight report --statement`` as CSV
and Parquet, and the console usage page's downloads of the signed-in tenant's, read back on
SQLite and PostgreSQL: a row per batch created in the month, per model and the total, with tokens
by kind, the charge and the SLA verdict; nothing of another tenant or month."""

from __future__ import annotations

import csv
import io

import pyarrow.parquet as pq
import pytest

from scheduler.budgets import month_of
from storage.models import Batch
from tests.api.test_console import alpha, api_batch, html, keys  # noqa: F401 (fixtures)
from tests.conftest import now
from tests.factories import cli_on


def charge(runtime, batch_id: str, *, model: str, completed: int, cost_micros: int, multiplier: float,
           met: bool | None, status: str = "completed", created_at: int | None = None) -> None:  # fmt: skip
    """What metering and finalization leave on a batch: tokens, engine cost by kind, the verdict."""
    with runtime.db.write() as s:
        b = s.get(Batch, batch_id)
        b.status, b.model, b.sla_met, b.price_multiplier = status, model, met, multiplier
        b.request_total = b.request_completed = completed
        b.prompt_tokens, b.cached_tokens, b.completion_tokens = (
            1000 * completed,
            400 * completed,
            50 * completed,
        )
        b.cost_micros = cost_micros
        b.cost_input_micros, b.cost_cached_micros = cost_micros // 2, cost_micros // 10
        b.cost_output_micros = cost_micros - b.cost_input_micros - b.cost_cached_micros
        b.engine_seconds = 12.5
        if created_at is not None:
            b.created_at = created_at


@pytest.fixture
def month(app, runtime, keys) -> dict[str, str]:  # noqa: F811
    """Alpha's three batches this month (two of demo, one of other, one of them running and x2 priced),
    one of last month's, and beta's one."""
    ids = {name: api_batch(app, keys["a"])["id"] for name in ("d1", "d2", "o1", "old")}
    charge(runtime, ids["d1"], model="demo", completed=10, cost_micros=30_000, multiplier=1.0, met=True)
    charge(runtime, ids["d2"], model="demo", completed=6, cost_micros=12_000, multiplier=2.0, met=False,
           status="in_progress")  # fmt: skip
    charge(runtime, ids["o1"], model="other", completed=3, cost_micros=5_000, multiplier=1.0, met=None)
    charge(runtime, ids["old"], model="demo", completed=99, cost_micros=990_000, multiplier=1.0, met=True,
           created_at=month_of(now()).start - 10)  # fmt: skip
    beta = api_batch(app, keys["b"])["id"]
    charge(runtime, beta, model="demo", completed=7, cost_micros=7_777, multiplier=1.0, met=True)
    return ids


def check_rows(rows: list[dict], ids: dict[str, str]) -> None:
    """The rows as strings or typed values alike: compared through str()."""
    by_batch = {r["batch_id"]: r for r in rows if r["row"] == "batch"}
    assert set(by_batch) == {ids["d1"], ids["d2"], ids["o1"]}  # not last month's, not beta's
    d2 = by_batch[ids["d2"]]
    assert (d2["model"], d2["status"], str(d2["sla_met"]).lower()) == ("demo", "in_progress", "false")
    assert float(d2["cost"]) == pytest.approx(0.024)  # $0.012 engine cost x2
    assert float(d2["cost_input"]) + float(d2["cost_cached"]) + float(d2["cost_output"]) == pytest.approx(
        0.024
    )
    assert (
        int(d2["prompt_tokens"]) == 6000
        and int(d2["cached_tokens"]) == 2400
        and int(d2["output_tokens"]) == 300
    )
    models = {r["model"]: r for r in rows if r["row"] == "model"}
    assert set(models) == {"demo", "other"}
    assert int(models["demo"]["batches"]) == 2 and float(models["demo"]["cost"]) == pytest.approx(0.054)
    assert int(models["demo"]["sla_met_batches"]) == 1 and int(models["demo"]["sla_batches"]) == 2
    [total] = [r for r in rows if r["row"] == "total"]
    assert rows[-1] == total and int(total["batches"]) == 3 and int(total["requests_completed"]) == 19
    assert float(total["cost"]) == pytest.approx(0.059)  # what the budget counts as spent this month
    assert {r["tenant"] for r in rows} == {"alpha"} and {r["period"] for r in rows} == {month_of(now()).key}


def test_freight_report_statement_as_csv_and_parquet(runtime, month):
    key = month_of(now()).key
    result = cli_on(runtime, "report", "--statement", key, "--tenant", "alpha", "--format", "csv")
    assert result.exit_code == 0, result.output
    check_rows(list(csv.DictReader(io.StringIO(result.output))), month)
    result = cli_on(runtime, "report", "--statement", key, "--tenant", "alpha", "--format", "parquet")
    assert result.exit_code == 0, result.output
    table = pq.read_table(io.BytesIO(result.stdout_bytes))
    assert (
        str(table.schema.field("cost").type) == "double" and str(table.schema.field("sla_met").type) == "bool"
    )
    check_rows(table.to_pylist(), month)
    # last month: only the old batch
    last = month_of(month_of(now()).start - 1).key
    result = cli_on(runtime, "report", "--statement", last, "--tenant", "alpha", "--format", "csv")
    assert [r["batch_id"] for r in csv.DictReader(io.StringIO(result.output))] == [month["old"], "*", "*"]
    for argv, said in (
        (("--statement", key, "--format", "csv"), "needs --tenant"),
        (("--statement", "2026-13", "--tenant", "alpha", "--format", "csv"), "YYYY-MM"),
        (("--statement", key, "--tenant", "alpha"), "csv or parquet"),
        (("--statement", key, "--tenant", "nobody", "--format", "csv"), "no tenant named"),
    ):
        result = cli_on(runtime, "report", *argv)
        assert result.exit_code != 0 and said in result.output, (argv, result.output)


def test_the_console_downloads_the_signed_in_tenants_statement(app, runtime, month, alpha):  # noqa: F811
    page = html(alpha.get("/console/usage"))
    assert 'id="statement-csv"' in page and f'value="{month_of(now()).key}"' in page
    download = alpha.get("/console/usage/statement.csv")  # this month by default
    assert download.status_code == 200 and download.mimetype == "text/csv"
    assert f"freight-statement-{month_of(now()).key}.csv" in download.headers["Content-Disposition"]
    check_rows(list(csv.DictReader(io.StringIO(download.get_data(as_text=True)))), month)
    parquet = alpha.get(f"/console/usage/statement.parquet?month={month_of(now()).key}")
    assert parquet.status_code == 200
    check_rows(pq.read_table(io.BytesIO(parquet.get_data())).to_pylist(), month)
    for bad in ("2026-1", "x" * 100, "2026-00"):
        assert alpha.get(f"/console/usage/statement.csv?month={bad}").status_code == 400, bad
    assert app.test_client().get("/console/usage/statement.csv").status_code == 302  # signed out
    # the page shows the month's budget once the operator sets one: $0.059 of $1 spent this month
    assert 'id="budget"' not in page
    assert cli_on(runtime, "tenant", "budget", "alpha", "--monthly", "1").exit_code == 0
    shown = html(alpha.get("/console/usage"))
    line = shown[shown.index('id="budget"') :].split("</p>")[0]
    assert (
        "$0.059 spent of" in line
        and "$1.00" in line
        and "5.9%" in line
        and "refused once it is spent" in line
    )
