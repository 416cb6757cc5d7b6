"""Shared fixtures: real backing services (Redis, PostgreSQL, SeaweedFS), started once per run.

Nothing here is a fake: the services are the real servers on loopback ports, in a temporary
folder, stopped when the session ends.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings

from infra import daemons as services
from storage.logs import bound
from storage.migrate import upgrade
from storage.objectstore import S3ObjectStore
from storage.objectstore_retry import Retrier, RetryPolicy
from storage.runtime import Runtime
from storage.settings import Settings

REPO = Path(__file__).resolve().parent.parent
DEMO_MODEL = REPO / "models" / "demo"
EMBED_MODEL = REPO / "models" / "embed"
SCORE_MODEL = REPO / "models" / "score"
WHISPER_MODEL = REPO / "models" / "whisper"
VLM_MODEL = REPO / "models" / "vlm"
ARTIFACTS = REPO / "test-artifacts"


def pytest_configure(config: pytest.Config) -> None:
    """Every stack a test starts runs a batch as soon as its pack comes (no settle window,
    FREIGHT_FEED_SETTLE_SECONDS=0, the default since the dispatcher knows what is on its way,
    workers/arrivals.py) unless the test sets one; kept explicit so that a machine's environment
    cannot turn it on for the suite. The window is tested as a rule
    (tests/scheduler/test_feed_order.py, tests/workers/test_pack_feed.py)."""
    os.environ.setdefault("FREIGHT_FEED_SETTLE_SECONDS", "0")


# `make test` runs the suite in two processes (pytest-xdist, ``-n 2 --dist loadgroup``): on a
# two-core machine one process left a core idle through every single-threaded test, about half of
# the run. What runs where is decided by group (``GroupScheduling``): each module is one group (its
# module-scoped fixtures start once), the modules on the session's vLLM engine are one (one engine),
# and the live stacks, network namespaces and `make run` are one, run first and one after the
# other, since their stacks and test subnets must not overlap and they are the longest chain.
SERIAL_GROUP = "stacks"
SERIAL_PACKAGES = ("e2e", "infra")
ENGINE_FIXTURE = "vllm_engine"  # tests/workers/conftest.py: one engine per process


@functools.cache
def engine_modules() -> frozenset[str]:
    """The test modules (paths from the repository) that ask for the session's vLLM engine."""
    return frozenset(
        path.relative_to(REPO).as_posix()
        for path in (REPO / "tests").rglob("test_*.py")
        if ENGINE_FIXTURE in path.read_text()
    )


