"""bench/reliability_doc.py: docs/reliability.md's figures are exactly what the generator writes
from the committed bench/results/reliability.json, every doc row is a scenario some test records,
and the templates on a small synthetic file show a missing scenario, a missing figure and an older
record as such instead of a number."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from bench import reliability_doc
from bench.reliability import writes_the_doc
from bench.reliability_scenarios import SCENARIOS

REPO = Path(__file__).resolve().parents[2]

STARTED, FINISHED = 1_795_921_800, 1_795_921_900  # 2026-11-29 03:10:00 and 03:11:40 UTC


def synthetic() -> dict:
    """A partial run's file: one scenario recorded by the run, one older and missing a figure."""
    return {
        "generated_at": "2026-11-29T03:11:40+00:00",
        "pytest": {"exit_code": 0, "summary": "2 passed"},
        "provenance": {
            "command": "python -m bench.reliability -k sigterm",
            "code": {"revision": "abcdef0123456789", "dirty": True, "dirty_measured": ["workers/run.py"]},
            "machine": {"cpu_model": "Test CPU", "cores": 2},
            "started_at": "2026-11-29T03:10:00+0000",
            "finished_at": "2026-11-29T03:11:40+0000",
        },
        "scenarios": {
            "worker_sigterm": {
                "scenario": "worker_sigterm", "lost": 0, "duplicated": 0, "server_errors": 0, "requests": 1256,
                "drain_s": 14.2, "bound_s": 45, "exit_code": 0, "released_units": 2, "recorded_at": STARTED + 50,
            },
            "redis_restart": {  # recorded two days before, without its recovery_s
                "scenario": "redis_restart", "lost": 1, "duplicated": 0, "server_errors": 0, "requests": 480,
                "downtime_s": 2.15, "recorded_at": STARTED - 2 * 86400,
            },
            "brand_new": {
                "scenario": "brand_new", "lost": 0, "duplicated": 0, "server_errors": 3, "widgets": 7,
                "recorded_at": STARTED + 60,
            },
        },
    }  # fmt: skip


def row(part: str, title: str) -> list[str]:
    line = next(ln for ln in part.splitlines() if ln.startswith(f"| {title} |"))
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]


def test_the_chapter_is_exactly_what_the_committed_file_gives() -> None:
    text = reliability_doc.DOC.read_text()
    committed = json.loads(reliability_doc.RESULT.read_text())
    assert reliability_doc.generated_part(text) == reliability_doc.render(committed), (
        "run python -m bench.reliability_doc --write"
    )
    # the prose outside the markers holds the parts that quote no run
    outside = text.replace(reliability_doc.generated_part(text), "")
    assert "**What backs them.**" in outside and "**Deploying workers.**" in outside


def test_a_record_fills_its_template_and_a_missing_figure_says_so() -> None:
    part = reliability_doc.render(synthetic())
    sigterm = row(part, "worker SIGTERM")
    assert sigterm[2:5] == ["0", "0", "0"] and sigterm[6] == "2026-11-29"
    assert sigterm[5] == (
        "1,256 requests; exit code 0 after 14.2 s (bound 45 s); 2 units handed back unfinished, "
        "none needed a second attempt"
    )
    redis = row(part, "Redis restarted (no persistence)")
    assert redis[2] == "1" and redis[6] == "2026-11-27"
    assert "Redis down 2.15 s" in redis[5]
    assert "first unit recorded [`recovery_s` not recorded] s after" in redis[5]


def test_a_scenario_without_a_record_is_listed_as_such() -> None:
    part = reliability_doc.render(synthetic())
    cut = row(part, "engine host cut off")
    none = reliability_doc.NONE
    assert cut[2:] == [none, none, none, reliability_doc.NO_RECORD, none]
    titles = [ln.split(" | ")[0][2:] for ln in part.splitlines() if ln.startswith("| ") and " | " in ln]
    table_titles = titles[1 : 1 + len(SCENARIOS) + 1]
    assert table_titles[: len(SCENARIOS)] == [s.title for s in SCENARIOS]  # the fixed order
    # a scenario the generator does not know still gets its row, with its figures as recorded
    assert row(part, "`brand_new`")[4:6] == ["3", "widgets 7"]


