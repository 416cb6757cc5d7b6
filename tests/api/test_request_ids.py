"""``x-request-id``: echoed when the client's is plain, replaced when it is absent or not, and on
every line logged about the request: through Flask's test client, and through the real gunicorn
``freight api`` execs, whose own lines (access lines included) are then JSON too."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from api.app import create_app
from api.request_ids import MAX_LENGTH, accepted
from infra import daemons
from storage.logs import current
from storage.runtime import Runtime
from storage.settings import Settings
from tests.conftest import REPO, json_lines

GENERATED = re.compile(r"req_[0-9a-f]{32}")
# what a client must not get back or into the logs: too long, spaces, a quote, a forged log line
REFUSED = ["a" * (MAX_LENGTH + 1), "two words", 'x"}', "id\r\nINFO forged line", "caf\u00e9", ""]


@pytest.fixture
def lone_settings(tmp_path: Path, migrated_sqlite: Path) -> Settings:
    """SQLite, files on disk, and a broker nobody listens on: /readyz then logs a failed check."""
    shutil.copyfile(migrated_sqlite, tmp_path / "freight.db")  # the session's migrated database
    settings = Settings.from_env(
        {},
        data_dir=tmp_path,
        broker_url=f"redis://127.0.0.1:{daemons.free_port()}/0",
        rate_limit_rps=0,
        rate_limit_anonymous_rps=0,
    )
    assert settings.database_url == f"sqlite:///{tmp_path / 'freight.db'}"
    return settings


def test_plain_ids_are_echoed_and_others_replaced(lone_settings: Settings) -> None:
    rt = Runtime(lone_settings)
    client = create_app(runtime=rt).test_client()
    for sent in ["abc", "0f6c1e2a-9b1d-4c55-8f0e-1b2c3d4e5f60", "trace.1:span-2_x", "a" * MAX_LENGTH]:
        assert client.get("/healthz", headers={"X-Request-Id": sent}).headers["X-Request-Id"] == sent
        assert client.get("/v1/nothing", headers={"x-request-id": sent}).headers.get_all("x-request-id") == [
            sent
        ]
    seen = set()
    for sent in [None, *REFUSED]:
        # as the server hands the header on: a WSGI string (werkzeug's client refuses a newline)
        environ = {} if sent is None else {"HTTP_X_REQUEST_ID": sent.encode().decode("latin-1")}
        response = client.get("/v1/files", environ_overrides=environ)  # 401: an error answered by the app
        assert response.status_code == 401
        [given] = response.headers.get_all("X-Request-Id")
        assert GENERATED.fullmatch(given), given
        seen.add(given)
    assert len(seen) == len(REFUSED) + 1  # a new one each time
    assert [accepted(s) for s in REFUSED] == [None] * len(REFUSED)
    rt.db.dispose()


def test_the_lines_logged_about_a_request_carry_its_id(lone_settings: Settings, json_logs) -> None:
    rt = Runtime(lone_settings)
    client = create_app(runtime=rt).test_client()
    before = current("request_id")  # None, unless an earlier test left a response unclosed
    sent = client.get("/readyz", headers={"X-Request-Id": "probe-7"})
    assert sent.status_code == 503 and sent.headers["X-Request-Id"] == "probe-7"
    assert current("request_id") == "probe-7"  # until the server has sent the body and closed it
    sent.close()
    assert current("request_id") == before  # the thread's next lines are no longer the request's
    generated = (
        create_app(runtime=rt).test_client().get("/readyz", environ_overrides={"HTTP_X_REQUEST_ID": 'x"}\n'})
    )
    assert generated.status_code == 503
    lines = [
        line for line in json_lines(json_logs.getvalue()) if line["message"].startswith("readiness: broker")
    ]
    assert [line["request_id"] for line in lines] == ["probe-7", generated.headers["X-Request-Id"]]
    assert all(line["level"] == "WARNING" and line["logger"] == "api.services.readiness" for line in lines)
    rt.db.dispose()


def wait_for(check, what: str, timeout: float, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if result := check():
            return result
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout}s\n{log.read_text(errors='replace')[-4000:]}")


def get(url: str, request_id: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"X-Request-Id": request_id} if request_id else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers["X-Request-Id"]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["X-Request-Id"]


def test_gunicorn_logs_json_lines_with_the_request_ids(lone_settings: Settings, tmp_path: Path) -> None:
    port = daemons.free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "FREIGHT_DATA_DIR": str(lone_settings.data_dir),
        "FREIGHT_BROKER_URL": lone_settings.broker_url,
        "FREIGHT_LOG_FORMAT": "json",
    }
    log = tmp_path / "api.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "api", "--port", str(port), "--workers", "1"],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(base + "/healthz"), "gunicorn answering", 30, proc, log)
        assert get(base + "/readyz", "from-client-1") == (503, "from-client-1")
        status, replaced = get(base + "/healthz", "no spaces please")
        assert status == 200 and GENERATED.fullmatch(replaced)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    text = log.read_text()
    lines = json_lines(text)  # every line, gunicorn's master's included
    assert "no spaces please" not in text
    access = {
        line["request_id"]: line
        for line in lines
        if line["logger"] == "gunicorn.access" and "request_id" in line
    }
    assert '"GET /readyz HTTP/1.1" 503' in access["from-client-1"]["message"]
    assert '"GET /healthz HTTP/1.1" 200' in access[replaced]["message"]
    [ready] = [line for line in lines if line["message"].startswith("readiness: broker")]
    assert ready["request_id"] == "from-client-1"
    assert any(line["logger"] == "gunicorn.error" and "Booting worker" in line["message"] for line in lines)


def _answers(url: str) -> bool:
    try:
        return get(url)[0] == 200
    except OSError:
        return False


def test_the_openapi_document_names_the_header_on_every_response(lone_settings: Settings) -> None:
    """Schemathesis (tests/api/test_schemathesis.py) then checks every response it gets has it."""
    document = create_app(lone_settings).test_client().get("/openapi.json").get_json()
    responses = [
        response
        for item in document["paths"].values()
        for operation in item.values()
        for response in operation["responses"].values()
    ]
    assert len(responses) > 50
    assert all(r["headers"]["x-request-id"] == {"$ref": "#/components/headers/RequestId"} for r in responses)
