"""``Idempotency-Key`` through the real API process (gunicorn, as ``freight api`` serves it) on
SQLite and PostgreSQL: the official ``openai`` client's creates with ``extra_headers`` retried;
a create whose answer is lost (the client sends it whole and closes the connection unread, the
create commits) retried with its key answers the same object; a create whose API process was
SIGKILLed between its commit and its answer's record, retried by the official client, answers
the same object; creates racing with one key make one object. No worker runs: only the API is on
these paths."""

from __future__ import annotations

import io
import socket
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from openai import ConflictError, OpenAI
from sqlalchemy import func, select

from api.services.tenants import create_tenant
from storage.models import Batch, IdempotencyKey, StoredFile
from storage.settings import Settings
from tests.api_process import api_env, api_process
from tests.conftest import now
from tests.factories import chat_line, jsonl

CHAT = "/v1/chat/completions"


@pytest.fixture
def api_url(settings: Settings, tmp_path: Path) -> Iterator[str]:
    """``freight api`` (gunicorn, one worker of four threads) on the test's database and store."""
    with api_process(api_env(settings), tmp_path) as (url, _):
        yield url


# gunicorn reads ./gunicorn.conf.py: in its worker, the record of a create's answer kills the
# worker (SIGKILL, as the OOM killer or a host's loss would) the first time for each key
DIE_AT_THE_ANSWER = """
import os
import signal

MARKERS = {markers!r}


def post_worker_init(worker):
    from storage import idempotency

    record = idempotency.complete

    def die_once(db, tenant_id, key, *args):
        marker = os.path.join(MARKERS, key)
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return record(db, tenant_id, key, *args)

    idempotency.complete = die_once
"""


@pytest.fixture
def killed_api(request, settings: Settings, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``freight api`` whose worker process is SIGKILLed once per key after a create committed,
    before its answer is recorded (gunicorn starts another), on the store its test's parameter
    names (local or s3); and the folder naming each key whose request it killed."""
    markers = tmp_path / "killed"
    markers.mkdir()
    (tmp_path / "gunicorn.conf.py").write_text(
        textwrap.dedent(DIE_AT_THE_ANSWER.format(markers=str(markers)))
    )
    store: dict[str, str] = {}
    if request.param == "s3":
        s3 = request.getfixturevalue("s3_service")
        bucket = s3.create_bucket(f"k-{uuid.uuid4().hex[:10]}")
        store = {
            "FREIGHT_OBJECT_STORE_URL": f"s3://{bucket}/freight",
            "FREIGHT_S3_ENDPOINT_URL": s3.endpoint_url,
            "AWS_ACCESS_KEY_ID": s3.access_key,
            "AWS_SECRET_ACCESS_KEY": s3.secret_key,
            "AWS_DEFAULT_REGION": s3.region,
        }
    with api_process(api_env(settings, store), tmp_path) as (url, _):
        yield url, markers


@pytest.fixture
def key(runtime) -> str:
    return create_tenant(runtime.db, "alpha", now())[1]


def count(runtime, model) -> int:
    with runtime.db.read() as s:
        return int(s.scalar(select(func.count()).select_from(model)) or 0)


def answered(runtime, idempotency_key: str) -> bool:
    """Whether the key's request has run to its answer (the API records it once it has one)."""
    with runtime.db.read() as s:
        return s.scalar(select(IdempotencyKey.status).where(IdempotencyKey.key == idempotency_key)) == "done"


def send_and_hang_up(url: str, request: httpx.Request) -> None:
    """Send ``request`` whole on a socket of its own and close it without reading a byte of the
    answer: the client's view of a create whose answer was lost."""
    parts = urlsplit(url)
    head = [f"{request.method} {request.url.raw_path.decode()} HTTP/1.1", f"Host: {parts.netloc}"]
    head += [f"{name}: {value}" for name, value in request.headers.items() if name.lower() != "host"]
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + request.read())
        sock.shutdown(socket.SHUT_WR)
    # closed: whatever the API answers goes nowhere


