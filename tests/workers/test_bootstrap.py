"""`freight worker` execs `python -m workers.bootstrap`, so that module is `__main__` of every engine
worker. vLLM's engine processes re-import `__main__` and, at start-up, walk every loaded module,
tripping over Flask's context globals: so the bootstrap must not import Flask."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


def test_the_worker_bootstrap_does_not_import_flask() -> None:
    code = (
        "import sys, workers.bootstrap; print(sorted(m for m in sys.modules if m.split('.')[0] == 'flask'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# A Celery worker run by `run_then_exit` whose consumer, once connected to the real broker, either
# fails with an error Celery cannot recover from (as kombu's Redis client did on a reconnect with a
# task in flight) or is asked to stop warm (SIGTERM).
WORKER = """
import os, signal, sys
from celery import Celery, bootsteps
from workers.bootstrap import run_then_exit

class Then(bootsteps.StartStopStep):
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, consumer):
        if sys.argv[2] == "fail":
            raise AttributeError("'NoneType' object has no attribute 'hostname'")
        os.kill(os.getpid(), signal.SIGTERM)

app = Celery("t", broker=sys.argv[1], set_as_current=False)
app.steps["consumer"].add(Then)
run_then_exit(app, ["-q", "worker", "-P", "solo", "--without-gossip", "--without-mingle", "--without-heartbeat"])
"""


@pytest.mark.parametrize(("ending", "status"), [("fail", 1), ("sigterm", 0)])
def test_a_worker_exits_with_its_own_status(redis_service, ending: str, status: int) -> None:
    """1 after Celery's "Unrecoverable error", so that systemd's Restart=on-failure (and the control
    worker's supervisor) starts it again; it exited 0, and a dead engine worker stayed dead."""
    done = subprocess.run(
        [sys.executable, "-c", WORKER, redis_service.url, ending],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == status, done.stderr[-3000:]
    assert ("Unrecoverable error" in done.stderr) == (ending == "fail"), done.stderr[-3000:]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_validation_role_asks_vllm_about_each_model_before_its_pool_forks(settings) -> None:
    """The pool's processes inherit vLLM's answer (whether the model's engine caches prefixes,
    asked per checkpoint): none of them pays for it in the middle of a batch."""
    from workers.bootstrap import warm_validation
    from workers.prefix_caching import _supported, caches_prefixes

    _supported.cache_clear()
    warm_validation(settings)
    asked = _supported.cache_info()
    assert asked.currsize == len(settings.models) == 1
    assert caches_prefixes(settings.models["demo"], "generate") is True
    assert _supported.cache_info().hits == asked.hits + 1  # answered from what the warm-up asked