def test_the_run_line_names_the_command_and_the_records_it_did_not_make() -> None:
    line = reliability_doc.provenance_line(synthetic())
    assert "`python -m bench.reliability -k sigterm`" in line
    assert "abcdef0 with uncommitted changes to workers/run.py" in line
    assert "from 2026-11-29 03:10 to 03:11 UTC, on Test CPU, 2 cores (pytest: 2 passed)" in line
    assert line.endswith("by date: 2026-11-27: `redis_restart`.")  # brand_new is the run's own
    data = synthetic()
    del data["provenance"]
    assert "a run that recorded no command" in reliability_doc.provenance_line(data)


def test_the_hostile_part_comes_from_the_section_or_says_there_is_none() -> None:
    assert reliability_doc.NO_RECORD in reliability_doc.hostile_part(None)
    section = {
        "attacks": [
            {"at_s": 3.14, "attack": "bomb | pipe", "status": 400, "error_code": "file_too_large", "detail": "a<b"},
            {"at_s": None, "attack": "dns", "status": "pending", "error_code": None, "detail": "hung"},
        ],
        "victims_done_at_s": 18.0, "api_bomb_growth_mb": 33.7, "control_sum_bound_mb": 300,
        "dns_victim_delivery_during_attack_s": [0.049, 0.033], "dns_hung_lookups": 2,
    }  # fmt: skip
    part = reliability_doc.hostile_part(section)
    assert "2 attacks recorded" in part and "done 18.0 s after they submitted" in part
    assert "grew 33.7 MB over its [`api_baseline_rss_mb` not recorded] MB baseline" in part
    assert "in 0.033-0.049 s during the attack against [`dns_alone_range` not recorded] s" in part
    assert "| 3.14 | bomb \\| pipe | 400 `file_too_large` | a&lt;b |" in part
    assert f"| {reliability_doc.NONE} | dns | pending | hung |" in part
    # without a DNS run there is no DNS paragraph
    assert "whose DNS hangs" not in reliability_doc.hostile_part({"attacks": []})


def test_every_row_is_a_scenario_some_test_records() -> None:
    """A renamed scenario would show 'no record' for ever: each name is recorded by a test."""
    recorded = set()
    for path in (REPO / "tests").rglob("test_*.py"):
        recorded |= set(re.findall(r'\.record\(\s*"(\w+)"', path.read_text()))
    missing = [s.name for s in SCENARIOS if s.name not in recorded]
    assert not missing, f"scenarios of docs/reliability.md that no test records: {missing}"


def test_write_replaces_only_the_generated_part(tmp_path: Path) -> None:
    doc, result = tmp_path / "reliability.md", tmp_path / "reliability.json"
    doc.write_text(f"# R\n\nbefore\n\n{reliability_doc.BEGIN}\nold figures\n{reliability_doc.END}\n\nafter\n")
    result.write_text(json.dumps(synthetic()))
    part = reliability_doc.write(result, doc)
    text = doc.read_text()
    assert text.startswith("# R\n\nbefore\n\n") and text.endswith(f"{reliability_doc.END}\n\nafter\n")
    assert "old figures" not in text and reliability_doc.generated_part(text) == part
    reliability_doc.write(result, doc)
    assert doc.read_text() == text  # again: the same bytes


def test_only_a_run_writing_the_committed_file_rewrites_the_chapter(tmp_path: Path) -> None:
    assert writes_the_doc(reliability_doc.RESULT)
    assert not writes_the_doc(tmp_path / "reliability.json")
    refused = subprocess.run(
        [sys.executable, "-m", "bench.reliability_doc", "--write", "--result", str(tmp_path / "x.json")],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert refused.returncode == 2 and "committed file's figures only" in refused.stderr
