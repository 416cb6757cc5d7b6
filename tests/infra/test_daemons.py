"""infra.daemons against the real servers: Redis, PostgreSQL, SeaweedFS (no mocks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from infra import daemons as services

REPO = Path(__file__).resolve().parents[2]


def _gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while services.pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_redis_start_answers_and_stops(tmp_path: Path) -> None:
    import redis

    t0 = time.monotonic()
    svc = services.start_redis(tmp_path, services.free_port())
    print(f"redis ready in {time.monotonic() - t0:.2f}s")
    try:
        assert svc.url == f"redis://127.0.0.1:{svc.port}/0"
        assert services.read_pidfile(tmp_path / "redis.pid")[0] == svc.pid
        client = redis.Redis.from_url(svc.url)
        assert client.ping() is True
        client.set("freight:test", b"value")
        assert client.get("freight:test") == b"value"
        client.close()
        # a second server on the same run_dir is refused while the first runs
        with pytest.raises(services.ServiceError, match="already running"):
            services.start_redis(tmp_path, services.free_port())
    finally:
        assert svc.stop() is True
    assert _gone(svc.pid)
    assert not svc.pid_file.exists()
    assert svc.stop() is False  # idempotent


def test_postgres_start_select_create_database_and_stop(tmp_path: Path) -> None:
    import sqlalchemy as sa

    t0 = time.monotonic()
    svc = services.start_postgres(tmp_path, services.free_port())
    print(f"postgres ready in {time.monotonic() - t0:.2f}s (data dir {svc.data_dir})")
    try:
        assert svc.url == f"postgresql+psycopg://postgres@127.0.0.1:{svc.port}/freight"
        engine = sa.create_engine(svc.url)
        with engine.connect() as conn:
            assert conn.execute(sa.text("select 1")).scalar() == 1
            assert conn.execute(sa.text("select current_database()")).scalar() == "freight"
        engine.dispose()

        name = f"t_{uuid.uuid4().hex[:10]}"
        url = svc.create_database(name)
        assert url.endswith(f"/{name}")
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.execute(sa.text("create table t (x int)"))
            conn.execute(sa.text("insert into t values (42)"))
            assert conn.execute(sa.text("select x from t")).scalar() == 42
        engine.dispose()
        with pytest.raises(Exception, match="already exists"):
            svc.create_database(name)
        svc.drop_database(name)
    finally:
        assert svc.stop() is True
    assert _gone(svc.pid)
    assert not svc.pid_file.exists()
    # pytest's tmp dirs are not reachable by the postgres user: the cluster then lives in a temp
    # dir of its own, which stop() removes
    if svc.data_dir.parent != tmp_path:
        assert not svc.data_dir.exists()


def test_seaweedfs_s3_put_get_and_stop(tmp_path: Path) -> None:
    t0 = time.monotonic()
    svc = services.start_seaweedfs(tmp_path, services.free_port())
    print(f"seaweedfs ready in {time.monotonic() - t0:.2f}s")
    try:
        assert svc.endpoint_url == f"http://127.0.0.1:{svc.ports['s3']}"
        assert svc.create_bucket("freight-test") == "freight-test"
        assert svc.create_bucket("freight-test") == "freight-test"  # exist_ok
        client = svc.client()
        client.put_object(Bucket="freight-test", Key="batches/b1/input.jsonl", Body=b'{"a": 1}\n')
        body = client.get_object(Bucket="freight-test", Key="batches/b1/input.jsonl")["Body"].read()
        assert body == b'{"a": 1}\n'
        client.head_bucket(Bucket="freight-test")

        # any access key is accepted
        import boto3

        other = boto3.client(
            "s3",
            endpoint_url=svc.endpoint_url,
            aws_access_key_id="someone",
            aws_secret_access_key="else",
            region_name="us-east-1",
        )
        assert other.get_object(Bucket="freight-test", Key="batches/b1/input.jsonl")["Body"].read() == body

        # Each bucket is a collection: one volume per bucket from a fixed, large slot pool, so a
        # test run's many buckets cannot exhaust a pool sized from free disk ("no free volumes").
        for name in ("freight-test-2", "freight-test-3"):
            svc.create_bucket(name)
            client.put_object(Bucket=name, Key="k", Body=b"x")
        with urllib.request.urlopen(f"http://127.0.0.1:{svc.ports['master']}/dir/status") as resp:
            topology = json.load(resp)["Topology"]
        assert topology["Max"] == 3000
        assert topology["Max"] - topology["Free"] == 3
    finally:
        t1 = time.monotonic()
        assert svc.stop() is True
        print(f"seaweedfs stopped in {time.monotonic() - t1:.2f}s")
    assert _gone(svc.pid)
    assert not svc.pid_file.exists()


def _spawn_group(tmp_path: Path, name: str, *, ignore_term: bool = False) -> tuple[subprocess.Popen, int]:
    """A process-group leader with a grandchild; registered as RUN_DIR/NAME.pid."""
    trap = "trap '' TERM; " if ignore_term else ""
    child_pid_file = tmp_path / f"{name}.child"
    script = f"{trap}sleep 300 & echo $! > {child_pid_file}; wait"
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    deadline = time.monotonic() + 5
    while not child_pid_file.exists() or not child_pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    services.write_pidfile(tmp_path / f"{name}.pid", proc.pid)
    return proc, int(child_pid_file.read_text())


def test_stop_all_stops_registered_pid_files(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    leader, grandchild = _spawn_group(run_dir, "worker")
    stubborn, stubborn_child = _spawn_group(run_dir, "stubborn", ignore_term=True)
    plain = subprocess.Popen(["sleep", "300"])  # not a group leader: only the pid is signalled
    services.write_pidfile(run_dir / "plain.pid", plain.pid)
    # a stale file whose process is gone is just removed
    dead = subprocess.Popen(["true"])
    dead.wait()
    services.write_pidfile(run_dir / "stale.pid", dead.pid)
    (run_dir / "junk.pid").write_text("not a pid\n")

    t0 = time.monotonic()
    stopped = services.stop_all(run_dir, timeout=1.0)
    elapsed = time.monotonic() - t0
    assert sorted(stopped) == ["plain", "stubborn", "worker"]
    assert elapsed < 5
    for pid in (leader.pid, grandchild, stubborn.pid, stubborn_child, plain.pid):
        assert _gone(pid), pid
    assert leader.wait(timeout=5) == -signal.SIGTERM
    assert stubborn.wait(timeout=5) == -signal.SIGKILL
    assert plain.wait(timeout=5) == -signal.SIGTERM
    assert list(run_dir.glob("*.pid")) == []
    assert services.stop_all(run_dir) == []
    assert services.stop_all(tmp_path / "missing") == []


def test_stop_all_skips_reused_pid(tmp_path: Path) -> None:
    """A pid file older than the process that now has its pid is stale: that process is left alone."""
    proc = subprocess.Popen(["sleep", "300"])
    try:
        pid_file = services.write_pidfile(tmp_path / "old.pid", proc.pid)
        old = time.time() - 3600
        os.utime(pid_file, (old, old))
        assert services.stop_all(tmp_path) == []
        assert proc.poll() is None
        assert not pid_file.exists()
    finally:
        proc.kill()
        proc.wait()


def test_stop_all_stops_services_too(tmp_path: Path) -> None:
    redis_svc = services.start_redis(tmp_path, services.free_port())
    dummy = subprocess.Popen(["sleep", "300"], start_new_session=True)
    services.write_pidfile(tmp_path / "api.pid", dummy.pid)
    assert services.stop_all(tmp_path) == ["api", "redis"]
    assert _gone(redis_svc.pid) and _gone(dummy.pid)
    assert dummy.wait(timeout=5) == -signal.SIGTERM
    assert redis_svc.stop() is False


def test_wait_ready_timeout_reports_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "svc.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)) + "FATAL: port in use\n")
    with pytest.raises(services.ServiceTimeout, match=r"(?s)not ready after.*FATAL: port in use"):
        services.wait_ready(lambda: False, name="svc", timeout=0.3, log_path=log)
    with pytest.raises(services.ServiceError, match=r"(?s)exited during start-up.*line 99"):
        services.wait_ready(lambda: 1 / 0, name="svc", timeout=10, log_path=log, alive=lambda: False)
    assert services.wait_ready(lambda: True, name="svc", timeout=1) < 1


def test_free_port_is_bindable_and_respects_exclude() -> None:
    import socket

    seen: set[int] = set()
    for _ in range(20):
        port = services.free_port(exclude=seen)
        assert port not in seen
        seen.add(port)
        with socket.socket() as s:
            # as the servers bind (SO_REUSEADDR): free_port may return a port whose last server's
            # connections are in TIME_WAIT, which a plain bind refuses (failed once in a full run)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def services_cli(env: dict[str, str], *args: str) -> str:
    """``python -m infra.daemons ARGS`` as an operator runs it; its stdout."""
    return subprocess.run(
        [sys.executable, "-m", "infra.daemons", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip


def test_cli_up_redis_and_stop_all(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    port = services.free_port()
    out = services_cli(env, "up-redis", str(tmp_path), str(port))
    assert f"REDIS_URL=redis://127.0.0.1:{port}/0" in out
    pid = services.read_pidfile(tmp_path / "redis.pid")[0]
    assert services.pid_alive(pid)
    status = services_cli(env, "status", str(tmp_path))
    assert f"redis\t{pid}\trunning" in status
    out = services_cli(env, "stop-all", str(tmp_path))
    assert "redis" in out
    assert _gone(pid)
