"""Hostile names: file names, purposes, ids in URLs and drop-folder prefixes/keys made to climb out
of a folder, break a database column or spoof a listing. Each answers 4xx or is sanitized, never a
5xx, and every object lands under its store's root (local disk, and SeaweedFS S3).
"""

from __future__ import annotations

import io
import unicodedata
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.app import create_app
from api.errors import status_of
from api.services import dropfolders
from api.services.tenants import create_tenant
from scheduler.dropfolder_plan import ARCHIVE, FAILED, OUTBOX, inbox_name, moved_key, result_keys
from storage.objectstore import S3ObjectStore
from tests.conftest import now
from tests.factories import OMIT, chat_line, jsonl
from workers.intake import MAX_FILENAME

LINE = jsonl([chat_line("r", max_tokens=OMIT)])
FILENAMES = [
    "../../../../etc/passwd",
    "/etc/passwd",
    "..\\..\\windows\\system32\\config.jsonl",
    "C:\\Users\\x\\in.jsonl",
    "in\x00.jsonl",
    "in\x01\x1b[31mred\x7f\t.jsonl",
    "in\r\nContent-Type: text/html\r\n.jsonl",
    "\u202egnp.jsonl",  # right-to-left override: would show as "lnosj.png"
    "x" * 10_240 + ".jsonl",
    "ünïcødé 🚚 名前.jsonl",
    "..",
    ".",
    "",
    "files/../../escape.jsonl",
    "%2e%2e%2fescape.jsonl",
]
PURPOSES = ["batch\x00", "../batch", "x" * 10_000, "", "BATCH", "batch_output", "fine-tune", "\u202ebatch"]
ID_PATHS = [
    "/v1/files/..%2F..%2Fetc%2Fpasswd", "/v1/files/..", "/v1/files/%2e%2e", "/v1/files/file-%00",
    "/v1/files/file-x%00/content", "/v1/files/" + "a" * 10_240, "/v1/batches/..%2F..", "/v1/batches/%00",
    "/v1/batches/batch_%00/cancel", "/v1/batches/%E2%80%AE", "/v1/files/%ff%fe", "/v1/batches?after=..%2F..",
    "/v1/batches?after=%00", "/v1/files?purpose=%00", "/v1/files?after=" + "z" * 5000, "/v1/models/..%2F..%2Fetc",
    "/v1/models/%00", "/v1/files/%5C..%5C..%5Cwin.ini",
]  # fmt: skip

pytestmark = pytest.mark.reliability  # every test adds to the hostile_names figures


class Figures:
    def __init__(self) -> None:
        self.cases = 0
        self.server_errors = 0
        self.escaped = 0

    def saw(self, response) -> None:
        self.cases += 1
        self.server_errors += response.status_code >= 500


@pytest.fixture(scope="module")
def figures(reliability) -> Iterator[Figures]:
    """Counts every case of the module; its figures are recorded once the module's tests ran."""
    seen = Figures()
    yield seen
    if seen.cases:
        reliability.record(
            "hostile_names", lost=0, duplicated=0, server_errors=seen.server_errors,
            cases=seen.cases, escaped_root=seen.escaped,
        )  # fmt: skip


def upload(client, key: str, name: str, purpose: str = "batch"):
    return client.post(
        "/v1/files", headers={"Authorization": f"Bearer {key}"}, content_type="multipart/form-data",
        data={"purpose": purpose, "file": (io.BytesIO(LINE), name)},
    )  # fmt: skip


def assert_clean(name: str) -> None:
    assert name and len(name) <= MAX_FILENAME and name not in (".", "..")
    assert "/" not in name and "\\" not in name
    assert not any(unicodedata.category(c) == "Cc" or c == "\u202e" for c in name), repr(name)


def upload_all(runtime, figures: Figures) -> list[dict]:
    _, key = create_tenant(runtime.db, "alpha", now())
    client = create_app(runtime=runtime).test_client()
    made = []
    for name in FILENAMES:
        response = upload(client, key, name)
        figures.saw(response)
        if "\n" in name:  # breaks the multipart header itself: the part is not a file any more
            assert response.status_code == 400 and response.get_json()["error"]["param"] == "file"
            continue
        assert response.status_code == 200, (name[:40], response.get_data(as_text=True)[:200])
        record = response.get_json()
        assert_clean(record["filename"])
        fetched = client.get(f"/v1/files/{record['id']}/content", headers={"Authorization": f"Bearer {key}"})
        figures.saw(fetched)
        assert fetched.data == LINE and "filename=" in fetched.headers["Content-Disposition"]
        assert record["id"] in fetched.headers["Content-Disposition"]  # never the user's name in a header
        made.append(record)
    for purpose in PURPOSES:
        response = upload(client, key, "in.jsonl", purpose)
        figures.saw(response)
        assert response.status_code == 400 and response.get_json()["error"]["param"] == "purpose"
    return made


