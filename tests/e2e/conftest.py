"""The live stack for end-to-end tests: Redis, gunicorn API, control worker, an engine worker
holding a real vLLM engine on the demo model, and beat; started once for the tests in this folder
that use it and stopped right after the last of them (see PACKAGE_STACKS), so its idle processes
(a dispatcher tick every second, beat, the engines' loops) take no CPU from the tests after them."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import boto3
import pytest
from openai import OpenAI

from infra import daemons as services
from infra.processes import FREIGHT, REPO, Stack, _log_has, create_tenant, spawn, up, wait_for
from storage.objectstore import ObjectStore, S3ObjectStore, open_object_store
from tests.factories import OMIT, chat_line, jsonl

if TYPE_CHECKING:
    from storage.models import WorkUnit

HUGE = 1_000_000  # lines of the largest batch the tests submit
WINDOWS = "24h,1h,8s"  # 8s: a window short enough to expire during a test
# the demo model's engine in every live stack: eager (starts in seconds), a small KV cache and batch
DEMO_ENGINE = {
    "FREIGHT_ENGINE_ENFORCE_EAGER": "true",
    "FREIGHT_ENGINE_KV_CACHE_GIB": "0.5",
    "FREIGHT_ENGINE_MAX_NUM_SEQS": "32",
    "FREIGHT_ENGINE_MAX_NUM_BATCHED_TOKENS": "2048",  # what the tests ran at before sizes followed the device
    "FREIGHT_ENGINE_DEFAULT_MAX_TOKENS": "16",
}


@dataclass
class LiveStack:
    stack: Stack
    keys: dict[str, str]
    model_dir: Path

    @property
    def base_url(self) -> str:
        return self.stack.api_url + "/v1"

    def client(self, tenant: str = "alpha") -> OpenAI:
        return OpenAI(base_url=self.base_url, api_key=self.keys[tenant], max_retries=0, timeout=60)

    def store(self) -> ObjectStore:
        """The stack's object store as this test process reads it: on S3 with the stack's own
        credentials, which this process's environment does not hold."""
        settings, env = self.stack.settings, self.stack.env
        url = urlparse(settings.object_store_url)
        if url.scheme != "s3":
            return open_object_store(settings.object_store_url)
        client = boto3.client(
            "s3",
            endpoint_url=settings.s3_endpoint_url or None,
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env.get("AWS_DEFAULT_REGION", "us-east-1"),
        )
        return S3ObjectStore(url.netloc, url.path, client=client)

    @property
    def worker_env(self) -> dict[str, str]:
        """The stack's environment for a further engine worker a test starts: without the stack's
        worker's vLLM-metrics port, which a second worker on this host cannot also bind."""
        return {k: v for k, v in self.stack.env.items() if k != "FREIGHT_ENGINE_METRICS_BIND"}


def start_live(
    run_dir: Path,
    demo_model: Path,
    overrides: dict[str, str],
    tenants: tuple[str, ...],
    workers_per_model: int = 1,
) -> tuple[LiveStack, Stack]:
    env = {
        **os.environ,
        "FREIGHT_DATA_DIR": str(run_dir / "data"),
        "FREIGHT_MODELS": f"demo={demo_model}",
        "FREIGHT_BROKER_URL": f"redis://127.0.0.1:{services.free_port()}/0",
        "FREIGHT_API_PORT": str(services.free_port()),
        "FREIGHT_TICK_SECONDS": "1",
        **DEMO_ENGINE,
        # metering: $3.60/h is $0.001 per engine second; rough figures for a 2-core AVX-512 VM
        "FREIGHT_INSTANCE_PRICE_PER_HOUR": "3.6",
        "FREIGHT_ACCELERATOR_PEAK_TFLOPS": "0.5",
        "FREIGHT_ACCELERATOR_BANDWIDTH_GBS": "20",
        "FREIGHT_LIST_PRICES": "demo=0.15/0.075/0.6",
        **overrides,
    }
    stack = up(run_dir, env, workers_per_model=workers_per_model)
    try:
        keys = {name: create_tenant(env, name) for name in tenants}
    except BaseException:
        stack.stop()
        raise
    return LiveStack(stack, keys, demo_model), stack


def keep_logs(stack: Stack, prefix: str, stop_timeout: float | None = None) -> None:
    stack.stop(stop_timeout)
    (REPO / "test-artifacts").mkdir(exist_ok=True)
    for log in stack.run_dir.glob("*.log"):
        (REPO / "test-artifacts" / f"{prefix}-{log.stem}.log").write_text(log.read_text(errors="replace"))