def xdist_group(nodeid: str) -> str:
    """The group a test runs in: tests of one group run in one process, in collection order."""
    module = nodeid.split("::", 1)[0]
    parts = module.split("/")
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in SERIAL_PACKAGES:
        return SERIAL_GROUP
    return ENGINE_FIXTURE if module in engine_modules() else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Scopes by ``xdist_group``. pytest-xdist's own ``loadgroup`` cannot be used: it marks a
    group by rewriting ``item._nodeid``, which pytest 9 no longer reads."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return GroupScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` the serial group comes first: xdist hands out groups in
    collection order, and that one is the longest."""
    if getattr(config.option, "loadgroup", False):
        items.sort(key=lambda item: xdist_group(item.nodeid) != SERIAL_GROUP)  # stable


# Hypothesis' 200 ms deadline per example measures the machine, not the code: on the loaded 2-core
# machine an example of test_feed_order took 511 ms once and 0.13 ms on its replay, and the run
# failed as flaky. Properties are checked without it (a module may still set its own).
hypothesis_settings.register_profile("freight", deadline=None)
hypothesis_settings.load_profile("freight")


@pytest.fixture(autouse=True)
def no_log_ids() -> Iterator[None]:
    """Each test starts with no request or batch id bound to its log lines: a Flask test client's
    response that is never closed leaves its request's id set in this thread (a WSGI server always
    closes the response, which sets the id back)."""
    with bound(request_id=None, batch_id=None):
        yield


@pytest.fixture(autouse=True)
def root_log_level_kept() -> Iterator[None]:
    """Each test leaves the root logger's level as it found it. A Celery worker started in-process
    (celery.contrib.testing's start_worker) sets it to the worker's log level, ERROR, and kept it:
    a later test in the same process then captured no warning (caplog.text empty: seen with
    test_dropfolder_scan after test_webhook_delivery's slow-receiver test)."""
    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)


@pytest.fixture(scope="session")
def services_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("services")
    yield path
    services.stop_all(path)


@pytest.fixture(scope="session")
def redis_service(services_dir: Path):
    handle = services.start_redis(services_dir, services.free_port())
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def postgres_service(services_dir: Path):
    handle = services.start_postgres(services_dir, services.free_port())
    yield handle
    # the cluster is thrown away: an immediate shutdown (SIGQUIT) skips the checkpoint a fast one
    # writes of the session's hundreds of databases, and their files (~10 MB each) are removed
    # after the session by a detached `rm`, not in its teardown
    # A test may have restarted it (test_service_faults): the pid file names the postmaster now
    # running. Missing that one left it to the services folder's stop_all: a fast shutdown that
    # checkpointed every database, 16 s of the session's teardown.
    entry = services.read_pidfile(handle.pid_file)
    services.stop_pid(entry[0] if entry else handle.pid, timeout=10, sig=signal.SIGQUIT)
    handle.stop(remove_in_background=True)


@pytest.fixture(scope="session")
def s3_service(services_dir: Path):
    handle = services.start_seaweedfs(services_dir, services.free_port())
    yield handle
    handle.stop(timeout=0)  # thrown away: no 3 s wait for `weed` to stop what it need not keep


@dataclass
class Weed:
    """A SeaweedFS of one test module's own, which its tests may stop and start again (same port,
    same data): the shared ``s3_service`` must stay up for everyone else."""

    run_dir: Path
    port: int
    handle: services.S3Service

    def stop(self) -> None:
        self.handle.stop()

    def start(self) -> None:
        self.handle = services.start_seaweedfs(self.run_dir, self.port)

    def client(self):
        return self.handle.client()

    def credentials(self) -> dict[str, str]:
        """The environment through which boto3's chain finds this server's credentials."""
        return {
            "AWS_ACCESS_KEY_ID": self.handle.access_key,
            "AWS_SECRET_ACCESS_KEY": self.handle.secret_key,
            "AWS_DEFAULT_REGION": self.handle.region,
        }

    def store(self, bucket: str, policy: RetryPolicy | Retrier) -> S3ObjectStore:
        return S3ObjectStore(
            bucket,
            "freight",
            endpoint_url=self.handle.endpoint_url,
            access_key_id=self.handle.access_key,
            secret_access_key=self.handle.secret_key,
            region=self.handle.region,
            connect_timeout=2,
            retry=policy,
        )


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Weed]:
    run_dir = tmp_path_factory.mktemp("weed-outage")
    port = services.free_port()
    w = Weed(run_dir, port, services.start_seaweedfs(run_dir, port))
    try:
        yield w
    finally:
        services.stop_all(run_dir)


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The small Llama the tests and the demo use: the committed trained checkpoint, copied once."""
    if not (DEMO_MODEL / "config.json").exists():
        from infra.build_demo_model import build

        build(DEMO_MODEL)
    return DEMO_MODEL


@pytest.fixture(scope="session")
def embed_model() -> Path:
    """The small random embedding model (a LlamaModel with the demo tokenizer), built locally
    once: about 5 s."""
    if not (EMBED_MODEL / "config.json").exists():
        from infra.build_embed_model import build

        build(EMBED_MODEL)
    return EMBED_MODEL


@pytest.fixture(scope="session")
def score_model() -> Path:
    """The small random cross-encoder (a LlamaForSequenceClassification with one label and the
    demo tokenizer), built locally once: about 5 s."""
    if not (SCORE_MODEL / "config.json").exists():
        from infra.build_score_model import build

        build(SCORE_MODEL)
    return SCORE_MODEL


@pytest.fixture(scope="session")
def whisper_model() -> Path:
    """The small random speech model (a WhisperForConditionalGeneration with a byte-level Whisper
    tokenizer), built locally once: about 5 s."""
    if not (WHISPER_MODEL / "config.json").exists():
        from infra.build_whisper_model import build

        build(WHISPER_MODEL)
    return WHISPER_MODEL


@pytest.fixture(scope="session")
def vlm_model() -> Path:
    """The small random vision-language model (infra/build_vlm_model.py: an Idefics3), built
    locally once: about 5 s."""
    from infra.build_vlm_model import build

    build(VLM_MODEL)  # keeps a build that is there
    return VLM_MODEL


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite database Alembic migrated to head, once a session: each test's is a copy of it."""
    path = tmp_path_factory.mktemp("sqlite-template") / "freight.db"
    upgrade(f"sqlite:///{path}")  # disposed: the WAL is checkpointed into the file and removed
    assert not path.with_name(path.name + "-wal").exists()
    return path


