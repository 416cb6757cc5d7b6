"""infra/k8s against a policy checker: both overlays rendered with ``kubectl kustomize`` and checked
by Checkov (``make policy-env`` installs the pinned version into ``.venv-policy``; ``make lint`` runs
the same check). Every finding is fixed in the manifests but those infra/k8s/checkov.yaml skips,
each with its reason written beside it; a new finding fails here.

A missing Checkov fails with that reason: a skip would pass manifests nobody checked.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "infra" / "k8s"
CONFIG = K8S / "checkov.yaml"
CHECKOV = REPO / ".venv-policy" / "bin" / "checkov"


def test_checkov_finds_nothing_in_either_overlay(tmp_path: Path) -> None:
    if not CHECKOV.exists():
        pytest.fail(f"{CHECKOV} is missing: `make policy-env` installs Checkov (make lint and make test do)")
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is not installed: the manifests cannot be rendered"
    for overlay in ("cpu-demo", "gpu"):
        done = subprocess.run(
            [kubectl, "kustomize", str(K8S / "overlays" / overlay)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        (tmp_path / f"{overlay}.yaml").write_text(done.stdout)
    done = subprocess.run(
        [str(CHECKOV), "--config-file", str(CONFIG), "--skip-download", "-d", str(tmp_path), "-o", "json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(done.stdout)
    [summary] = [r["summary"] for r in (report if isinstance(report, list) else [report])]
    # every object was read (a parse error would pass it unchecked) and nothing failed
    assert summary["parsing_errors"] == 0 and summary["resource_count"] >= 40, summary
    assert summary["failed"] == 0, done.stdout[:4000]
    assert summary["passed"] > 0 and done.returncode == 0, summary


def test_every_skipped_check_says_why() -> None:
    lines = CONFIG.read_text().splitlines()
    skips = [i for i, line in enumerate(lines) if re.fullmatch(r"\s+- CKV\w+", line)]
    assert skips, "no skip-check list"
    for i in skips:
        # the reason is the comment block right above it, or the skip right above shares it
        above = lines[i - 1].strip()
        assert above.startswith("#") or re.fullmatch(r"- CKV\w+", above), lines[i]
