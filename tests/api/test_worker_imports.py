"""``workers/`` is what runs off the request path: an API process imports as little of it as it can
(issue #46 part 4). A fresh interpreter imports every module of ``api/`` an API process serves
from (all but the ``freight`` command's own), as gunicorn's would, and counts the ``workers``
modules that came with them; deferred imports inside functions (a rarely used path) do not count,
as they do not run at start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the `freight` command's modules: a CLI process, not an API process, imports them
CLI_MODULES = frozenset(
    {"cli", "client_cli", "models_cli", "webhooks_cli", "estimate_cli", "cli_settings", "report_format"}
)
MAX_WORKER_MODULES = 13  # was 26 before the estimates, registration and endpoint_mismatch moves

PROBE = """
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m == "workers" or m.startswith("workers."))))
"""


def api_modules() -> list[str]:
    names = []
    for path in sorted((REPO / "api").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) == 2 and parts[1] in CLI_MODULES:
            continue
        names.append(".".join(parts))
    return names


def imported_worker_modules() -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(api_modules())],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return [m for m in json.loads(out.stdout.splitlines()[-1]) if m != "workers"]


def test_the_api_modules_are_found_and_the_cli_ones_left_out():
    modules = api_modules()
    assert {"api.app", "api.views.v1", "api.services.estimates", "api.services.models"} <= set(modules)
    assert not {f"api.{name}" for name in CLI_MODULES} & set(modules)


def test_an_api_process_imports_at_most_13_worker_modules():
    imported = imported_worker_modules()
    # neither validation (tokenizers, the dispatcher) nor registration (quantize, probe) comes along
    assert not {"workers.validation", "workers.estimates", "workers.registration"} & set(imported)
    assert len(imported) <= MAX_WORKER_MODULES, (
        f"an API process imports {len(imported)} workers modules (at most {MAX_WORKER_MODULES}): {imported}"
    )
