"""Request size limits: OpenAI's metadata limits, a small cap on non-upload bodies, the upload cap,
and bodies cut off while streaming (declared too large, longer than declared, or chunked without
a length), always with the layer's own error body, never read whole.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
from werkzeug.test import EnvironBuilder, run_wsgi_app

from api.services.tenants import create_tenant
from tests.conftest import now
from tests.factories import OMIT, chat_line, http_upload, jsonl

BOUNDARY = "freight-size-limits"
LINE = jsonl([chat_line("r", max_tokens=OMIT)])

pytestmark = pytest.mark.reliability  # every test adds to the size_limits figures


class Endless(io.RawIOBase):
    """A request body of ``size`` bytes made on demand (``head``, then filler), counting what the
    server actually read."""

    def __init__(self, head: bytes, size: int, filler: bytes = LINE) -> None:
        self.head, self.size, self.filler, self.served = head, size, filler, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.size - self.served)
        if n <= 0:
            return 0
        data = (self.head + self.filler * (n // len(self.filler) + 2))[: n] if self.served == 0 else (self.filler * (n // len(self.filler) + 2))[:n]  # fmt: skip
        buffer[:n] = data
        self.served += n
        return n


def multipart_head(name: str = "big.jsonl") -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()


def raw_request(app, path: str, body: io.RawIOBase, content_type: str, length: int | None, headers: dict):
    """A request whose body is ``body`` as is: ``length`` declared, or chunked (no length) as
    gunicorn hands it on (``wsgi.input_terminated``)."""
    environ = EnvironBuilder(
        path=path, method="POST", headers=headers, content_type=content_type
    ).get_environ()
    environ.pop("CONTENT_LENGTH", None)
    environ["wsgi.input"] = body
    if length is None:
        environ["wsgi.input_terminated"] = True
        environ["HTTP_TRANSFER_ENCODING"] = "chunked"
    else:
        environ["CONTENT_LENGTH"] = str(length)
    body_iter, status, response_headers = run_wsgi_app(app, environ, buffered=True)
    return app.response_class(body_iter, status=status, headers=response_headers)


@pytest.fixture
def key(runtime) -> dict[str, str]:
    _, k = create_tenant(runtime.db, "alpha", now())
    return {"Authorization": f"Bearer {k}"}


def uploaded_id(app, key) -> str:
    response = http_upload(app.test_client(), key, LINE)
    return response.get_json()["id"]


def assert_error(response, status: int, code: str | None = None, param: str | None = None) -> None:
    assert response.status_code == status, response.get_data(as_text=True)[:300]
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code:
        assert error["code"] == code
    if param:
        assert error["param"] == param


class Cases:
    def __init__(self) -> None:
        self.n = 0
        self.server_errors = 0

    def __call__(self, response):
        self.n += 1
        self.server_errors += response.status_code >= 500
        return response


@pytest.fixture(scope="module")
def tally(reliability) -> Iterator[Cases]:
    """Counts every response of the module; its figures are recorded once the module's tests ran."""
    cases = Cases()
    yield cases
    if cases.n:
        reliability.record(
            "size_limits", lost=0, duplicated=0, server_errors=cases.server_errors, cases=cases.n
        )


def batch_body(file_id: str, metadata: object) -> dict:
    return {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "metadata": metadata}


METADATA_CASES = [
    ({f"k{i}": "v" for i in range(17)}, 400),
    ({"k" * 65: "v"}, 400),
    ({"k": "v" * 513}, 400),
    ({"k": 5}, 400),
    ({"k": None}, 400),
    ("a string", 400),
    ({"k": "nul\x00inside"}, 400),
    ({f"k{i:02d}" + "x" * 60: "é" * 512 for i in range(16)}, 200),  # the limits exactly, in characters
    ({"k": "🚚" * 512}, 200),
]