@pytest.fixture(scope="session")
def migrated_postgres(postgres_service) -> str:
    """The name of a PostgreSQL database Alembic migrated to head, once a session: each test's is
    created from it as a template (nothing stays connected to it)."""
    name = f"template_{uuid.uuid4().hex[:12]}"
    upgrade(postgres_service.create_database(name))
    return name


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database of each kind Freight supports, at the newest migration: a copy of one
    Alembic migrated once a session (migrating each test's own cost ~0.12 s on SQLite and ~0.25 s
    on PostgreSQL, about 650 times a run). The migrations still run from an empty database on
    both kinds every session: in these two templates, and in every live stack's start."""
    if request.param == "sqlite":
        path = tmp_path / "freight.db"
        shutil.copyfile(request.getfixturevalue("migrated_sqlite"), path)
        return f"sqlite:///{path}"
    pg = request.getfixturevalue("postgres_service")
    return pg.create_database(
        f"t_{uuid.uuid4().hex[:12]}", template=request.getfixturevalue("migrated_postgres")
    )


@pytest.fixture
def settings(tmp_path: Path, database_url: str, redis_service) -> Settings:
    return Settings.from_env(
        {},
        data_dir=tmp_path,
        database_url=database_url,
        broker_url=redis_service.url,
        models={"demo": str(DEMO_MODEL)},
        completion_windows=("24h", "1h"),
        max_file_bytes=64 * 1024,
    )


@pytest.fixture
def runtime(settings: Settings) -> Iterator[Runtime]:
    rt = Runtime(settings)
    yield rt
    rt.db.dispose()


@pytest.fixture(params=["local", "s3"])
def store_kind(request: pytest.FixtureRequest, runtime: Runtime) -> str:
    """The test's ``runtime`` on each object store: local disk (as made), or a bucket of its own
    on the session's SeaweedFS. A test taking it runs once on each."""
    if request.param == "s3":
        on_s3(request, runtime)
    return str(request.param)


def on_s3(request: pytest.FixtureRequest, runtime: Runtime) -> None:
    """Move ``runtime`` (before it stored anything) onto a bucket of its own on the session's
    SeaweedFS; for a fixture whose runtime is not ``runtime``."""
    s3 = request.getfixturevalue("s3_service")
    bucket = f"u-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(bucket)
    runtime.store = S3ObjectStore(bucket, "freight", client=s3.client())


def now() -> int:
    return int(time.time())


class ReliabilityLog:
    """Figures of the reliability scenarios (issue 8). Every scenario records at least how many
    results were lost or duplicated and how many responses were 5xx; ``bench/reliability.py`` runs
    the tests with ``FREIGHT_RELIABILITY_DIR`` set and merges the files into
    ``bench/results/reliability.json``. Without the variable the figures go to a temporary folder:
    the tests assert on them either way."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def record(
        self, scenario: str, *, lost: int, duplicated: int, server_errors: int, **figures: object
    ) -> dict:
        entry = {"scenario": scenario, "lost": lost, "duplicated": duplicated, "server_errors": server_errors,
                 **figures, "recorded_at": int(time.time())}  # fmt: skip
        (self.folder / f"{scenario}.json").write_text(json.dumps(entry, indent=2, sort_keys=True) + "\n")
        return entry


@pytest.fixture(scope="session")
def reliability(tmp_path_factory: pytest.TempPathFactory) -> ReliabilityLog:
    folder = os.environ.get("FREIGHT_RELIABILITY_DIR")
    return ReliabilityLog(Path(folder) if folder else tmp_path_factory.mktemp("reliability"))


@pytest.fixture
def json_logs() -> Iterator[io.StringIO]:
    """This process logs as ``FREIGHT_LOG_FORMAT=json`` does, into the returned buffer, at INFO;
    the root logger is as it was afterwards (pytest's own capture handlers stay throughout)."""
    from storage.logs import configure

    root = logging.getLogger()
    level = root.level
    stream = io.StringIO()
    handler = configure("INFO", "json", stream=stream)
    yield stream
    root.removeHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(False)


def json_lines(text: str) -> list[dict]:
    """Every line of a log, each of which must be one JSON object."""
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert all(isinstance(line, dict) for line in lines)
    return lines