def test_the_official_clients_creates_with_a_key_are_made_once(api_url, key, runtime):
    client = OpenAI(base_url=api_url + "/v1", api_key=key, max_retries=2, timeout=30)
    data = jsonl([chat_line("a"), chat_line("b")])
    files = [
        client.files.create(
            file=("in.jsonl", io.BytesIO(data)), purpose="batch", extra_headers={"Idempotency-Key": "file-1"}
        )
        for _ in range(2)
    ]
    assert files[0].id == files[1].id and files[0] == files[1] and count(runtime, StoredFile) == 1
    batches = [
        client.batches.create(
            input_file_id=files[0].id, endpoint=CHAT, completion_window="24h",
            metadata={"job": "nightly"}, extra_headers={"Idempotency-Key": "batch-1"},
        )
        for _ in range(2)
    ]  # fmt: skip
    assert batches[0].id == batches[1].id and batches[0] == batches[1] and count(runtime, Batch) == 1
    assert [b.id for b in client.batches.list()] == [batches[0].id]
    with pytest.raises(ConflictError) as refused:  # the key with another request: a 409, and no batch
        client.with_options(max_retries=0).batches.create(
            input_file_id=files[0].id, endpoint=CHAT, completion_window="1h",
            extra_headers={"Idempotency-Key": "batch-1"},
        )  # fmt: skip
    assert refused.value.code == "idempotency_key_reused" and "batch-1" in refused.value.message
    assert count(runtime, Batch) == 1


def test_a_create_whose_answer_was_lost_answers_the_same_object_on_retry(api_url, key, runtime):
    auth = {"Authorization": f"Bearer {key}"}
    data = jsonl([chat_line("a")])

    def upload() -> httpx.Request:  # a new multipart boundary each time, as every client draws one
        return httpx.Request(
            "POST", api_url + "/v1/files", headers={**auth, "Idempotency-Key": "lost-file"},
            data={"purpose": "batch"}, files={"file": ("in.jsonl", data, "application/jsonl")},
        )  # fmt: skip

    send_and_hang_up(api_url, upload())
    deadline = time.monotonic() + 30
    while not answered(runtime, "lost-file"):
        assert time.monotonic() < deadline, "the lost upload never ran"
        time.sleep(0.05)
    assert count(runtime, StoredFile) == 1  # made, and the client never heard of it
    with httpx.Client(timeout=30) as http:
        retried = http.send(upload())
        assert retried.status_code == 200 and retried.headers["Idempotent-Replayed"] == "true"
        with runtime.db.read() as s:
            assert retried.json()["id"] == s.scalar(select(StoredFile.id))
        file_id = retried.json()["id"]
        create = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
        send_and_hang_up(
            api_url,
            httpx.Request(
                "POST",
                api_url + "/v1/batches",
                headers={**auth, "Idempotency-Key": "lost-batch"},
                json=create,
            ),
        )
        deadline = time.monotonic() + 30
        while not answered(runtime, "lost-batch"):
            assert time.monotonic() < deadline, "the lost create never ran"
            time.sleep(0.05)
    client = OpenAI(base_url=api_url + "/v1", api_key=key, max_retries=2, timeout=30)
    batch = client.batches.create(**create, extra_headers={"Idempotency-Key": "lost-batch"})
    with runtime.db.read() as s:
        assert list(s.scalars(select(Batch.id))) == [batch.id]
    assert batch.input_file_id == file_id and count(runtime, StoredFile) == 1


# the api_kill_after_commit scenario's figures, both databases' (each run records the whole so far)
KILLED: dict[str, dict[str, float]] = {}


def record_killed_creates(reliability, database: str, **figures: float) -> None:
    """Add one database's run to the scenario's record: lost counts a create that left no object,
    duplicated one that left more than one."""
    KILLED[database] = figures
    runs = KILLED.values()
    reliability.record(
        "api_kill_after_commit",
        lost=int(sum(max(0, 1 - r["files"]) + max(0, 1 - r["batches"]) for r in runs)),
        duplicated=int(sum(max(0, r["files"] - 1) + max(0, r["batches"] - 1) for r in runs)),
        server_errors=int(sum(r["server_errors"] for r in runs)),
        databases=list(KILLED),
        creates_s={db: r["creates_s"] for db, r in KILLED.items()},
        killed_workers=int(sum(r["killed_workers"] for r in runs)),
        replayed=int(sum(r["replayed"] for r in runs)),
    )