@pytest.mark.parametrize(("metadata", "status"), METADATA_CASES)
def test_metadata_follows_openais_limits(app, key, tally, metadata, status) -> None:
    response = tally(app.test_client().post("/v1/batches", headers=key, json=batch_body(uploaded_id(app, key), metadata)))  # fmt: skip
    if status == 200:
        assert response.status_code == 200 and response.get_json()["metadata"] == metadata
    else:
        assert_error(response, 400)
        assert response.get_json()["error"]["param"].startswith("metadata")


def test_json_bodies_have_a_small_limit_streamed_or_declared(app, key, runtime, tally) -> None:
    limit = runtime.settings.max_json_body_bytes
    assert limit == 1024 * 1024  # the default
    huge = json.dumps(batch_body(uploaded_id(app, key), {"k": "v" * (3 * limit)})).encode()
    declared = tally(
        app.test_client().post("/v1/batches", headers=key, data=huge, content_type="application/json")
    )
    assert_error(declared, 413, code="request_too_large")
    assert declared.get_json()["error"]["type"] == "invalid_request_error"
    # declared too large: refused before a byte is read
    body = Endless(b'{"metadata": "', 64 * limit)
    refused = tally(raw_request(app, "/v1/batches", body, "application/json", 64 * limit, key))
    assert_error(refused, 413, code="request_too_large")
    assert body.served == 0
    # chunked, no length: cut off at the limit while streaming
    body = Endless(b'{"metadata": "', 64 * limit)
    cut = tally(raw_request(app, "/v1/batches", body, "application/json", None, key))
    assert_error(cut, 413, code="request_too_large")
    assert limit <= body.served <= limit + 64 * 1024
    # a form (console sign-in) is held to the same limit, with the console's HTML error page
    sign_in = tally(app.test_client().post("/console/sign-in", data={"api_key": "k" * (2 * limit)}))
    assert sign_in.status_code == 413 and sign_in.mimetype == "text/html"


def test_uploads_are_cut_off_at_the_limit_and_leave_nothing(app, key, runtime, tally) -> None:
    store, limit = runtime.store, runtime.settings.max_file_bytes
    envelope_limit = app.config["MAX_CONTENT_LENGTH"]
    content_type = f"multipart/form-data; boundary={BOUNDARY}"
    # over the file limit but inside the request limit: the store refuses it while streaming
    over = tally(app.test_client().post(
        "/v1/files", headers=key, content_type="multipart/form-data",
        data={"purpose": "batch", "file": (io.BytesIO(LINE * (limit // len(LINE) + 10)), "big.jsonl")},
    ))  # fmt: skip
    assert_error(over, 413, code="file_too_large", param="file")
    # a declared length over the request limit: refused unread
    body = Endless(multipart_head(), 8 * envelope_limit)
    declared = tally(raw_request(app, "/v1/files", body, content_type, 8 * envelope_limit, key))
    assert_error(declared, 413, code="file_too_large")
    assert body.served == 0
    # chunked without a length, far over the limit: read up to the limit, then refused
    body = Endless(multipart_head(), 64 * envelope_limit)
    chunked = tally(raw_request(app, "/v1/files", body, content_type, None, key))
    assert_error(chunked, 413, code="file_too_large")
    assert body.served <= envelope_limit + 64 * 1024
    # a body longer than its declared length: only the declared bytes are read (a cut multipart)
    body = Endless(multipart_head(), 4 * limit)
    longer = tally(raw_request(app, "/v1/files", body, content_type, 1000, key))
    assert 400 <= longer.status_code < 500 and body.served <= 1000 + 64 * 1024
    # the console's upload form: the same limit, its own HTML page
    console = tally(raw_request(app, "/console/upload", Endless(multipart_head(), 64 * envelope_limit), content_type, None, {}))  # fmt: skip
    assert console.status_code in (302, 413)  # not signed in: the sign-in redirect may come first
    assert (
        list(store.list("files/")) == []
        and app.test_client().get("/v1/files", headers=key).get_json()["data"] == []
    )
