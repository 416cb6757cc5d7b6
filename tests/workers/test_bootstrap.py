"""`freight worker` execs `python -m workers.bootstrap`, so that module is `__main__` of every engine
worker. vLLM's engine processes re-import `__main__` and, at start-up, walk every loaded module,
tripping over Flask's context globals: so the bootstrap must not import Flask."""

from __future__ import annotations

import subprocess
import sys


def test_the_worker_bootstrap_does_not_import_flask() -> None:
    code = (
        "import sys, workers.bootstrap; print(sorted(m for m in sys.modules if m.split('.')[0] == 'flask'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
