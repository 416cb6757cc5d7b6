"""The shipped alert rules fire for real: Debian's Prometheus, started here on a free loopback port
with a config this test writes, scrapes the live stack's /metrics with the metrics bearer token and
evaluates infra/monitoring/freight-alerts.yml (every ``for:`` cut to 0 s, scrape and evaluation
every second). A model registered with the CLI and given no engine worker gets a batch from a new
tenant whose queued-requests quota is 10: nine requests queued and no worker fires
FreightModelWithoutWorker for that model, and 9 of 10 fires FreightTenantNearQuota for that tenant.
On the model the stack's worker serves, a small batch gives the tick a measured throughput, then a
batch of AT_RISK_LINES lines in the stack's 8-second window cannot finish in time at it:
FreightBatchesAtRisk fires for that model (and FreightModelWithoutWorker does not). The live scrape
also serves every metric the dashboards (infra/monitoring/dashboards) query.

The `live` stack's API has no metrics token (tests/e2e/test_hostile_tenants.py checks /metrics
answers no one then), so /metrics is scraped from a second API process of the same stack (its
database, broker and store), started here with FREIGHT_METRICS_TOKEN, as an operator runs several.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from infra import daemons as services
from infra.processes import FREIGHT, REPO, _http_ok, create_tenant, spawn, wait_for
from tests.e2e.conftest import LiveStack, request_line, wait_final
from tests.factories import jsonl
from tests.infra.promql_names import metric_names

pytestmark = [
    pytest.mark.stack,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus not installed"),
]

MONITORING = REPO / "infra" / "monitoring"
MODEL = "demo-noworker"  # registered, never given an engine worker
TENANT = "alerts"
AT_RISK_LINES = 3000  # far more than the demo engine runs in 8 s on this machine
WANTED = {
    ("FreightModelWithoutWorker", "model", MODEL),
    ("FreightTenantNearQuota", "tenant", TENANT),
    ("FreightBatchesAtRisk", "model", "demo"),
}


def freight(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FREIGHT, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def fast_rules(out: Path) -> Path:
    """The shipped rules with every ``for:`` at 0 s (the expressions untouched)."""
    rules = yaml.safe_load((MONITORING / "freight-alerts.yml").read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            rule["for"] = "0s"
    path = out / "freight-alerts.yml"
    path.write_text(yaml.safe_dump(rules))
    return path


def firing(prometheus: str) -> list[dict]:
    with urllib.request.urlopen(f"{prometheus}/api/v1/alerts", timeout=10) as response:
        alerts = json.load(response)["data"]["alerts"]
    return [a for a in alerts if a["state"] == "firing"]


def scrape(api_url: str, token: str) -> str:
    request = urllib.request.Request(api_url + "/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return str(response.read().decode())


def start_batch_at_risk(live: LiveStack, metrics: Callable[[], str]) -> None:
    """A finished batch of the served model, then an engine sample of it (the measured rate the
    tick's deadline check reads), then AT_RISK_LINES lines in the 8 s window, left to expire."""
    client = live.client("alpha")
    warm = client.files.create(
        file=("w.jsonl", jsonl(request_line(f"w{i}", model="demo") for i in range(16))), purpose="batch"
    )
    first = client.batches.create(
        input_file_id=warm.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert getattr(wait_final(client, first.id, timeout=180), "status", None) == "completed"
    wait_for(lambda: "freight_worker_batch_fill_ratio{" in metrics(), "an engine sample of demo", 60)
    lines = (request_line(f"r{i}", model="demo") for i in range(AT_RISK_LINES))
    big = client.files.create(file=("risk.jsonl", jsonl(lines)), purpose="batch")
    client.batches.create(input_file_id=big.id, endpoint="/v1/chat/completions", completion_window="8s")


def test_prometheus_fires_the_shipped_rules_on_the_live_stack(live: LiveStack, tmp_path: Path) -> None:
    env = dict(live.stack.env)
    token = secrets.token_urlsafe(24)  # FREIGHT_METRICS_TOKEN wants 16 characters or more
    api_port, prom_port = services.free_port(), services.free_port()
    api_env = {**env, "FREIGHT_API_PORT": str(api_port), "FREIGHT_METRICS_TOKEN": token}
    api_url = f"http://127.0.0.1:{api_port}"
    prometheus = f"http://127.0.0.1:{prom_port}"
    added = freight(env, "models", "add", MODEL, "--path", str(live.model_dir), "--quantization", "none")
    assert added.returncode == 0, added.stderr[-2000:]
    client = None
    batch_id = None
    try:
        key = create_tenant(env, TENANT)
        quota = freight(env, "tenant", "quota", TENANT, "--queued-requests", "10")
        assert quota.returncode == 0, quota.stderr[-2000:]
        client = live.client("alpha").with_options(api_key=key)
        upload = client.files.create(
            file=("in.jsonl", jsonl(request_line(f"r{i}", model=MODEL) for i in range(9))), purpose="batch"
        )
        batch_id = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id

        api = spawn(tmp_path, "metrics-api", [*FREIGHT, "api"], api_env, REPO)
        wait_for(lambda: _http_ok(api_url + "/healthz"), "API", 60, api, tmp_path / "metrics-api.log")
        (tmp_path / "token").write_text(token)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(fast_rules(tmp_path))],
            "scrape_configs": [
                {
                    "job_name": "freight",
                    "authorization": {"credentials_file": str(tmp_path / "token")},
                    "static_configs": [{"targets": [f"127.0.0.1:{api_port}"]}],
                }
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        argv = [
            "prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
        ]  # fmt: skip
        prom = spawn(tmp_path, "prometheus", argv, env, REPO)
        wait_for(
            lambda: _http_ok(prometheus + "/-/ready"), "prometheus", 60, prom, tmp_path / "prometheus.log"
        )
        start_batch_at_risk(live, lambda: scrape(api_url, token))

        started = time.monotonic()
        seen: set[tuple[str, str, str]] = set()
        alerts: list[dict] = []
        while time.monotonic() - started < 120 and not seen >= WANTED:
            alerts = firing(prometheus)
            seen = {
                (a["labels"]["alertname"], label, a["labels"].get(label, ""))
                for a in alerts
                for label in ("model", "tenant")
                if label in a["labels"]
            }
            time.sleep(1)
        assert seen >= WANTED, (alerts, (tmp_path / "prometheus.log").read_text()[-3000:])
        fired_after = time.monotonic() - started
        # the served model has its worker; the stack's own tenants are under their quotas
        assert ("FreightModelWithoutWorker", "model", "demo") not in seen, alerts
        assert not [
            a
            for a in alerts
            if a["labels"]["alertname"] == "FreightTenantNearQuota" and a["labels"]["tenant"] != TENANT
        ], alerts
        print(f"alerts firing {fired_after:.1f} s after the batch at risk was created: {sorted(seen)}")

        # the target was scraped with the token, and serves every metric the dashboards read
        with urllib.request.urlopen(f"{prometheus}/api/v1/targets", timeout=10) as response:
            targets = json.load(response)["data"]["activeTargets"]
        assert [t["health"] for t in targets] == ["up"], targets
        text = scrape(api_url, token)
        served = set(re.findall(r"^# HELP (\w+) ", text, re.M))
        counters = set(re.findall(r"^# TYPE (\w+) counter$", text, re.M))
        served = (served - counters) | {c if c.endswith("_total") else c + "_total" for c in counters}
        for path in sorted((MONITORING / "dashboards").glob("*.json")):
            dashboard = json.loads(path.read_text())
            read = {n for p in dashboard["panels"] for t in p["targets"] for n in metric_names(t["expr"])}
            assert read - {"up"} <= served, (path.name, read - served)
    finally:
        services.stop_pidfile(tmp_path / "prometheus.pid")
        services.stop_pidfile(tmp_path / "metrics-api.pid")
        if client is not None and batch_id is not None:
            client.batches.cancel(batch_id)
            deadline = time.monotonic() + 60
            while client.batches.retrieve(batch_id).status != "cancelled" and time.monotonic() < deadline:
                time.sleep(0.5)
        removed = freight(env, "models", "remove", MODEL)
        assert removed.returncode == 0, removed.stderr[-2000:]