# The package's stacks: each is stopped right after the last test using it (pytest_runtest_teardown),
# not at the package's end, and the tests are ordered so that stacks never overlap: first the
# modules that start a stack of their own, then the users of `live`, then those of `sched`. An idle
# stack is not free (a dispatcher tick a second, beat, heartbeats, 2-3 GB of engines), and on two
# cores it slowed the tests of every stack that started while it lingered.
PACKAGE_STACKS = ("live", "sched")
_last_user: dict[str, str] = {}  # package stack fixture -> node id of the last test using it
_stoppers: dict[str, Callable[[], None]] = {}  # package stack fixture -> stops it (once)


def _group(module_items: list[pytest.Item]) -> int:
    """0: the module starts its own stack (or none); 1 + i: it uses PACKAGE_STACKS[i]."""
    used = {name for item in module_items for name in getattr(item, "fixturenames", ())}
    return max((1 + i for i, name in enumerate(PACKAGE_STACKS) if name in used), default=0)


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: the items that will run
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    places = [i for i, item in enumerate(items) if here in item.path.parents]
    modules: dict[Path, list[pytest.Item]] = {}
    for i in places:
        modules.setdefault(items[i].path, []).append(items[i])
    ordered = [
        item for module in sorted(modules.values(), key=_group) for item in module
    ]  # a stable sort: modules keep their order within a group, tests theirs within a module
    for i, item in zip(places, ordered, strict=True):
        items[i] = item
    _last_user.clear()
    for item in ordered:
        for name in PACKAGE_STACKS:
            if name in getattr(item, "fixturenames", ()):
                _last_user[name] = item.nodeid


STACK_ERROR_LINES = 30  # of each process's log, the last lines at ERROR or CRITICAL
STACK_ERROR_MARKS = (b" ERROR ", b" CRITICAL ")


def stack_errors(stack: Stack) -> str:
    """The last error lines of each of a stack's logs, each cut to 300 characters: what CI prints
    under a live-stack test's failure, where the logs themselves are not kept (a role that died
    on a broker restart showed there only as a batch that never finished)."""
    parts = []
    for log in sorted(stack.run_dir.glob("*.log")):
        last: deque[bytes] = deque(maxlen=STACK_ERROR_LINES)
        count = 0
        with open(log, "rb") as f:
            for line in f:
                if any(mark in line for mark in STACK_ERROR_MARKS):
                    last.append(line[:300])
                    count += 1
        if count:
            tail = "\n".join(line.decode(errors="replace").rstrip() for line in last)
            parts.append(f"== {log.name}: {count} error lines, the last {len(last)}:\n{tail}")
    return "\n".join(parts)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and call.when == "call":
        for name, value in getattr(item, "funcargs", {}).items():
            # by shape: pytest loads this file as `conftest`, the tests import `tests.e2e.conftest`
            stack = getattr(value, "stack", value)
            if isinstance(getattr(stack, "run_dir", None), Path) and stack.run_dir.exists():
                report.sections.append((f"stack {name}: error lines of its logs", stack_errors(stack)))
    return report


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item) -> None:
    for name, nodeid in _last_user.items():
        if item.nodeid == nodeid and name in _stoppers:
            _stoppers.pop(name)()


def _stop_once(stack: Stack, prefix: str) -> Callable[[], None]:
    stopped = False

    def stop() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            keep_logs(stack, prefix)

    return stop


def on_services(request: pytest.FixtureRequest, name: str) -> dict[str, str]:
    """The settings that put a stack on the session's PostgreSQL (a database of its own) and
    SeaweedFS (a bucket of its own): the kinds a production deployment runs on."""
    pg = request.getfixturevalue("postgres_service")
    s3 = request.getfixturevalue("s3_service")
    bucket = f"{name}-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(bucket)
    return {
        "FREIGHT_DATABASE_URL": pg.create_database(f"{name}_{uuid.uuid4().hex[:10]}"),
        "FREIGHT_OBJECT_STORE_URL": f"s3://{bucket}/objects",
        "FREIGHT_S3_ENDPOINT_URL": s3.endpoint_url,
        "AWS_ACCESS_KEY_ID": s3.access_key,
        "AWS_SECRET_ACCESS_KEY": s3.secret_key,
        "AWS_DEFAULT_REGION": s3.region,
    }


# The main e2e flows (the `live` stack) run on PostgreSQL and S3, as production does; `sched` and the
# modules' own stacks keep the embedded defaults (SQLite, local disk), as `make run` does
# (E2E_LIVE_EMBEDDED=1 puts `live` there too).
LIVE_ON_SERVICES = os.environ.get("E2E_LIVE_EMBEDDED", "0") != "1"