def test_hostile_file_names_on_the_local_store(runtime, figures) -> None:
    data_dir = Path(runtime.settings.data_dir)
    outside_before = {p.name for p in data_dir.parent.iterdir()}
    made = upload_all(runtime, figures)
    assert made[8]["filename"] == "ünïcødé 🚚 名前.jsonl"  # ordinary unicode is kept as is
    assert made[0]["filename"] == "passwd" and made[4]["filename"] == "in.jsonl"
    root = (data_dir / "objects").resolve()
    stored = [p for p in root.rglob("*") if p.is_file()]
    assert len(stored) == len(made)
    for path in stored:
        inside = path.resolve().is_relative_to(root)
        figures.escaped += not inside
        assert inside and path.parent.name != "" and path.name.startswith("file-")
    assert {p.name for p in data_dir.parent.iterdir()} == outside_before  # nothing landed beside the data dir


def test_hostile_file_names_on_s3_keep_keys_under_the_prefix(runtime, s3_service, figures) -> None:
    bucket = f"t-{uuid.uuid4().hex[:10]}"
    s3_service.create_bucket(bucket)
    client = s3_service.client()
    runtime.store = S3ObjectStore(bucket, "tenant-data/freight", client=client)
    made = upload_all(runtime, figures)
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket) for o in page.get("Contents", [])]  # fmt: skip
    assert len(keys) == len(made)
    for key in keys:
        inside = key.startswith("tenant-data/freight/files/") and ".." not in key.split("/")
        figures.escaped += not inside
        assert inside and "\x00" not in key, key


def test_hostile_ids_in_urls_answer_4xx(runtime, figures) -> None:
    _, key = create_tenant(runtime.db, "alpha", now())
    app = create_app(runtime=runtime)
    client = app.test_client()
    headers = {"Authorization": f"Bearer {key}"}
    for path in ID_PATHS:
        for method in ("GET", "DELETE", "POST"):
            response = client.open(path, method=method, headers=headers, json={})
            figures.saw(response)
            assert 400 <= response.status_code < 500, (
                method,
                path[:60],
                response.get_data(as_text=True)[:200],
            )
            assert set(response.get_json()["error"]) == {"message", "type", "param", "code"}
    for path in ("/console/jobs/..%2F..%2Fx", "/console/jobs/%00", "/console/jobs/batch_x/files/..%2F..", "/console/jobs?status=%00&model=%01"):  # fmt: skip
        response = client.get(path)
        figures.saw(response)
        assert response.status_code in (302, 400, 404), path
    batch = client.post("/v1/batches", headers=headers, json={"input_file_id": "../../file-x\x00", "endpoint": "/v1/chat/completions"})  # fmt: skip
    figures.saw(batch)
    assert batch.status_code in (400, 404)


def test_drop_folder_prefixes_and_keys_cannot_climb_out(runtime, figures) -> None:
    create_tenant(runtime.db, "alpha", now())
    for url in ("s3://bucket/../other", "s3://bucket/a/../../b", "s3://bucket/a/./b", "s3://bucket/a/b/..",
                "s3://bucket/a\x00b", "s3://bucket/a\nb", "s3://../x", "file:///etc", "s3://bucket/a?x=1"):  # fmt: skip
        figures.cases += 1
        with pytest.raises(dropfolders.ServiceError) as refused:
            dropfolders.add(runtime, url, "alpha", "/v1/chat/completions", now=now())
        assert status_of(refused.value) == 400, url
    assert dropfolders.list_folders(runtime) == []
    # inbox keys: only plain names one level under inbox/ become batches
    for key in ("inbox/../escape.jsonl", "inbox/../../x.jsonl", "inbox/a/../../b.jsonl", "inbox/..jsonl",
                "inbox/.jsonl", "inbox/\x00.jsonl", "inbox/sub/x.jsonl", "outbox/x.jsonl", "../inbox/x.jsonl"):  # fmt: skip
        figures.cases += 1
        assert inbox_name(key) is None, key
    # what is written back for a name that passed stays in its folders
    for key in ("inbox/.. .jsonl", "inbox/ü 🚚.jsonl.gz", "inbox/a..b.parquet"):
        name, _ = inbox_name(key)  # type: ignore[misc]
        written = [*vars(result_keys(name)).values(), moved_key(key, False), moved_key(key, True)]
        for target in written:
            figures.cases += 1
            inside = target.startswith((OUTBOX, ARCHIVE, FAILED)) and ".." not in target.split("/")
            inside = inside and target.count("/") == 1
            figures.escaped += not inside
            assert inside, target
