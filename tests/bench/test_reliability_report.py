"""bench/reliability.py: the ``hostile`` section joins the slow-DNS tenant's run to the live stack's
attacks, and a trial run writes where ``--out`` says, never over bench/results/reliability.json
or docs/reliability.md."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from bench import reliability_doc
from bench.reliability import HOSTILE_TESTS, RESULT, hostile_section

REPO = Path(__file__).resolve().parents[2]


def attack(name: str, at_s: float | None) -> dict:
    return {"attack": name, "status": 400, "error_code": None, "detail": name, "at_s": at_s}


def hostile(**counts: int) -> dict:
    return {
        "scenario": "hostile", "lost": 0, "duplicated": 0, "server_errors": 0, **counts,
        "attacks": [attack("bomb", 3.0), attack("quota", 11.2)], "api_bomb_growth_mb": 1.0,
        "victims_done_at_s": 14.9, "log_tracebacks": {"api": 0}, "recorded_at": 100,
    }  # fmt: skip


def hostile_dns(**counts: int) -> dict:
    return {
        "scenario": "hostile_dns", "lost": 0, "duplicated": 0, "server_errors": 0, **counts,
        "attacks": [attack("webhook host names whose DNS never answers", None)],
        "victim_delivery_alone_s": [0.167, 0.04, 0.04], "victim_delivery_during_attack_s": [0.036, 0.047, 0.034],
        "hung_lookups": 2, "tenant_concurrency": 2, "attacker_deliveries": 12, "recorded_at": 200,
    }  # fmt: skip


def test_the_slow_dns_attack_sits_beside_the_others_with_its_figures() -> None:
    section = hostile_section({"hostile": hostile(), "hostile_dns": hostile_dns(duplicated=1), "load": {}})
    assert section is not None
    assert [a["attack"] for a in section["attacks"]] == [
        "bomb",
        "quota",
        "webhook host names whose DNS never answers",
    ]
    assert section["dns_victim_delivery_during_attack_s"] == [0.036, 0.047, 0.034]
    assert section["dns_victim_delivery_alone_s"] == [0.167, 0.04, 0.04]
    assert (section["dns_hung_lookups"], section["dns_tenant_concurrency"]) == (2, 2)
    assert section["dns_attacker_deliveries"] == 12 and section["dns_recorded_at"] == 200
    assert section["recorded_at"] == 100 and section["api_bomb_growth_mb"] == 1.0
    assert "log_tracebacks" not in section  # only the figures the section names
    # the counts are the two runs' together: a duplicated delivery shows in the section
    assert (section["lost"], section["duplicated"], section["server_errors"]) == (0, 1, 0)
    assert section["dns_duplicated"] == 1


def test_without_the_dns_run_the_section_is_the_live_stacks_alone() -> None:
    scenarios = {"hostile": hostile(server_errors=2)}
    section = hostile_section(scenarios)
    assert section is not None
    assert [a["attack"] for a in section["attacks"]] == ["bomb", "quota"]
    assert not [k for k in section if k.startswith("dns_")] and section["server_errors"] == 2
    section["attacks"].append(attack("x", 1.0))  # the section's list is its own
    assert len(scenarios["hostile"]["attacks"]) == 2
    assert hostile_section({"hostile_dns": hostile_dns()}) is None  # no section without the stack's run


def test_the_hostile_tests_are_the_ones_the_section_is_made_of() -> None:
    """``--hostile`` selects these by name: a renamed test would drop out of the section silently."""
    for name, path in zip(
        HOSTILE_TESTS, ("tests/e2e/test_hostile_tenants.py", "tests/workers/test_webhook_dns.py"), strict=True
    ):
        source = (REPO / path).read_text()
        assert re.search(rf"^def {name}\(", source, re.MULTILINE), (name, path)
        assert "pytest.mark.reliability" in source  # bench.reliability runs only -m reliability


def test_a_merge_writes_its_out_path_and_leaves_the_committed_result(tmp_path: Path) -> None:
    figures = tmp_path / "figures"
    figures.mkdir()
    (figures / "hostile_dns.json").write_text(json.dumps(hostile_dns()))
    committed, chapter = RESULT.read_bytes(), reliability_doc.DOC.read_bytes()
    out = tmp_path / "scratch" / "reliability.json"
    subprocess.run(
        [sys.executable, "-m", "bench.reliability", "--merge", str(figures), "--out", str(out)],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    assert RESULT.read_bytes() == committed
    assert reliability_doc.DOC.read_bytes() == chapter  # a trial run leaves docs/reliability.md alone
    written = json.loads(out.read_text())
    assert written["scenarios"]["hostile_dns"]["hung_lookups"] == 2
    # the committed file's hostile scenario, kept by the partial run, is joined by the new DNS run
    assert written["hostile"]["attacks"][-1]["attack"] == "webhook host names whose DNS never answers"
    assert written["hostile"]["dns_recorded_at"] == 200
    assert written["totals"] == {
        k: sum(e[k] for e in written["scenarios"].values()) for k in ("lost", "duplicated", "server_errors")
    }


def test_a_reliability_result_measures_the_tests_its_run_loads(tmp_path: Path) -> None:
    """The marked test modules and the support modules, not every test of tests/."""
    from bench.reliability import measures

    tests = tmp_path / "tests"
    (tests / "e2e").mkdir(parents=True)
    (tests / "conftest.py").write_text("")
    (tests / "factories.py").write_text("")
    (tests / "e2e" / "test_faults.py").write_text("import pytest\npytestmark = pytest.mark.reliability\n")
    (tests / "e2e" / "test_other.py").write_text("def test_x():\n    pass\n")
    assert measures(tests) == (
        "api",
        "scheduler",
        "storage",
        "workers",
        "bench/reliability.py",
        "tests/conftest.py",
        "tests/e2e/test_faults.py",
        "tests/factories.py",
    )
