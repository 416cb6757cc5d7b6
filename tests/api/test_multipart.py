"""The streaming multipart reader: the file part is handed on before the body is read."""

from __future__ import annotations

import io

import httpx
import pytest

from api.multipart import FIELD_LIMIT, READ_CHUNK, open_upload
from storage.errors import ServiceError


class CountingBody(io.BytesIO):
    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.consumed = 0

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.consumed += len(data)
        return data


def encode(files: dict, data: dict) -> tuple[bytes, str]:
    request = httpx.Request("POST", "http://freight.test/v1/files", files=files, data=data)
    return request.read(), request.headers["content-type"]


def raw(parts: list[tuple[str, str | None, bytes]], closing: bool = True) -> bytes:
    out = b""
    for name, filename, value in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--B\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"
    return out + (b"--B--\r\n" if closing else b"")


def test_purpose_first_hands_on_the_file_before_reading_the_body():
    payload = bytes(range(256)) * 40_000  # ~10 MB
    body, content_type = encode({"file": ("in.jsonl", payload)}, {"purpose": "batch"})
    stream = CountingBody(body)
    form = open_upload(stream, content_type)
    assert form.fields == {"purpose": "batch"} and form.filename == "in.jsonl"
    assert stream.consumed <= 2 * READ_CHUNK  # only the head of the body has been read
    got = b""
    while chunk := form.file.read(100_000):
        got += chunk
    form.finish()
    assert got == payload and stream.consumed == len(body)


def test_reads_of_any_size_give_exactly_that_many_bytes_across_the_decoders_events():
    """The object store reads 1 MiB at a time, the decoder gives events of about READ_CHUNK: a
    read gathers events and keeps what is past its size for the next one."""
    payload = bytes(range(251)) * 20_000  # ~5 MB: not a multiple of any read size below
    body, content_type = encode({"file": ("in.jsonl", payload)}, {"purpose": "batch"})
    form = open_upload(io.BytesIO(body), content_type)
    got: list[bytes] = []
    for size in (1, READ_CHUNK - 1, 3 * READ_CHUNK + 7, 1024 * 1024, 5, None, -1):
        chunk = form.file.read(size)
        assert len(chunk) == (READ_CHUNK if size is None or size < 0 else size)
        got.append(chunk)
    while chunk := form.file.read(1024 * 1024):
        got.append(chunk)
    assert form.file.read(10) == b""  # the part's end, and again
    form.finish()
    assert b"".join(got) == payload


def test_file_first_is_spooled_and_the_purpose_found_after_it():
    form = open_upload(io.BytesIO(raw([("file", "a.jsonl", b"{}\n"), ("purpose", None, b"batch")])),
                       "multipart/form-data; boundary=B")  # fmt: skip
    assert form.fields == {}
    form.spool(limit=100)
    assert form.fields == {"purpose": "batch"} and form.file.read() == b"{}\n"


def test_spooling_stops_at_the_limit():
    form = open_upload(io.BytesIO(raw([("file", "a.jsonl", b"x" * 500), ("purpose", None, b"batch")])),
                       "multipart/form-data; boundary=B")  # fmt: skip
    with pytest.raises(ServiceError) as caught:
        form.spool(limit=100)
    assert caught.value.code == "file_too_large"


def test_a_form_without_a_file_part_has_no_file():
    form = open_upload(io.BytesIO(raw([("purpose", None, b"batch")])), "multipart/form-data; boundary=B")
    assert form.file is None and form.fields == {"purpose": "batch"}


@pytest.mark.parametrize(
    "body, content_type",
    [
        (b"not multipart at all", "multipart/form-data; boundary=B"),
        (raw([("file", "a.jsonl", b"data")], closing=False), "multipart/form-data; boundary=B"),
        (raw([("purpose", None, b"batch")])[:20], "multipart/form-data; boundary=B"),
        (b"{}", "application/json"),
        (b"", "multipart/form-data"),
        (raw([("purpose", None, b"\xff\xfe")]), "multipart/form-data; boundary=B"),
        (raw([("note", None, b"n" * (FIELD_LIMIT + 1))]), "multipart/form-data; boundary=B"),
    ],
    ids=[
        "garbage",
        "unterminated",
        "truncated-head",
        "not-multipart",
        "no-boundary",
        "not-utf8",
        "huge-field",
    ],
)
def test_malformed_bodies_are_a_client_error(body, content_type):
    with pytest.raises(ServiceError) as caught:
        form = open_upload(io.BytesIO(body), content_type)
        if form.file is not None:
            while form.file.read(READ_CHUNK):
                pass
        form.finish()
    assert caught.value.kind == "invalid_request"
