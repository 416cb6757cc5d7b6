"""infra/monitoring/dashboards: Grafana dashboards as JSON (fleet, engines per model, tenants'
usage and cost, SLA attainment). Every query (panel targets and template variables) names only
metrics that /metrics serves: read from a scrape of the real app over the test database (a family
is listed by its HELP line even while it has no series), and from the metric definitions; every
panel query parses as PromQL (promtool checks it as a recording rule, Grafana's variables put to
plain values). tests/e2e/test_alerts_live.py checks the same names against the live stack's scrape.
No Grafana server runs here: what a panel looks like is not tested."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from api.app import create_app
from tests.infra.promql_names import defined_metrics, metric_names

DASHBOARDS = Path(__file__).resolve().parents[2] / "infra" / "monitoring" / "dashboards"
TOKEN = "dashboards-scrape-token"
WANTED = {"freight-fleet", "freight-engines", "freight-tenants", "freight-sla"}
PROMETHEUS_OWN = {"up"}
# Grafana's variables, put to values PromQL parses
GRAFANA_VALUES = {"$__rate_interval": "5m", "$__range": "1h", "$__interval": "1m"}


def dashboards() -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def queries(dashboard: dict) -> list[str]:
    return [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]


def variable_metrics(dashboard: dict) -> set[str]:
    """The metric of each ``label_values(metric, label)`` template variable."""
    found = set()
    for variable in dashboard["templating"]["list"]:
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = re.fullmatch(r"label_values\((\w+),\s*\w+\)", query)
        assert match, query
        found.add(match.group(1))
    return found


def served_names(runtime) -> set[str]:
    app = create_app(replace(runtime.settings, metrics_token=TOKEN), runtime)
    response = app.test_client().get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200
    text = response.get_data(as_text=True)
    names = set(re.findall(r"^# HELP (\w+) ", text, re.M))
    # a counter's HELP names the family; its samples (what queries read) end in _total
    counters = set(re.findall(r"^# TYPE (\w+) counter$", text, re.M))
    return (names - counters) | {n if n.endswith("_total") else n + "_total" for n in counters}


def test_the_four_dashboards_are_there_with_panels_and_unique_ids() -> None:
    found = dashboards()
    assert set(found) == WANTED
    assert len({d["uid"] for d in found.values()}) == len(found)
    for name, d in found.items():
        assert d["title"].startswith("Freight: ") and d["panels"], name
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), name
        for panel in d["panels"]:
            assert panel["targets"] and panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]


def test_every_query_names_metrics_that_metrics_serves(runtime) -> None:
    served = served_names(runtime)
    assert defined_metrics() <= served, defined_metrics() - served
    for name, d in dashboards().items():
        read = set().union(*(metric_names(q) for q in queries(d))) | variable_metrics(d)
        assert read - PROMETHEUS_OWN, name
        assert read <= served | PROMETHEUS_OWN, (name, read - served)


def test_the_name_check_catches_a_metric_that_does_not_exist() -> None:
    assert metric_names('sum(rate(freight_tokens_totl{model=~"$model"}[$__rate_interval]))') == {
        "freight_tokens_totl"
    }
    assert not {"freight_tokens_totl"} <= defined_metrics()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus) not installed")
def test_every_panel_query_parses_as_promql(tmp_path: Path) -> None:
    rules = []
    for name, d in dashboards().items():
        for i, expr in enumerate(queries(d)):
            for variable, plain in GRAFANA_VALUES.items():
                expr = expr.replace(variable, plain)
            expr = re.sub(r"\$\w+", ".*", expr)  # a template variable inside a regex matcher
            rules.append({"record": f"check:{name.replace('-', '_')}:{i}", "expr": expr})
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    run = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(rules)} rules found" in run.stdout
