"""The first hour with Freight, scripted (issue #23's "done when"): `make run`'s script starts the
stack and runs the sample job, then, in a fresh shell with only the PATH line it printed,
`freight tenant create alice`, `freight submit examples/requests.jsonl --model demo --wait`,
`freight status --json` and `freight report` all work, with no traceback anywhere.

The script runs in a checkout of its own (the repository's entries linked into a temporary
folder), so its `var/` (settings, data, the demo key, the stack's logs) is the test's, and its
ports are free ones: a developer's own `make run` stack is never touched."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.daemons import free_port
from infra.demo_training import stdlib_files
from tests.factories import without_freight_settings

pytestmark = pytest.mark.stack

REPO = Path(__file__).resolve().parents[2]
KEEP_OUT = {"var", "test-artifacts", ".git"}  # what the temporary checkout has of its own


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("first-hour") / "freight"
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in KEEP_OUT:
            (root / entry.name).symlink_to(entry)
    try:
        yield root
    finally:
        subprocess.run(
            [str(REPO / ".venv/bin/python"), "-m", "infra.daemons", "stop-all", "var/run"],
            cwd=root, capture_output=True, timeout=120,
        )  # fmt: skip
        logs = REPO / "test-artifacts"
        logs.mkdir(exist_ok=True)
        for log in (root / "var" / "run").glob("*.log"):
            (logs / f"first-hour-{log.name}").write_text(log.read_text(errors="replace"))


def fresh_shell_env(path_line: str) -> dict[str, str]:
    """A new shell: no FREIGHT_* of the test run's, and PATH as the printed line sets it."""
    env = without_freight_settings()
    match = re.fullmatch(r'export PATH="(?P<bin>[^"$]+):\$PATH"', path_line.strip())
    assert match, path_line
    env["PATH"] = f"{match['bin']}:{env.get('PATH', '')}"
    return env


def stdlib_words() -> set[str]:
    """The words of the Python standard library's source: what the demo model was trained on."""
    words: set[str] = set()
    for path in stdlib_files():
        words.update(w.lower() for w in re.findall(r"[A-Za-z]+", path.read_text(errors="replace")))
    return words


def share_of_words(texts: list[str], words: set[str]) -> float:
    """The share of whitespace-separated tokens (punctuation around them stripped) that are words."""
    tokens = [t.strip(".,;:!?()[]{}'\"`") for text in texts for t in text.split()]
    tokens = [t for t in tokens if t]
    return sum(1 for t in tokens if t.isascii() and t.isalpha() and t.lower() in words) / max(1, len(tokens))


def sh(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    return done


def test_make_run_then_the_printed_path_then_the_cli(checkout: Path) -> None:
    env = without_freight_settings()
    env["FREIGHT_API_PORT"] = str(free_port())  # written into var/freight.env by the script
    env["FREIGHT_BROKER_URL"] = f"redis://127.0.0.1:{free_port()}/0"
    started = sh(["bash", "infra/run_demo.sh"], env, checkout, timeout=900)
    assert started.returncode == 0, started.stdout + started.stderr
    assert "Freight is running" in started.stdout
    path_line = next(line for line in started.stdout.splitlines() if "export PATH=" in line)
    assert path_line.strip() == f'export PATH="{checkout}/.venv/bin:$PATH"'

    shell = fresh_shell_env(path_line)
    config = sh(["freight", "config"], shell, checkout)
    assert config.returncode == 0 and f"settings from {checkout}/var/freight.env" in config.stdout

    created = sh(["freight", "tenant", "create", "alice", "--json"], shell, checkout)
    assert created.returncode == 0, created.stderr
    tenant = json.loads(created.stdout)
    assert tenant["name"] == "alice" and tenant["api_key"]

    # no key given: the client commands use the demo key `make run` made, on the stack it started
    submitted = sh(
        ["freight", "submit", "examples/requests.jsonl", "--model", "demo", "--wait"], shell, checkout, 600
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr  # 4 if not completed
    batch_id, output_name = submitted.stdout.split()  # the batch, then the file --wait saved
    assert output_name == f"{batch_id}.output.jsonl"
    assert "HTTP Request" not in submitted.stderr  # progress, not the client library's request log
    requests = [line for line in (REPO / "examples/requests.jsonl").read_text().splitlines() if line.strip()]
    lines = len(requests)
    results = [json.loads(line) for line in (checkout / output_name).read_text().splitlines()]
    assert len(results) == lines and all(r["response"]["status_code"] == 200 for r in results)
    # The sample output reads as words: the demo model is trained (a random-weight one wrote
    # "' 767ev 340 about Nowdown223 255 PerFournational 596'", about a third of it words).
    free_text = {r["custom_id"] for r in map(json.loads, requests) if "response_format" not in r["body"]}
    texts = [
        choice["message"]["content"]
        for r in results
        if r["custom_id"] in free_text
        for choice in r["response"]["body"]["choices"]
    ]
    assert texts and share_of_words(texts, stdlib_words()) >= 0.6, texts

    status = sh(["freight", "status", "--json"], shell, checkout)
    assert status.returncode == 0, status.stderr
    listed = json.loads(status.stdout)  # the most recent batches, this one first
    assert listed["object"] == "list" and len(listed["data"]) == 2  # make run's sample and this one
    batch = listed["data"][0]
    assert batch["id"] == batch_id and batch["object"] == "batch" and batch["status"] == "completed"
    assert batch["request_counts"] == {"total": lines, "completed": lines, "failed": 0}

    report = sh(["freight", "report"], shell, checkout)
    assert report.returncode == 0, report.stderr
    assert "demo" in report.stdout  # the demo tenant's batches: make run's sample and this one
