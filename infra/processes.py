"""Start and stop the whole local Freight stack: Redis, the API, the control worker, one engine
worker per served model, and the beat scheduler. Used by ``make run``/``make stop`` and the tests.

Every process gets a pid file in ``run_dir`` (the contract of ``infra.daemons.stop_all``) and a
log file beside it, so ``stop`` needs nothing but the folder.

    python -m infra.processes up RUN_DIR      # settings from FREIGHT_* in the environment
    python -m infra.processes down RUN_DIR
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from infra import daemons as services
from storage.settings import Settings

REPO = Path(__file__).resolve().parent.parent
FREIGHT = [sys.executable, "-m", "api.cli"]


class StackError(RuntimeError):
    pass


@dataclass
class Stack:
    run_dir: Path
    settings: Settings
    env: dict[str, str]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)  # argv of each process, for restart
    log_offsets: dict[str, int] = field(default_factory=dict)  # log size when each last started
    # argv every process runs under: () on this machine, ``infra.netns.Host.prefix`` on another
    prefix: tuple[str, ...] = ()
    # the checkout whose code the processes run (their working directory, first on their
    # sys.path): this one, or another revision's worktree beside it (bench.request_rate's A/B)
    code_dir: Path = REPO

    @property
    def api_url(self) -> str:
        return f"http://{self.settings.api_host}:{self.settings.api_port}"

    def log(self, name: str) -> Path:
        return self.run_dir / f"{name}.log"

    def stop(self, timeout: float | None = None) -> None:
        """Stop every process of the stack; ``timeout``: how long they may take before SIGKILL."""
        services.stop_all(self.run_dir, timeout=timeout)

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = self.log(name)
        self.log_offsets[name] = log.stat().st_size if log.exists() else 0  # logs append across restarts
        self.commands[name] = argv
        self.processes[name] = spawn(self.run_dir, name, [*self.prefix, *argv], self.env, self.code_dir)
        return self.processes[name]

    def started(self, name: str) -> bool:
        """The Celery worker ``name`` logged ``ready`` since it was last started."""
        return _log_has(self.log(name), " ready.", self.log_offsets.get(name, 0))

    def stop_process(self, name: str) -> None:
        """SIGTERM one process of the stack (SIGKILL after 10 s), as ``make stop`` would."""
        services.stop_pidfile(self.run_dir / f"{name}.pid")

    def start_process(self, name: str, timeout: float = 600) -> None:
        """Start a stopped process again with the argv and environment it had; returns once ready."""
        proc = self.spawn(name, self.commands[name])
        if name == "api":
            wait_for(lambda: _http_ok(self.api_url + "/healthz"), "API", 60, proc, self.log(name))
        elif name != "beat":  # Celery workers
            wait_for(lambda: self.started(name), name, timeout, proc, self.log(name))

    def restart(self, name: str, timeout: float = 600) -> None:
        """Stop one process (the API, a worker, beat) and start it again the same way."""
        self.stop_process(name)
        self.start_process(name, timeout)


def spawn(
    run_dir: Path, name: str, argv: list[str], env: dict[str, str], cwd: Path = REPO
) -> subprocess.Popen:
    with open(run_dir / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stop_all kills vLLM's children too
        )
    (run_dir / f"{name}.pid").write_text(f"{proc.pid}\n")
    return proc


def wait_for(
    check, what: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.3)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    raise StackError(f"{what} did not become ready within {timeout:.0f}s\n{tail}")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _log_has(path: Path, text: str, offset: int = 0) -> bool:
    if not path.exists():
        return False
    with open(path, "rb") as f:
        f.seek(offset)
        return text.encode() in f.read()


def create_tenant(env: dict[str, str], name: str) -> str:
    """Through the CLI, as an operator would; returns the new tenant's API key (its last line)."""
    out = subprocess.run(
        [*FREIGHT, "tenant", "create", name], cwd=REPO, env=env, capture_output=True, text=True, check=True
    ).stdout
    return out.strip().splitlines()[-1]


def engine_names(model: str, workers: int) -> list[str]:
    """Process names of a model's engine workers: ``engine-<model>``, ``engine-<model>-2``, ..."""
    return [f"engine-{model}" + (f"-{i + 1}" if i else "") for i in range(workers)]


def up(
    run_dir: Path,
    env: dict[str, str] | None = None,
    *,
    engine_timeout: float = 600,
    workers_per_model: int = 1,
    control_plane: bool = True,
    prefix: Sequence[str] = (),
    code_dir: Path = REPO,
) -> Stack:
    """Start the stack in ``run_dir`` and return once every process is ready.

    ``control_plane=False``: the engine workers alone, as on a machine of their own whose API,
    control worker, beat, database and broker run elsewhere (``workers_per_model=0``: the other
    way round). ``prefix``: argv every process runs under (``infra.netns.Host.prefix``).
    ``code_dir``: the checkout the processes run (another revision's worktree, for an A/B)."""
    run_dir = Path(run_dir).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if env is None else env)
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("PYTHONUNBUFFERED", "1")
    settings = Settings.from_env(env)
    stack = Stack(run_dir, settings, env, prefix=tuple(prefix), code_dir=Path(code_dir))

    try:
        broker = urlparse(settings.broker_url)
        if control_plane and broker.hostname in ("127.0.0.1", "localhost"):
            services.start_redis(run_dir, broker.port or 6379)

        from storage.migrate import upgrade

        if control_plane and Path(code_dir).resolve() == REPO.resolve():
            upgrade(settings.database_url)
        elif control_plane:  # another revision (an A/B's baseline): its schema, by its migrations
            subprocess.run(
                [*FREIGHT, "db", "upgrade"], cwd=code_dir, env=env, check=True, capture_output=True
            )
        from storage.db import Database
        from storage.registry import served_names

        db = Database(settings.database_url)
        try:  # an engine pool per served model: registry rows and FREIGHT_MODELS declarations
            served = sorted(served_names(db, settings))
        finally:
            db.dispose()
        engines = len(served) * workers_per_model
        if engines > 1:  # the engines' device defaults split this host between them
            env.setdefault("FREIGHT_ENGINE_WORKERS_PER_HOST", str(engines))

        if control_plane:
            stack.spawn("api", [*FREIGHT, "api"])
            stack.spawn("control", [*FREIGHT, "worker", "--control"])
        for model in served:
            for name in engine_names(model, workers_per_model):
                stack.spawn(name, [*FREIGHT, "worker", "--model", model, "--name", f"{name}@%h"])
        if control_plane:
            stack.spawn("beat", [*FREIGHT, "beat"])
            wait_for(
                lambda: _http_ok(stack.api_url + "/healthz"),
                "API",
                60,
                stack.processes["api"],
                stack.log("api"),
            )
            wait_for(
                lambda: stack.started("control"),
                "control worker",
                120,
                stack.processes["control"],
                stack.log("control"),
            )
        for model in served:
            for name in engine_names(model, workers_per_model):
                wait_for(
                    lambda n=name: stack.started(n),
                    f"engine worker {name}",
                    engine_timeout,
                    stack.processes[name],
                    stack.log(name),
                )
        return stack
    except BaseException:
        services.stop_all(run_dir)  # never leave half a stack running
        raise


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print(__doc__, file=sys.stderr)
        return 2
    run_dir = Path(argv[1])
    if argv[0] == "down":
        services.stop_all(run_dir)
        return 0
    try:
        stack = up(run_dir)
    except StackError as exc:
        print(f"stack failed to start: {exc}", file=sys.stderr)
        services.stop_all(run_dir)
        return 1
    print(f"Freight is up: API {stack.api_url}; logs and pids in {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
