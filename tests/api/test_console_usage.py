"""The console's usage page and its CSV (api/views/console_usage.py): the signed-in tenant's
``freight report``, the same rows usage_report gives the CLI, and nobody else's."""

from __future__ import annotations

import csv
import io

from api.report_format import format_report
from api.services.reports import usage_report
from storage.models import Batch
from tests.api.test_console import alpha, api_batch, html, keys  # noqa: F401 (fixtures)
from tests.conftest import now


def finish(runtime, batch_id: str, completed: int, cost_micros: int, met: bool) -> None:
    """What finalization leaves on a completed batch."""
    with runtime.db.write() as s:
        b = s.get(Batch, batch_id)
        b.status, b.completed_at, b.model, b.sla_met = "completed", now() - 60, "demo", met
        b.request_total, b.request_completed = completed, completed
        b.prompt_tokens, b.cached_tokens, b.completion_tokens = (
            1000 * completed,
            400 * completed,
            50 * completed,
        )
        b.cost_micros, b.cost_input_micros, b.cost_output_micros = (
            cost_micros,
            cost_micros // 2,
            cost_micros // 2,
        )
        b.engine_seconds = 12.5


def test_usage_page_and_csv_are_the_tenants_report(app, runtime, keys, alpha):  # noqa: F811
    finish(runtime, api_batch(app, keys["a"])["id"], 10, 30_000, True)
    finish(runtime, api_batch(app, keys["a"])["id"], 6, 12_000, False)
    finish(runtime, api_batch(app, keys["b"])["id"], 999, 9_990_000, True)  # beta's, never shown
    page = html(alpha.get("/console/usage"))
    total = page[page.index('id="usage-total"') :].split("</tr>")[0]
    assert ">2<" in total and ">16<" in total  # alpha's two batches and their 16 requests
    assert '<td class="num cost">$0.042</td>' in total  # 30,000 + 12,000 micro-dollars
    assert '<td class="num sla">50.0% <span class="sub">(1/2)</span>' in total
    assert "999" not in page and "$9.99" not in page
    assert 'id="usage-demo"' in page  # the per-model row
    # the CSV is format_report's CSV of the same usage_report rows the CLI prints
    download = alpha.get("/console/usage.csv?since=7d")
    assert download.status_code == 200 and download.mimetype == "text/csv"
    assert "attachment" in download.headers["Content-Disposition"]
    body = download.get_data(as_text=True)
    rows = list(csv.DictReader(io.StringIO(body)))
    assert {r["tenant"] for r in rows} == {"alpha", "*"} and "beta" not in body
    assert rows[-1]["batches"] == "2" and rows[-1]["requests_completed"] == "16"
    t = now()
    expected = format_report(usage_report(runtime, t - 7 * 86400, t + 1, "alpha"), "csv")
    assert body.splitlines()[0] == expected.splitlines()[0]
    assert [line.split(",")[:10] for line in body.splitlines()] == [line.split(",")[:10] for line in expected.splitlines()]  # fmt: skip
    # a window with nothing of alpha's in it
    empty = html(alpha.get("/console/usage?since=2020-01-01&until=2020-01-02"))
    assert 'id="no-usage"' in empty
    for bad in ("since=yesterday", "since=1h&until=2h", "since=" + "1" * 41):
        response = alpha.get(f"/console/usage?{bad}")
        assert response.status_code == 400 and html(response), bad
    assert alpha.get("/console/usage.csv?since=bogus").status_code == 400
    assert app.test_client().get("/console/usage.csv").status_code == 302  # signed out: to sign-in


def test_the_usage_page_lists_the_tenants_adapters_only(app, runtime, keys, alpha):  # noqa: F811
    """LoRA adapters' lines (``adapter_report``, as ``freight report --by-adapter``): the tenant's
    own, under their base; another tenant's adapter usage is not on the page."""
    from storage.models import WorkUnit

    mine, theirs = api_batch(app, keys["a"])["id"], api_batch(app, keys["b"])["id"]
    for batch_id, adapter in ((mine, "demo-mine"), (theirs, "demo-theirs")):
        finish(runtime, batch_id, 3, 9_000, True)
        with runtime.db.write() as s:
            s.add(WorkUnit(batch_id=batch_id, seq=0, model="demo", shard_key="x", first_line=0, n_requests=3,
                           status="done", prompt_tokens=3000, cached_tokens=1200, completion_tokens=150,
                           cost_input_micros=4500, cost_output_micros=4500,
                           adapter_usage={adapter: [2, 2000, 800, 100]}))  # fmt: skip
    page = html(alpha.get("/console/usage"))
    row = page[page.index('id="adapter-usage-demo-mine"') :].split("</tr>")[0]
    assert ">demo-mine<" in row and ">demo<" in row and ">2<" in row and ">2,000<" in row
    assert (
        "$0.006" in row
    )  # 2/3 of each kind of the unit's charge: (1,200 of 1,800 uncached) and (100 of 150 output)
    assert "demo-theirs" not in page