# each database and each store once: the stores are on the path of the file's upload only
@pytest.mark.reliability
@pytest.mark.parametrize(
    ("database_url", "killed_api"), [("sqlite", "local"), ("postgresql", "s3")], indirect=True
)
def test_creates_whose_api_process_was_killed_after_the_commit_are_made_once(
    killed_api, key, runtime, reliability
):
    url, killed = killed_api
    client = OpenAI(base_url=url + "/v1", api_key=key, max_retries=2, timeout=30)
    data = jsonl([chat_line("a"), chat_line("b")])
    started = time.monotonic()
    # the client's first attempt loses its connection with the process; its retry, same key, is
    # answered by the process gunicorn started in its place
    sent = client.files.with_raw_response.create(
        file=("in.jsonl", io.BytesIO(data)), purpose="batch", extra_headers={"Idempotency-Key": "file-k"}
    )
    assert (killed / "file-k").exists() and sent.headers["Idempotent-Replayed"] == "true"
    file = sent.parse()
    with runtime.db.read() as s:
        assert list(s.scalars(select(StoredFile.id))) == [file.id]
        assert s.scalar(select(IdempotencyKey.status).where(IdempotencyKey.key == "file-k")) == "created"
    assert file.bytes == len(data) and client.files.content(file.id).read() == data
    create = {"input_file_id": file.id, "endpoint": CHAT, "completion_window": "24h"}
    made = client.batches.with_raw_response.create(**create, extra_headers={"Idempotency-Key": "batch-k"})
    creates_s = time.monotonic() - started
    record_killed_creates(
        reliability, runtime.settings.database_url.split(":")[0].split("+")[0],
        files=count(runtime, StoredFile), batches=count(runtime, Batch), creates_s=round(creates_s, 1),
        killed_workers=len(list(killed.iterdir())), server_errors=sum(r.status_code >= 500 for r in (sent, made)),
        replayed=sum(r.headers.get("Idempotent-Replayed") == "true" for r in (sent, made)),
    )  # fmt: skip
    assert (killed / "batch-k").exists() and made.headers["Idempotent-Replayed"] == "true"
    batch = made.parse()
    again = client.batches.create(**create, extra_headers={"Idempotency-Key": "batch-k"})
    assert again.id == batch.id and batch.input_file_id == file.id
    with runtime.db.read() as s:
        assert list(s.scalars(select(Batch.id))) == [batch.id]
        assert list(s.scalars(select(StoredFile.id))) == [file.id]
    assert "SIGKILL" in (Path(runtime.settings.data_dir) / "api.log").read_text()


def test_creates_racing_with_one_key_make_one_batch(api_url, key, runtime):
    auth = {"Authorization": f"Bearer {key}"}
    file_id = httpx.post(
        api_url + "/v1/files", headers=auth, data={"purpose": "batch"},
        files={"file": ("in.jsonl", jsonl([chat_line()]))}, timeout=30,
    ).json()["id"]  # fmt: skip
    create = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
    start = threading.Barrier(4)
    answers: list[httpx.Response] = []

    def post() -> None:
        start.wait()
        answers.append(
            httpx.post(
                api_url + "/v1/batches", headers={**auth, "Idempotency-Key": "race"}, json=create, timeout=30
            )
        )

    threads = [threading.Thread(target=post) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert count(runtime, Batch) == 1
    with runtime.db.read() as s:
        made = s.scalar(select(Batch.id))
    for answer in answers:
        assert answer.status_code in (200, 409), answer.text
        if answer.status_code == 200:
            assert answer.json()["id"] == made
        else:
            assert answer.json()["error"]["code"] == "idempotency_key_in_use"
    assert any(a.status_code == 200 for a in answers)
