"""``/readyz`` against the real services the API tests use (Redis, SeaweedFS, SQLite and
PostgreSQL): 200 when all answer; 503 naming the one that does not, quickly; the body names only
the dependency (no URL, host or driver message: it is unauthenticated), the reason goes to the
log with the password masked; a dependency that accepts a connection and never answers cannot
hang the probe; ``/healthz`` stays 200 through all of it (liveness, not readiness)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from api.app import create_app
from api.services.readiness import CHECK_TIMEOUT_SECONDS
from infra import daemons
from storage.runtime import Runtime
from storage.settings import Settings

PASSWORD = "hunter2-s3cret"


def probe(settings: Settings) -> tuple[int, dict, float]:
    """GET /readyz on a fresh app (status, body, seconds taken); /healthz must answer 200 regardless.
    The failed checks' reasons are logged by the probe (see ``logged``)."""
    rt = Runtime(settings)
    app = create_app(runtime=rt)
    client = app.test_client()
    started = time.monotonic()
    response = client.get("/readyz")
    elapsed = time.monotonic() - started
    assert client.get("/healthz").status_code == 200
    rt.db.dispose()
    body = response.get_json()
    for check in body["checks"].values():  # nothing of the deployment's inside, ever
        assert set(check) == {"ok", "seconds"}, check
    return response.status_code, body, elapsed


def logged(caplog: pytest.LogCaptureFixture, name: str) -> str:
    """The probe's log line for dependency ``name``."""
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"readiness: {name} ")]
    assert lines, [r.getMessage() for r in caplog.records]
    return lines[-1]


def settings_on_s3(settings: Settings, s3_service, monkeypatch: pytest.MonkeyPatch, bucket: str) -> Settings:
    """The test's settings with the object store on a new bucket of the session's SeaweedFS."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_service.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_service.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3_service.region)
    name = s3_service.create_bucket(bucket)
    return replace(settings, object_store_url=f"s3://{name}/freight", s3_endpoint_url=s3_service.endpoint_url)


def closed_port() -> int:
    """A loopback port nothing listens on (bound and released: connecting is refused)."""
    return daemons.free_port()


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts TCP connections (the kernel's backlog) and never answers a byte."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock.getsockname()[1]


def test_ready_when_everything_answers(settings: Settings) -> None:
    status, body, _ = probe(settings)
    assert status == 200, body
    assert body["status"] == "ready" and body["failed"] == []
    assert set(body["checks"]) == {"database", "broker", "object_store"}
    assert all(c["ok"] for c in body["checks"].values())


def test_ready_on_s3(
    settings: Settings, s3_service, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    on_s3 = settings_on_s3(settings, s3_service, monkeypatch, "readyz")
    status, body, _ = probe(on_s3)
    assert status == 200, body
    # a bucket that does not exist is not ready, and says so
    missing = replace(on_s3, object_store_url="s3://no-such-bucket-readyz/freight")
    status, body, _ = probe(missing)
    assert status == 503 and body["failed"] == ["object_store"], body
    assert "NoSuchBucket" in logged(caplog, "object_store")
    assert "no-such-bucket" not in str(body)


def test_broker_down_is_503_naming_the_broker_quickly(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    down = replace(settings, broker_url=f"redis://:{PASSWORD}@127.0.0.1:{closed_port()}/0")
    status, body, elapsed = probe(down)
    assert status == 503, body
    assert body["status"] == "unready" and body["failed"] == ["broker"]
    broker = body["checks"]["broker"]
    line = logged(caplog, "broker")
    assert not broker["ok"] and "refused" in line.lower(), line
    assert "(redis://:****@127.0.0.1:" in line and PASSWORD not in line
    assert body["checks"]["database"]["ok"] and body["checks"]["object_store"]["ok"]
    assert PASSWORD not in str(body) and "127.0.0.1" not in str(body)
    # refused at once: one attempt, no retry or backoff
    assert broker["seconds"] < 1.0, broker
    assert elapsed < CHECK_TIMEOUT_SECONDS, elapsed


def test_database_down_is_503_naming_the_database(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"postgresql+psycopg://freight:{PASSWORD}@127.0.0.1:{closed_port()}/freight"
    status, body, elapsed = probe(replace(settings, database_url=url))
    assert status == 503 and body["failed"] == ["database"], body
    line = logged(caplog, "database")
    assert f"(postgresql+psycopg://freight:****@{url.split('@')[1]})" in line, line
    assert ": OperationalError: " in line and PASSWORD not in line
    assert PASSWORD not in str(body)
    assert elapsed < 3, elapsed


def test_object_store_down_is_503_naming_it(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "freight")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "freight")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    down = replace(
        settings, object_store_url="s3://bucket/p", s3_endpoint_url=f"http://127.0.0.1:{closed_port()}"
    )
    status, body, elapsed = probe(down)
    assert status == 503 and body["failed"] == ["object_store"], body
    assert "connect" in logged(caplog, "object_store").lower()
    assert elapsed < 3, elapsed


def test_a_hung_broker_cannot_hang_the_probe(settings: Settings, silent_server: int) -> None:
    """The server takes the connection and never answers PING: the check fails at the probe's
    timeout, and a second probe meanwhile waits on the same check instead of starting another."""
    from api.services.readiness import ReadinessProbe

    rt = Runtime(replace(settings, broker_url=f"redis://127.0.0.1:{silent_server}/0"))
    readiness = ReadinessProbe(rt, timeout=0.5, reuse_seconds=0)
    try:
        started = time.monotonic()
        first = readiness.check()
        assert time.monotonic() - started < 1.5
        assert first.failed == ["broker"]
        assert "no answer within 0.5 s" in next(c.error for c in first.checks if c.name == "broker")
        second = readiness.check()  # the first PING may still be waiting on its socket timeout
        assert second.failed == ["broker"]
        assert time.monotonic() - started < 3
    finally:
        rt.db.dispose()


def test_a_fresh_probe_times_the_store_not_the_building_of_its_client(
    settings: Settings, s3_service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building a boto3 client costs 0.6-0.8 s of CPU (more on a loaded host): ``create_app`` does
    it before the first probe, so a probe allowed only 0.3 s still finds a healthy store ready.
    A client that cannot be built is left to the probe, which names the dependency."""
    from api.services.readiness import ReadinessProbe

    on_s3 = settings_on_s3(settings, s3_service, monkeypatch, "readyz-fresh")
    readiness = ReadinessProbe(Runtime(on_s3), timeout=0.3, reuse_seconds=0)
    readiness.build_clients()
    result = readiness.check()
    assert result.ready, result
    malformed = ReadinessProbe(Runtime(replace(on_s3, s3_endpoint_url="not a url")), reuse_seconds=0)
    malformed.build_clients()  # does not raise
    assert malformed.check().failed == ["object_store"]
