"""`freight worker` hosts vLLM, whose engine processes re-import `api.cli`; at start-up vLLM walks
every loaded module and trips over Flask's context globals. So `api.cli` must not import Flask."""

from __future__ import annotations

import subprocess
import sys


def test_the_cli_module_does_not_import_flask() -> None:
    code = "import sys, api.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'flask'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
