"""The console's usage page: the signed-in tenant's ``freight report`` (cost, tokens, SLA
attainment, goodput per model, and the total) over a window, and the same rows as CSV; below it,
its LoRA adapters' lines (``freight report --by-adapter``), when it has any; and the monthly
usage statement (``freight report --statement``) as CSV or Parquet.

One use case, one function: the rows are ``api.services.reports.usage_report``'s, as the CLI
prints them, always filtered to this tenant (by its name, which is unique), and the CSV is
``api.report_format.format_report``'s (formula cells neutralised). The window takes the CLI's
forms (``7d``, ``24h``, an ISO date). Its routes join the console's blueprint, so its session
check and error pages apply.
"""

from __future__ import annotations

import time

from flask import Response, g, render_template, request

from api.report_format import format_report
from api.services.adapter_usage import adapter_report
from api.services.reports import ALL, ReportRow, parse_since, usage_report
from api.services.statements import StatementRow, statement, statement_csv, statement_parquet
from api.views.console import ConsoleError, bp, rt
from scheduler.budgets import BudgetState, month_named, month_of
from storage.budgets import budget_state
from storage.models import Tenant

DEFAULT_SINCE = "7d"  # as `freight report`
MAX_WINDOW_TEXT = 40


def _rows() -> tuple[list[ReportRow], str, str, float, float]:
    now = time.time()
    since_text = request.args.get("since", "").strip() or DEFAULT_SINCE
    until_text = request.args.get("until", "").strip()
    times = {}
    for name, text in (("since", since_text), ("until", until_text)):
        if len(text) > MAX_WINDOW_TEXT:
            raise ConsoleError(400, f"{name} is at most {MAX_WINDOW_TEXT} characters")
        try:
            times[name] = parse_since(text, now) if text else now
        except ValueError as exc:
            raise ConsoleError(400, f"{name}: {exc}") from None
    if times["until"] <= times["since"]:
        raise ConsoleError(400, "until must be later than since")
    rows = usage_report(rt(), times["since"], times["until"], tenant=g.tenant_name)
    return rows, since_text, until_text, times["since"], times["until"]


@bp.get("/usage")
def usage_page() -> str:
    rows, since, until, start, end = _rows()
    total = rows[-1]  # usage_report always ends with the total row
    assert total.tenant == ALL
    return render_template(
        "console/usage.html",
        rows=rows[:-1],
        total=total,
        adapters=adapter_report(rt(), start, end, tenant=g.tenant_name),  # `report --by-adapter`'s
        since=since,
        until=until,
        start=start,
        end=end,
        month=month_of(time.time()).key,
        budget=_budget(),
    )


def _budget() -> BudgetState | None:
    """The tenant's monthly budget and this month's spend (None: it has none)."""
    with rt().db.read() as s:
        tenant = s.get(Tenant, g.tenant_id)
        return budget_state(s, tenant, time.time()) if tenant is not None else None


@bp.get("/usage.csv")
def usage_csv() -> Response:
    rows, *_ = _rows()
    response = Response(format_report(rows, "csv"), mimetype="text/csv")
    response.headers["Content-Disposition"] = 'attachment; filename="freight-usage.csv"'
    return response


def _statement_rows() -> tuple[list[StatementRow], str]:
    text = request.args.get("month", "").strip() or month_of(time.time()).key
    try:
        period = month_named(text[:MAX_WINDOW_TEXT])
    except ValueError as exc:
        raise ConsoleError(400, f"month: {exc}") from None
    return statement(rt(), g.tenant_name, period), period.key


@bp.get("/usage/statement.csv")
def statement_csv_download() -> Response:
    """The month's usage statement (``freight report --statement``) of the signed-in tenant."""
    rows, key = _statement_rows()
    response = Response(statement_csv(rows), mimetype="text/csv")
    response.headers["Content-Disposition"] = f'attachment; filename="freight-statement-{key}.csv"'
    return response


@bp.get("/usage/statement.parquet")
def statement_parquet_download() -> Response:
    rows, key = _statement_rows()
    response = Response(statement_parquet(rows), mimetype="application/vnd.apache.parquet")
    response.headers["Content-Disposition"] = f'attachment; filename="freight-statement-{key}.parquet"'
    return response
