"""Start and stop Freight's real backing services as local daemons on loopback.

Used by the pytest fixtures and by ``make run`` / ``make stop``. Nothing here does I/O at import.
Each ``start_*`` also takes ``host=`` (the address to listen on, 127.0.0.1 by default) and
``prefix=`` (an argv prefix the daemon runs under, e.g. ``infra.netns.Host.prefix`` to run it
inside a network namespace that stands for another machine).

Services (each returns a frozen handle with a connection URL, the pid and ``stop()``):

* :func:`start_redis`      -> :class:`RedisService`    (``redis-server``, no persistence)
* :func:`start_postgres`   -> :class:`PostgresService` (throwaway ``initdb`` cluster, database ``freight``)
* :func:`start_seaweedfs`  -> :class:`S3Service`       (``weed server -s3``, any access key works)

Pid-file contract (what :func:`stop_all` and ``make stop`` rely on)
-------------------------------------------------------------------
Any ``RUN_DIR/*.pid`` file names one process to stop. Services started here write ``redis.pid``,
``postgres.pid`` and ``seaweedfs.pid``; any other code (API server, workers...) registers its own
processes the same way, e.g. with :func:`write_pidfile`:

* first line: the pid; optional second line: the first signal to send (``SIGINT``...; default
  ``SIGTERM``). Write it *after* the process has started: a file whose mtime is more than 2 s older
  than the start of the process now holding that pid is stale (pid reused) and is only removed.
* the signal goes to the whole process group when the process leads one (start it with
  ``start_new_session=True``), else to the process alone. After the timeout (10 s by default,
  3 s for seaweedfs) the process and its group get ``SIGKILL``; once the leader has exited, what is
  left of its group gets ``SIGKILL`` too. The pid file is then removed.
* registered processes are stopped first (signalled together, then awaited), then seaweedfs,
  postgres, redis.

CLI (used by the Makefile; each ``up-*`` prints ``KEY=VALUE`` lines; PORT may be omitted)::

    python -m infra.daemons up-redis RUN_DIR PORT
    python -m infra.daemons up-postgres RUN_DIR PORT
    python -m infra.daemons up-seaweedfs RUN_DIR S3_PORT
    python -m infra.daemons stop-all RUN_DIR
    python -m infra.daemons status RUN_DIR
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

__all__ = [
    "PostgresService",
    "RedisService",
    "S3Service",
    "ServiceError",
    "ServiceTimeout",
    "free_port",
    "main",
    "pid_alive",
    "read_pidfile",
    "restart_postgres",
    "start_postgres",
    "start_redis",
    "start_seaweedfs",
    "stop_all",
    "stop_pid",
    "stop_pidfile",
    "wait_ready",
    "write_pidfile",
]

HOST = "127.0.0.1"
INFRA_NAMES = ("seaweedfs", "postgres", "redis")  # stopped last by stop_all, in this order
DEFAULT_STOP_TIMEOUT = 10.0
# `weed server` waits 15 s for its filer gRPC server on SIGTERM; its data survives SIGKILL fine.
STOP_TIMEOUTS = {"seaweedfs": 3.0}
_PG_FALLBACK_PREFIX = "freight-pg-"
_PG_FALLBACK_MARKER = "postgres.datadir"
# Popen objects of the daemons this process started itself, reaped once they are stopped.
_CHILDREN: dict[int, subprocess.Popen] = {}


class ServiceError(RuntimeError):
    """A service could not be started (binary missing, process died, already running...)."""


class ServiceTimeout(ServiceError, TimeoutError):
    """A service did not become ready in time."""


# --------------------------------------------------------------------------------------------
# small helpers


def _log_tail(log_path: Path | str | None, lines: int = 40) -> str:
    if not log_path:
        return "(no log file)"
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(cannot read log {log_path}: {exc})"
    tail = text.splitlines()[-lines:]
    return "\n".join(tail) if tail else "(log is empty)"


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _port_bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # as the servers themselves bind: a port whose last server just stopped (its connections
        # in TIME_WAIT) is free for a restart on it; one with a listener is not
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(exclude: Iterable[int] = ()) -> int:
    """A TCP port on 127.0.0.1 that is free now.

    Picked at random below the kernel's ephemeral range, so outgoing connections cannot grab it
    between this call and the service's bind. ``exclude``: ports already promised to someone else.
    """
    excluded = set(exclude)
    lo, _ = _ephemeral_range()
    top = min(lo, 65536) - 1
    if top > 20000:
        for _ in range(200):
            port = random.randint(15000, top)
            if port not in excluded and _port_bindable(port):
                return port
    for _ in range(50):  # fall back to the kernel's choice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if port not in excluded:
            return port
    raise ServiceError("no free TCP port found on 127.0.0.1")


def _boot_time() -> float | None:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the comm field (index 0 is the state)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


def _proc_start_time(pid: int) -> float | None:
    """Process start time as a Unix timestamp (about 1 s precision), or None if unknown."""
    fields = _proc_stat(pid)
    btime = _boot_time()
    if not fields or btime is None:
        return None
    try:
        ticks = int(fields[19])  # field 22 of stat: starttime in clock ticks since boot
    except (IndexError, ValueError):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs. Zombies count as gone (their exit status is left to the parent)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _proc_stat(pid)
    return not (fields and fields[0] in ("Z", "X"))


def _signal_from_name(name: str | None) -> signal.Signals:
    if not name:
        return signal.SIGTERM
    name = name.strip().upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return signal.Signals[name]
    except KeyError:
        return signal.SIGTERM


def _send(pid: int, sig: int) -> None:
    """Signal the process group when ``pid`` leads one, else just the process."""
    try:
        group = os.getpgid(pid) == pid
    except ProcessLookupError:
        return
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if not pid_alive(pid):
            proc = _CHILDREN.pop(pid, None)
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1)
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def stop_pid(pid: int, *, timeout: float = DEFAULT_STOP_TIMEOUT, sig: int = signal.SIGTERM) -> bool:
    """Send ``sig`` (to the group if ``pid`` leads one), wait ``timeout`` s, then SIGKILL.

    Returns True if the process had to be killed with SIGKILL.
    """
    if pid <= 1 or pid == os.getpid():
        raise ValueError(f"refusing to stop pid {pid}")
    if not pid_alive(pid):
        return False
    try:
        leader = os.getpgid(pid) == pid
    except ProcessLookupError:
        return False
    _send(pid, sig)
    if _wait_gone(pid, timeout):
        if leader:  # the leader is gone: whatever is left of its group gets SIGKILL
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        return False
    _send(pid, signal.SIGKILL)
    if leader:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    if not _wait_gone(pid, 10.0):
        raise ServiceError(f"pid {pid} survived SIGKILL")
    return True


def write_pidfile(path: Path | str, pid: int, first_signal: str | None = None) -> Path:
    """Write a pid file following the contract above (atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{pid}\n{first_signal}\n" if first_signal else f"{pid}\n")
    os.replace(tmp, path)
    return path


def read_pidfile(path: Path | str) -> tuple[int, signal.Signals] | None:
    """(pid, first signal) from a pid file, or None when missing or unreadable."""
    try:
        lines = Path(path).read_text().split("\n")
        pid = int(lines[0].strip())
    except (OSError, ValueError, IndexError):
        return None
    return pid, _signal_from_name(lines[1] if len(lines) > 1 else None)


def _pidfile_live_pid(path: Path) -> int | None:
    """The pid in ``path`` if that process still runs and is the one the file was written for."""
    entry = read_pidfile(path)
    if entry is None:
        return None
    pid = entry[0]
    if pid <= 1 or pid == os.getpid() or not pid_alive(pid):
        return None
    started = _proc_start_time(pid)
    try:
        written = path.stat().st_mtime
    except OSError:
        return None
    if started is not None and started > written + 2.0:
        return None  # pid was reused by a process started after the file was written
    return pid


def stop_pidfile(path: Path | str, *, timeout: float | None = None) -> bool:
    """Stop the process named by a pid file and remove the file. True if a process was stopped."""
    path = Path(path)
    entry = read_pidfile(path)
    pid = _pidfile_live_pid(path)
    stopped = False
    if pid is not None and entry is not None:
        name = path.name[: -len(".pid")] if path.name.endswith(".pid") else path.name
        t = timeout if timeout is not None else STOP_TIMEOUTS.get(name, DEFAULT_STOP_TIMEOUT)
        stop_pid(pid, timeout=t, sig=entry[1])
        stopped = True
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return stopped


def stop_all(run_dir: Path | str, *, timeout: float | None = None) -> list[str]:
    """Stop every process with a ``*.pid`` file in ``run_dir`` (see the module docstring).

    Processes registered by other code go first (signalled together), then seaweedfs, postgres,
    redis. Returns the names (pid-file stems) of the processes that were running and got stopped.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    files = sorted(run_dir.glob("*.pid"))
    others = [p for p in files if p.stem not in INFRA_NAMES]
    infra = [run_dir / f"{n}.pid" for n in INFRA_NAMES if (run_dir / f"{n}.pid") in files]
    stopped: list[str] = []

    # Registered processes: signal all, then wait for all, then kill what is left.
    live: list[tuple[Path, int]] = []
    for p in others:
        pid = _pidfile_live_pid(p)
        entry = read_pidfile(p)
        if pid is None or entry is None:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            continue
        _send(pid, entry[1])
        live.append((p, pid))
    deadline = time.monotonic() + (timeout if timeout is not None else DEFAULT_STOP_TIMEOUT)
    for p, pid in live:
        if not _wait_gone(pid, max(0.0, deadline - time.monotonic())):
            stop_pid(pid, timeout=0.0, sig=signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # leftovers of its group (raises if it led none)
        stopped.append(p.stem)
        with contextlib.suppress(FileNotFoundError):
            p.unlink()

    for p in infra:
        if stop_pidfile(p, timeout=timeout):
            stopped.append(p.stem)
        if p.stem == "seaweedfs":
            _cleanup_weed_sockets()
    _cleanup_pg_fallback(run_dir)
    return stopped


def wait_ready(
    check: Callable[[], bool],
    *,
    name: str,
    timeout: float,
    log_path: Path | str | None = None,
    alive: Callable[[], bool] | None = None,
    interval: float = 0.1,
) -> float:
    """Poll ``check()`` (exceptions count as "not yet") until it returns true.

    Raises :class:`ServiceTimeout` after ``timeout`` s, or :class:`ServiceError` as soon as
    ``alive()`` says the process died; both messages carry the tail of ``log_path``.
    Returns the seconds waited.
    """
    t0 = time.monotonic()
    last_exc: BaseException | None = None
    while True:
        try:
            if check():
                return time.monotonic() - t0
        except Exception as exc:  # any failure means "not ready yet"
            last_exc = exc
        if alive is not None and not alive():
            raise ServiceError(
                f"{name} exited during start-up (last check error: {last_exc!r}); "
                f"log {log_path} ends with:\n{_log_tail(log_path)}"
            )
        if time.monotonic() - t0 >= timeout:
            raise ServiceTimeout(
                f"{name} not ready after {timeout:.0f}s (last check error: {last_exc!r}); "
                f"log {log_path} ends with:\n{_log_tail(log_path)}"
            )
        time.sleep(interval)


def _find_binary(name: str, extra_dirs: Iterable[str | Path] = ()) -> str:
    for d in extra_dirs:
        cand = Path(d) / name
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    found = shutil.which(name) or shutil.which(name, path="/usr/local/sbin:/usr/sbin:/sbin")
    if found:
        return found
    raise ServiceError(f"`{name}` not found in PATH or {list(map(str, extra_dirs))}; run infra/install.sh")


def _ensure_port_free(port: int, what: str) -> None:
    if not _port_bindable(port):
        raise ServiceError(f"cannot start {what}: port {port} on {HOST} is already in use")


def _spawn(
    cmd: list[str],
    *,
    log_path: Path,
    cwd: Path,
    pid_file: Path,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start ``cmd`` as a daemon-like child: own session, stdin /dev/null, output appended to the log.

    It survives this Python process (nothing ties it to our terminal); its pid file is written
    at once so that stop_all can stop it even if it never becomes ready.
    """
    with open(log_path, "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    _CHILDREN[proc.pid] = proc
    write_pidfile(pid_file, proc.pid)
    return proc


def _check_not_running(pid_file: Path, what: str) -> None:
    pid = _pidfile_live_pid(pid_file)
    if pid is not None:
        raise ServiceError(f"{what} already running with pid {pid} ({pid_file}); stop it first")
    with contextlib.suppress(FileNotFoundError):
        pid_file.unlink()


def _stop_handle(
    pid: int, pid_file: Path, start_time: float | None, name: str, timeout: float | None
) -> bool:
    t = timeout if timeout is not None else STOP_TIMEOUTS.get(name, DEFAULT_STOP_TIMEOUT)
    entry = read_pidfile(pid_file)
    if entry is not None and entry[0] == pid:
        return stop_pidfile(pid_file, timeout=t)
    # pid file gone (e.g. stop_all ran): only stop the pid if it is still the same process
    if pid_alive(pid) and (start_time is None or _proc_start_time(pid) == start_time):
        sig = signal.SIGINT if name == "postgres" else signal.SIGTERM
        stop_pid(pid, timeout=t, sig=sig)
        return True
    return False


# --------------------------------------------------------------------------------------------
# Redis


@dataclasses.dataclass(frozen=True)
class RedisService:
    url: str
    host: str
    port: int
    pid: int
    pid_file: Path
    log_path: Path
    run_dir: Path
    start_time: float | None = dataclasses.field(default=None, repr=False)

    def url_for(self, db: int) -> str:
        """URL of another logical database on this server."""
        return f"redis://{self.host}:{self.port}/{db}"

    def ping(self, timeout: float = 2.0) -> bool:
        return _redis_ping(self.host, self.port, timeout)

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the server (SIGTERM, SIGKILL after ``timeout``); True if it was running."""
        return _stop_handle(self.pid, self.pid_file, self.start_time, "redis", timeout)


def _redis_ping(host: str, port: int, timeout: float = 1.0) -> bool:
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(b"PING\r\n")
        data = b""
        while not data.endswith(b"\r\n"):
            chunk = s.recv(256)
            if not chunk:
                break
            data += chunk
    return data.startswith(b"+PONG")


def start_redis(
    run_dir: Path | str,
    port: int | None = None,
    *,
    timeout: float = 30.0,
    host: str = HOST,
    prefix: Sequence[str] = (),
) -> RedisService:
    """``redis-server`` on HOST:PORT (127.0.0.1 by default), no persistence, in its own session;
    pid file ``redis.pid``. ``prefix``: argv it runs under (another machine's namespace)."""
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    pid_file = run_dir / "redis.pid"
    log_path = run_dir / "redis.log"
    _check_not_running(pid_file, "redis")
    if not prefix:  # a port of this machine's loopback; another namespace has ports of its own
        _ensure_port_free(port, "redis")
    binary = _find_binary("redis-server", ["/usr/bin", "/usr/sbin", "/usr/local/bin"])
    # Not --daemonize yes: redis then forks and writes its pid file only after binding, so a
    # failed start could not be told from a slow one. A child in its own session outlives this
    # process just the same (make run), and its pid is known at once.
    cmd = [
        *prefix,
        binary,
        "--port",
        str(port),
        "--bind",
        host,
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "no",
        "--pidfile",
        str(pid_file),
        "--dir",
        str(run_dir),
        "--logfile",
        str(log_path),
        # protected mode answers every client not on loopback with DENIED when there is no
        # password: on another address (a test network's host) the clients are the other hosts
        "--protected-mode",
        "yes" if host == HOST else "no",
    ]
    proc = _spawn(cmd, log_path=log_path, cwd=run_dir, pid_file=pid_file)
    try:
        wait_ready(
            lambda: _redis_ping(host, port),
            name=f"redis on {host}:{port}",
            timeout=timeout,
            log_path=log_path,
            alive=lambda: proc.poll() is None,
        )
    except BaseException:
        stop_pidfile(pid_file, timeout=2)
        raise
    return RedisService(
        url=f"redis://{host}:{port}/0",
        host=host,
        port=port,
        pid=proc.pid,
        pid_file=pid_file,
        log_path=log_path,
        run_dir=run_dir,
        start_time=_proc_start_time(proc.pid),
    )


# --------------------------------------------------------------------------------------------
# PostgreSQL


def _pg_bin_dirs() -> list[str]:
    def version_key(d: str) -> float:
        try:
            return float(Path(d).parent.name)
        except ValueError:
            return 0.0

    return sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version_key, reverse=True)


def _pg_binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    return _find_binary(name, _pg_bin_dirs())


def _as_postgres_cmd(cmd: list[str]) -> list[str]:
    """Wrap ``cmd`` to run as the ``postgres`` OS user when we are root (PostgreSQL refuses root)."""
    if os.geteuid() != 0:
        return cmd
    if shutil.which("runuser"):
        return ["runuser", "-u", "postgres", "--", *cmd]
    return ["su", "postgres", "-s", "/bin/sh", "-c", shlex.join(cmd)]


def _postgres_ids() -> tuple[int, int]:
    import pwd

    try:
        pw = pwd.getpwnam("postgres")
    except KeyError:
        raise ServiceError(
            "running as root but there is no `postgres` OS user to run PostgreSQL as; "
            "install the postgresql package (infra/install.sh) or run as a normal user"
        ) from None
    return pw.pw_uid, pw.pw_gid


def _run(cmd: list[str], *, what: str, cwd: Path, timeout: float, log_path: Path | None = None) -> str:
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        extra = f"\nlog {log_path} ends with:\n{_log_tail(log_path)}" if log_path else ""
        raise ServiceTimeout(f"{what} timed out after {timeout:.0f}s: {shlex.join(cmd)}{extra}") from exc
    if proc.returncode != 0:
        extra = f"\nlog {log_path} ends with:\n{_log_tail(log_path)}" if log_path else ""
        out = (proc.stdout + proc.stderr).strip()
        raise ServiceError(f"{what} failed ({proc.returncode}): {shlex.join(cmd)}\n{out}{extra}")
    return proc.stdout


def _pg_base_dir(run_dir: Path) -> tuple[Path, bool]:
    """Where the cluster lives: run_dir itself if the postgres user can reach it, else a temp dir.

    Returns (base, is_fallback). pytest's tmp dirs (/tmp/pytest-of-root, mode 0700) are not
    reachable by the postgres user, hence the fallback; its path is kept in run_dir/postgres.datadir
    so a restart reuses it and stop()/stop_all() remove it.
    """
    if os.geteuid() != 0:
        return run_dir, False
    uid, gid = _postgres_ids()
    probe = subprocess.run(_as_postgres_cmd(["test", "-x", str(run_dir)]), cwd="/", capture_output=True)
    if probe.returncode == 0:
        return run_dir, False
    marker = run_dir / _PG_FALLBACK_MARKER
    with contextlib.suppress(OSError):
        prev = Path(marker.read_text().strip())
        if prev.is_dir() and _is_pg_fallback(prev):
            return prev, True
    base = Path(tempfile.mkdtemp(prefix=_PG_FALLBACK_PREFIX, dir="/tmp"))
    os.chown(base, uid, gid)
    marker.write_text(f"{base}\n")
    return base, True


def _is_pg_fallback(path: Path) -> bool:
    return path.parent == Path("/tmp") and path.name.startswith(_PG_FALLBACK_PREFIX)


def _cleanup_pg_fallback(run_dir: Path, *, background: bool = False) -> None:
    """Remove a stopped temp-dir cluster. ``background``: hand the removal to a detached ``rm``
    and return at once (a test session's cluster holds hundreds of databases, about 10 MB and
    400 files each: removing them took most of the session's 17 s teardown)."""
    marker = run_dir / _PG_FALLBACK_MARKER
    try:
        base = Path(marker.read_text().strip())
    except OSError:
        return
    if _is_pg_fallback(base):
        entry = read_pidfile(base / "pgdata" / "postmaster.pid")
        if entry is None or not pid_alive(entry[0]):
            if background:
                # renamed first, so a restart in run_dir never finds a half-removed cluster
                doomed = base.with_name(base.name + ".removing")
                base.rename(doomed)
                subprocess.Popen(["rm", "-rf", "--", str(doomed)], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)  # fmt: skip
            else:
                shutil.rmtree(base, ignore_errors=True)
            marker.unlink(missing_ok=True)


@dataclasses.dataclass(frozen=True)
class PostgresService:
    url: str
    host: str
    port: int
    pid: int
    pid_file: Path
    log_path: Path
    data_dir: Path
    run_dir: Path
    user: str = "postgres"
    database: str = "freight"
    start_time: float | None = dataclasses.field(default=None, repr=False)
    prefix: tuple[str, ...] = ()  # the argv prefix the postmaster was started under (restarts reuse it)

    def url_for(self, database: str, driver: str = "psycopg") -> str:
        """SQLAlchemy URL of another database on this server (``driver=""``: plain libpq URL)."""
        scheme = f"postgresql+{driver}" if driver else "postgresql"
        return f"{scheme}://{self.user}@{self.host}:{self.port}/{database}"

    @property
    def dsn(self) -> str:
        """libpq/psycopg connection string for the ``freight`` database."""
        return f"host={self.host} port={self.port} user={self.user} dbname={self.database}"

    def create_database(self, name: str, *, exist_ok: bool = False, template: str | None = None) -> str:
        """CREATE DATABASE ``name`` (a copy of database ``template`` when given, which nothing may
        be connected to meanwhile); returns its SQLAlchemy URL."""
        _pg_create_database(self.host, self.port, self.user, name, exist_ok=exist_ok, template=template)
        return self.url_for(name)

    def drop_database(self, name: str, *, missing_ok: bool = True) -> None:
        """DROP DATABASE ``name`` WITH (FORCE) (closes its open connections)."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(
            host=self.host, port=self.port, user=self.user, dbname="postgres", autocommit=True
        ) as conn:
            exists = " IF EXISTS" if missing_ok else ""
            conn.execute(sql.SQL("DROP DATABASE" + exists + " {} WITH (FORCE)").format(sql.Identifier(name)))

    def stop(self, timeout: float | None = None, *, remove_in_background: bool = False) -> bool:
        """Fast shutdown (SIGINT to the postmaster, SIGKILL after ``timeout``).

        A temp-dir cluster (see ``_pg_base_dir``) is deleted, by a detached ``rm`` when
        ``remove_in_background``; one inside run_dir is kept.
        """
        stopped = _stop_handle(self.pid, self.pid_file, self.start_time, "postgres", timeout)
        _cleanup_pg_fallback(self.run_dir, background=remove_in_background)
        return stopped


def _pg_create_database(
    host: str, port: int, user: str, name: str, *, exist_ok: bool, template: str | None = None
) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(host=host, port=port, user=user, dbname="postgres", autocommit=True) as conn:
        if exist_ok and conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            return
        statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template is not None:
            statement = sql.SQL("{} TEMPLATE {}").format(statement, sql.Identifier(template))
        conn.execute(statement)


def _pg_trust_samenet(hba: Path) -> None:
    """Let clients on the server's own subnets in, as ``initdb --auth=trust`` lets loopback in."""
    line = "host all all samenet trust\n"
    text = hba.read_text()
    if line not in text:
        hba.write_text(text + line)  # rewritten in place: the file keeps its owner


def _pg_select1(host: str, port: int, user: str) -> bool:
    import psycopg

    with psycopg.connect(host=host, port=port, user=user, dbname="postgres", connect_timeout=2) as conn:
        return conn.execute("SELECT 1").fetchone() == (1,)


def _pg_options(port: int, data_dir: Path, host: str = HOST) -> str:
    """The postmaster's ``pg_ctl -o`` options (the same on every start of a cluster)."""
    # The unix socket lives in the data dir when its path fits (max 107 bytes), else none (TCP only).
    sock = data_dir / f".s.PGSQL.{port}"
    sock_dir = str(data_dir) if len(str(sock)) < 100 and not set(str(data_dir)) & set(" '\"\\$`") else ""
    return (
        f"-p {port} -k '{sock_dir}' -c listen_addresses={host} -c fsync=off -c full_page_writes=off "
        "-c synchronous_commit=off -c max_connections=200"
    )


def restart_postgres(handle: PostgresService, pause: float = 0.0, timeout: float = 60.0) -> PostgresService:
    """Fast-stop the cluster (open connections are cut), wait ``pause`` s, start it again on the same
    port and data; returns the new handle (the pid file follows). For fault-injection tests."""
    pg_ctl = _pg_binary("pg_ctl")
    base = handle.data_dir.parent
    stop_cmd = [pg_ctl, "-D", str(handle.data_dir), "-m", "fast", "-w", "-t", str(int(timeout)), "stop"]
    _run(_as_postgres_cmd(stop_cmd), what="postgres stop", cwd=base, timeout=timeout + 10)
    time.sleep(pause)  # the outage itself
    opts = _pg_options(handle.port, handle.data_dir, handle.host)
    start_cmd = [pg_ctl, "-D", str(handle.data_dir), "-l", str(handle.log_path), "-o", opts, "-w"]
    _run(
        [*handle.prefix, *_as_postgres_cmd([*start_cmd, "-t", str(int(timeout)), "start"])],
        what=f"postgres on port {handle.port}",
        cwd=base,
        timeout=timeout + 10,
        log_path=handle.log_path,
    )
    entry = read_pidfile(handle.data_dir / "postmaster.pid")
    if entry is None:
        raise ServiceError("postgres restarted but its postmaster.pid is unreadable")
    write_pidfile(handle.pid_file, entry[0], "SIGINT")
    return dataclasses.replace(handle, pid=entry[0], start_time=_proc_start_time(entry[0]))


def start_postgres(
    run_dir: Path | str,
    port: int | None = None,
    *,
    database: str = "freight",
    timeout: float = 60.0,
    host: str = HOST,
    prefix: Sequence[str] = (),
) -> PostgresService:
    """A PostgreSQL cluster on HOST:PORT (127.0.0.1 by default) with trust auth, user
    ``postgres``, db ``database``.

    ``initdb`` runs only if the data dir has no cluster yet (a restart on the same run_dir keeps
    the data). As root, everything runs as the ``postgres`` OS user. Pid file ``postgres.pid``
    (second line ``SIGINT``: fast shutdown). On an address other than loopback the cluster also
    trusts the subnets that address is on (``samenet``): a test network's other hosts.
    ``prefix``: argv the postmaster starts under (another machine's namespace).
    """
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    pid_file = run_dir / "postgres.pid"
    _check_not_running(pid_file, "postgres")
    if not prefix:  # a port of this machine's loopback; another namespace has ports of its own
        _ensure_port_free(port, "postgres")
    initdb, pg_ctl = _pg_binary("initdb"), _pg_binary("pg_ctl")

    base, _fallback = _pg_base_dir(run_dir)
    data_dir = base / "pgdata"
    log_path = base / "postgres.log"
    ids = _postgres_ids() if os.geteuid() == 0 else None
    if not (data_dir / "PG_VERSION").exists():
        if data_dir.exists():
            shutil.rmtree(data_dir)
        data_dir.mkdir(mode=0o700)
        if ids:
            os.chown(data_dir, *ids)
        initdb_cmd = [
            initdb,
            "-D",
            str(data_dir),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
            "--no-instructions",
        ]
        _run(_as_postgres_cmd(initdb_cmd), what="initdb", cwd=base, timeout=120)
    log_path.touch()
    if ids:
        os.chown(log_path, *ids)
    if host != HOST:
        _pg_trust_samenet(data_dir / "pg_hba.conf")

    opts = _pg_options(port, data_dir, host)
    postmaster_pid_file = data_dir / "postmaster.pid"
    entry = read_pidfile(postmaster_pid_file)
    if entry is not None and not pid_alive(entry[0]):
        postmaster_pid_file.unlink(missing_ok=True)
    # -w: pg_ctl waits until the server accepts connections and notices at once if it dies.
    start_cmd = [pg_ctl, "-D", str(data_dir), "-l", str(log_path), "-o", opts, "-w", "-t", str(int(timeout))]
    _run(
        [*prefix, *_as_postgres_cmd([*start_cmd, "start"])],
        what=f"postgres on {host}:{port}",
        cwd=base,
        timeout=timeout + 10,
        log_path=log_path,
    )
    entry = read_pidfile(postmaster_pid_file)
    if entry is None:
        raise ServiceError(f"postgres started but {postmaster_pid_file} is unreadable")
    pid = entry[0]
    write_pidfile(pid_file, pid, "SIGINT")
    handle = PostgresService(
        url=f"postgresql+psycopg://postgres@{host}:{port}/{database}",
        host=host,
        port=port,
        pid=pid,
        pid_file=pid_file,
        log_path=log_path,
        data_dir=data_dir,
        run_dir=run_dir,
        database=database,
        start_time=_proc_start_time(pid),
        prefix=tuple(prefix),
    )
    try:
        wait_ready(
            lambda: _pg_select1(host, port, "postgres"),
            name=f"postgres on {host}:{port}",
            timeout=10,
            log_path=log_path,
            alive=lambda: pid_alive(pid),
        )
        _pg_create_database(host, port, "postgres", database, exist_ok=True)
    except BaseException:
        handle.stop()
        raise
    return handle


# --------------------------------------------------------------------------------------------
# SeaweedFS (S3)


@dataclasses.dataclass(frozen=True)
class S3Service:
    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    pid: int
    pid_file: Path
    log_path: Path
    data_dir: Path
    run_dir: Path
    ports: dict[str, int] = dataclasses.field(default_factory=dict, compare=False)
    start_time: float | None = dataclasses.field(default=None, repr=False)

    @property
    def url(self) -> str:
        return self.endpoint_url

    def client(self):  # -> botocore S3 client
        """A boto3 S3 client for this server (path-style addressing)."""
        return _s3_client(self.endpoint_url, self.access_key, self.secret_key, self.region)

    def create_bucket(self, name: str, *, exist_ok: bool = True) -> str:
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
            if not exist_ok:
                raise
        return name

    def stop(self, timeout: float | None = None) -> bool:
        """SIGTERM, then SIGKILL after ``timeout`` (default 3 s: weed waits 15 s on its gRPC)."""
        stopped = _stop_handle(self.pid, self.pid_file, self.start_time, "seaweedfs", timeout)
        _cleanup_weed_sockets()
        return stopped


def _s3_client(endpoint_url: str, access_key: str, secret_key: str, region: str, *, probe: bool = False):
    import boto3
    from botocore.config import Config

    config = Config(
        s3={"addressing_style": "path"},
        retries={"max_attempts": 1 if probe else 3},
        connect_timeout=1 if probe else 5,
        read_timeout=2 if probe else 60,
    )
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name=region,
        config=config,
    )


def _cleanup_weed_sockets() -> None:
    """Remove the /tmp/seaweedfs-*-grpc-PORT.sock files weed leaves behind once nobody listens."""
    for p in glob.glob("/tmp/seaweedfs-*.sock"):
        path = Path(p)
        with contextlib.suppress(OSError):
            if not path.is_socket():
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(0.5)
                try:
                    s.connect(p)
                except ConnectionRefusedError:
                    path.unlink()


def _weed_binary() -> str:
    # The venv's bin is not on PATH when running .venv/bin/python directly.
    return _find_binary("weed", [Path(sys.executable).parent])


def start_seaweedfs(
    run_dir: Path | str,
    s3_port: int | None = None,
    *,
    access_key: str = "freight",
    secret_key: str = "freight-secret",
    auth: bool = False,
    timeout: float = 60.0,
    host: str = HOST,
    prefix: Sequence[str] = (),
) -> S3Service:
    """``weed server`` (master + volume + filer + S3 gateway) on HOST (loopback by default); pid
    file ``seaweedfs.pid``. ``prefix``: argv it runs under (another machine's namespace).

    ``auth=False`` (default): no identities, so any access key / secret is accepted, but then
    SeaweedFS 4.x answers ListBuckets with an empty list (use head_bucket to test for a bucket).
    ``auth=True``: one admin identity with ``access_key``/``secret_key`` (written to
    RUN_DIR/seaweedfs-s3.json); other keys are refused and ListBuckets lists the buckets.
    Data in RUN_DIR/seaweedfs survives a restart on the same run_dir.
    """
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    s3_port = s3_port or free_port()
    pid_file = run_dir / "seaweedfs.pid"
    log_path = run_dir / "seaweedfs.log"
    data_dir = run_dir / "seaweedfs"
    _check_not_running(pid_file, "seaweedfs")
    if not prefix:  # a port of this machine's loopback; another namespace has ports of its own
        _ensure_port_free(s3_port, "seaweedfs")
    binary = _weed_binary()
    data_dir.mkdir(exist_ok=True)

    ports: dict[str, int] = {"s3": s3_port}
    for key in ("master", "volume", "filer", "master.grpc", "volume.grpc", "filer.grpc", "s3.grpc"):
        ports[key] = free_port(exclude=ports.values())
    cmd = [
        *prefix,
        binary,
        "-logtostderr",
        "server",
        f"-dir={data_dir}",
        f"-ip={host}",
        f"-ip.bind={host}",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={ports['master.grpc']}",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={ports['volume.grpc']}",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={ports['filer.grpc']}",
        "-s3",
        f"-s3.port={s3_port}",
        f"-s3.port.grpc={ports['s3.grpc']}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        "-volume.preStopSeconds=0",
        # Every bucket is its own collection and a new collection grows several volumes at once:
        # small volumes and no fixed cap keep many test buckets from exhausting the volume slots.
        "-master.volumeSizeLimitMB=256",
        "-volume.max=3000",
    ]
    if auth:
        import json

        cfg = run_dir / "seaweedfs-s3.json"
        identity = {
            "name": "freight",
            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        cfg.write_text(json.dumps({"identities": [identity]}, indent=2))
        cfg.chmod(0o600)
        cmd.append(f"-s3.config={cfg}")
    for svc in ("filer", "s3"):
        sock = data_dir / f"{svc}.sock"
        if len(str(sock)) < 100:
            cmd.append(f"-{svc}.localSocket={sock}")
    log_start = log_path.stat().st_size if log_path.exists() else 0
    # master.toml's [master.volume_growth] copy_1, read through viper's WEED_ environment prefix.
    env = {**os.environ, "WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"}
    proc = _spawn(cmd, log_path=log_path, cwd=data_dir, pid_file=pid_file, env=env)
    endpoint = f"http://{host}:{s3_port}"
    handle = S3Service(
        endpoint_url=endpoint,
        access_key=access_key,
        secret_key=secret_key,
        region="us-east-1",
        pid=proc.pid,
        pid_file=pid_file,
        log_path=log_path,
        data_dir=data_dir,
        run_dir=run_dir,
        ports=ports,
        start_time=_proc_start_time(proc.pid),
    )
    client = _s3_client(endpoint, access_key, secret_key, handle.region, probe=True)
    try:
        wait_ready(
            lambda: client.list_buckets() is not None and _weed_has_volume_server(host, ports["master"]),
            name=f"seaweedfs S3 on {host}:{s3_port}",
            timeout=timeout,
            log_path=log_path,
            # after a fatal error (glog "F" line) weed takes 15 s+ to exit: count it as dead
            alive=lambda: proc.poll() is None and not _weed_fatal(log_path, log_start),
            interval=0.2,
        )
    except BaseException:
        handle.stop(timeout=1)
        raise
    return handle


def _weed_fatal(log_path: Path, offset: int) -> bool:
    """True if weed logged a fatal (glog ``F``) line after ``offset``."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            return any(line.startswith(b"F") and line[1:5].isdigit() for line in f)
    except OSError:
        return False


def _weed_has_volume_server(host: str, master_port: int) -> bool:
    """True once a volume server has registered with the master (writes would fail before)."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://{host}:{master_port}/dir/status", timeout=2) as resp:
        topo = json.load(resp).get("Topology", {})
    for dc in topo.get("DataCenters") or []:
        for rack in dc.get("Racks") or []:
            if rack.get("DataNodes"):
                return True
    return False


# --------------------------------------------------------------------------------------------
# CLI


def _status(run_dir: Path) -> list[str]:
    out = []
    for p in sorted(run_dir.glob("*.pid")) if run_dir.is_dir() else []:
        pid = _pidfile_live_pid(p)
        entry = read_pidfile(p)
        shown = entry[0] if entry else "?"
        out.append(f"{p.stem}\t{shown}\t{'running' if pid else 'stale'}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.daemons", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, help_ in (
        ("up-redis", "start redis-server; prints REDIS_URL=..."),
        ("up-postgres", "start a PostgreSQL cluster; prints DATABASE_URL=..."),
        ("up-seaweedfs", "start SeaweedFS with S3; prints S3_ENDPOINT_URL=... and keys"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("run_dir", type=Path)
        p.add_argument("port", type=int, nargs="?", default=0, help="listen port (default: a free one)")
        p.add_argument("--timeout", type=float, default=60.0)
    p = sub.add_parser("stop-all", help="stop every process with a *.pid file in RUN_DIR")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--timeout", type=float, default=None)
    p = sub.add_parser("status", help="list the *.pid files in RUN_DIR and whether they run")
    p.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)

    try:
        if args.cmd == "up-redis":
            r = start_redis(args.run_dir, args.port or None, timeout=args.timeout)
            print(f"REDIS_URL={r.url}\nREDIS_PID={r.pid}")
        elif args.cmd == "up-postgres":
            pg = start_postgres(args.run_dir, args.port or None, timeout=args.timeout)
            print(f"DATABASE_URL={pg.url}\nPOSTGRES_PID={pg.pid}")
        elif args.cmd == "up-seaweedfs":
            s3 = start_seaweedfs(args.run_dir, args.port or None, timeout=args.timeout)
            print(
                f"S3_ENDPOINT_URL={s3.endpoint_url}\nAWS_ACCESS_KEY_ID={s3.access_key}\n"
                f"AWS_SECRET_ACCESS_KEY={s3.secret_key}\nAWS_DEFAULT_REGION={s3.region}\nSEAWEEDFS_PID={s3.pid}"
            )
        elif args.cmd == "stop-all":
            stopped = stop_all(args.run_dir, timeout=args.timeout)
            print("stopped: " + (" ".join(stopped) if stopped else "(nothing running)"))
        elif args.cmd == "status":
            print("\n".join(_status(args.run_dir)) or "(no pid files)")
    except ServiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
