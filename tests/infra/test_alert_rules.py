"""infra/monitoring/freight-alerts.yml: ``promtool check rules`` accepts it, ``promtool test rules``
passes its unit tests (infra/monitoring/freight-alerts.test.yml), every alert has a test in which it
fires and one in which it does not, and every metric a rule reads is one /metrics defines (or
Prometheus' own ``up``). promtool is Debian's ``prometheus`` package (infra/install.sh)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.infra.promql_names import defined_metrics, metric_names

MONITORING = Path(__file__).resolve().parents[2] / "infra" / "monitoring"
RULES = MONITORING / "freight-alerts.yml"
RULE_TESTS = MONITORING / "freight-alerts.test.yml"
PROMETHEUS_OWN = {"up"}

promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(promtool is None, reason="promtool (Debian's prometheus) not installed")


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


@needs_promtool
def test_promtool_checks_the_rules_and_passes_their_unit_tests() -> None:
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in check.stdout
    run = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name], cwd=MONITORING, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


@needs_promtool
def test_promtool_fails_a_rule_test_that_expects_the_wrong_alert(tmp_path: Path) -> None:
    """The unit tests can fail: the same file with one expected label changed does."""
    shutil.copy(RULES, tmp_path / RULES.name)
    text = RULE_TESTS.read_text().replace("exp_labels: { severity: critical, model: demo }", "exp_labels: { severity: critical, model: other }", 1)  # fmt: skip
    (tmp_path / RULE_TESTS.name).write_text(text)
    run = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name], cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode != 0 and "FreightModelWithoutWorker" in run.stdout + run.stderr


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in tests:
        for check in case["alert_rule_test"]:
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in alert_rules()}
    assert len(names) == len(alert_rules()) == 14
    assert fired == names, names ^ fired
    assert quiet == names, names ^ quiet


def test_every_rule_reads_metrics_that_exist() -> None:
    defined = defined_metrics() | PROMETHEUS_OWN
    for rule in alert_rules():
        read = metric_names(rule["expr"])
        assert read, rule["alert"]
        assert read <= defined, (rule["alert"], read - defined)
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"]