@pytest.fixture(scope="package")
def live(
    tmp_path_factory: pytest.TempPathFactory, demo_model: Path, request: pytest.FixtureRequest
) -> Iterator[LiveStack]:
    overrides = {
        "FREIGHT_COMPLETION_WINDOWS": WINDOWS,
        "FREIGHT_UNIT_SIZE": "8",
        "FREIGHT_VALIDATION_HEAD_ROWS": "256",  # early slices on (the default), as test_batches.py tests
        "FREIGHT_MAX_FILE_BYTES": str(1024 * 1024),
        "FREIGHT_WEBHOOK_ALLOW_PRIVATE_TARGETS": "true",  # the tests' receivers are on 127.0.0.1
        "FREIGHT_IMAGE_FETCH_ALLOW_PRIVATE_TARGETS": "true",  # test_images_live serves its images there
        # test_dropfolder_live: a drop folder's latency is held to the default poll (5 s)
        "FREIGHT_DROPFOLDER_MAX_BACKOFF_SECONDS": "4",
        # test_engine_metrics_live: the one engine worker serves vLLM's metrics (stat logging on)
        "FREIGHT_ENGINE_METRICS_BIND": f"127.0.0.1:{services.free_port()}",
        **(on_services(request, "live") if LIVE_ON_SERVICES else {}),
    }
    live_stack, stack = start_live(tmp_path_factory.mktemp("stack"), demo_model, overrides, ("alpha", "beta"))
    _stoppers["live"] = stop = _stop_once(stack, "e2e")
    try:
        yield live_stack
    finally:
        stop()


@pytest.fixture(scope="package")
def sched(  # two engine workers, lines of a million-request file allowed
    tmp_path_factory: pytest.TempPathFactory, demo_model: Path
) -> Iterator[LiveStack]:
    overrides = {
        "FREIGHT_COMPLETION_WINDOWS": "24h,1h",
        "FREIGHT_UNIT_SIZE": "64",
        "FREIGHT_PACK_REQUESTS": "256",
        "FREIGHT_HEARTBEAT_SECONDS": "1",
        "FREIGHT_LEASE_SECONDS": "8",
        "FREIGHT_MAX_REQUESTS_PER_FILE": str(HUGE),
        "FREIGHT_MAX_FILE_BYTES": str(400 * 1024 * 1024),
        "FREIGHT_SORT_MEMORY_MB": "32",
        # FREIGHT_PREFIX_CACHE_SHARING is the default (tenant): test_scheduler checks prefixes are
        # shared within a tenant and not across
    }
    live_stack, stack = start_live(
        tmp_path_factory.mktemp("sched"),
        demo_model,
        overrides,
        ("alpha", "beta", "gamma"),
        workers_per_model=2,
    )
    _stoppers["sched"] = stop = _stop_once(stack, "sched")
    try:
        yield live_stack
    finally:
        stop()


def peak_rss_reset(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM, the peak resident set


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def wait_final(client: OpenAI, batch_id: str, timeout: float = 300, until: tuple[str, ...] = ()) -> object:
    final = until or ("completed", "failed", "expired", "cancelled")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in final:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout}s")


CHAT = "/v1/chat/completions"


def units_of(live: LiveStack, batch_ids: Iterable[str]) -> list[WorkUnit]:
    """The work units of these batches, read from the stack's database."""
    from sqlalchemy import select

    from storage.db import Database
    from storage.models import WorkUnit

    database = Database(live.stack.settings.database_url)
    try:
        with database.read() as s:
            return list(s.scalars(select(WorkUnit).where(WorkUnit.batch_id.in_(list(batch_ids)))).all())
    finally:
        database.dispose()


def request_line(custom_id: str, content: str = "hello", **body: object) -> dict:
    """One chat line of the OpenAI batch format (the model comes from the file's default)."""
    return chat_line(custom_id, content, **{"model": OMIT, "max_tokens": 8, **body})


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_bytes(jsonl(lines))
    return path


def api_worker_pids(stack: Stack) -> list[int]:
    """gunicorn's worker processes: the children of the master whose pid the stack recorded."""
    master = int((stack.run_dir / "api.pid").read_text())
    children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    return [int(pid) for pid in children]


def control_worker_pids(stack: Stack) -> list[int]:
    """The control worker's processes: the supervisor whose pid the stack recorded, one process per
    role (``workers.control``) and each role's prefork pool."""

    def below(pid: int) -> list[int]:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except FileNotFoundError:
            return []
        return [pid, *(p for child in children for p in below(int(child)))]

    return below(int((stack.run_dir / "control.pid").read_text()))


@contextlib.contextmanager
def engine_worker(live: LiveStack, model: str, name: str, env: dict[str, str], what: str) -> Iterator[None]:
    """An engine worker of ``model`` of the test's own (a model the live stack does not serve),
    ready (its log says so) before the body runs, and stopped after with its process group: the
    engine's children go with it."""
    proc = spawn(
        live.stack.run_dir, name, [*FREIGHT, "worker", "--model", model, "--name", f"{name}@%h"], env
    )
    try:
        log = live.stack.log(name)
        wait_for(lambda: _log_has(log, " ready."), what, 300, proc, log)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=90)
