"""Multipart uploads read as a stream: the file part goes to the object store as it arrives.

Werkzeug's form parser copies a file part into a temporary file before the view runs, so a 200 MB
upload is written to the API host's disk and read back before it reaches the store. Here the
request body is decoded chunk by chunk (werkzeug's sans-IO ``MultipartDecoder``) and the file part
is handed on as a readable stream; the service pipes it straight into ``put_stream``.

The fields before the file part (OpenAI's clients and ``curl -F purpose=… -F file=@…`` send
``purpose`` first) are known when the file starts. A form that puts the file first is still
served: the file is spooled (memory, then disk) while the rest of the form is read.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO

from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.http import parse_options_header
from werkzeug.sansio.multipart import NEED_DATA, Data, Epilogue, Field, File, MultipartDecoder

from storage.errors import ServiceError

READ_CHUNK = 64 * 1024  # bytes read from the request body at a time
FIELD_LIMIT = 64 * 1024  # bytes of all non-file fields together
MAX_PARTS = 64
SPOOL_IN_MEMORY = 1024 * 1024  # a file spooled because it came first stays in memory up to this


def _bad(message: str) -> ServiceError:
    return ServiceError("invalid_request", message, param="file")


def _events(body: IO[bytes], decoder: MultipartDecoder) -> Iterator[object]:
    """Decoder events, reading the body only when the decoder needs more."""
    ended = False
    while True:
        try:
            event = decoder.next_event()
        except (ValueError, RequestEntityTooLarge) as exc:
            raise _bad(f"malformed multipart body: {exc}") from exc
        if event is NEED_DATA:
            if ended:
                raise _bad("the multipart body ended before its closing boundary")
            chunk = body.read(READ_CHUNK)
            ended = not chunk
            decoder.receive_data(chunk or None)  # None: the body ended
            continue
        yield event
        if isinstance(event, Epilogue):
            return


class _PartReader:
    """``read()`` over the Data events of the current part; EOF at the part's end."""

    def __init__(self, form: UploadForm) -> None:
        self._form = form
        self._buffer = b""
        self._done = False

    def read(self, size: int = -1) -> bytes:
        want = READ_CHUNK if size is None or size < 0 else size
        if len(self._buffer) < want and not self._done:
            # joined once: ``+=`` per event copied a 1 MiB read 8 times over (64 KiB events)
            parts, have = [self._buffer], len(self._buffer)
            while have < want and not self._done:
                event = next(self._form._stream, None)
                if not isinstance(event, Data):
                    raise _bad("the multipart body ended inside the file part")
                parts.append(event.data)
                have += len(event.data)
                self._done = not event.more_data
            self._buffer = b"".join(parts)
        if len(self._buffer) <= want:
            out, self._buffer = self._buffer, b""
        else:
            out, self._buffer = self._buffer[:want], self._buffer[want:]
        return out


@dataclass
class UploadForm:
    """The form as far as it has been read: fields so far, and the file part as a stream."""

    _stream: Iterator[object]
    file_field: str = "file"  # the part that streams: /v1/files' ``file``, an upload part's ``data``
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    file: IO[bytes] | None = None
    _field_bytes: int = 0

    def _read_field(self, name: str) -> None:
        parts: list[bytes] = []
        for event in self._stream:
            if not isinstance(event, Data):
                raise _bad("malformed multipart body")
            self._field_bytes += len(event.data)
            if self._field_bytes > FIELD_LIMIT:
                raise _bad(f"form fields are larger than {FIELD_LIMIT} bytes")
            parts.append(event.data)
            if not event.more_data:
                break
        try:
            self.fields.setdefault(name, b"".join(parts).decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise _bad(f"form field {name!r} is not UTF-8") from exc

    def _skip_part(self) -> None:
        for event in self._stream:
            if isinstance(event, Data) and not event.more_data:
                return

    def _advance(self) -> None:
        """Read on to the file part (leaving its data unread) or to the end of the form. An upload
        part's ``data`` streams even when it comes without a filename (a plain field)."""
        for event in self._stream:
            named = isinstance(event, (File, Field)) and event.name == self.file_field
            if named and self.file is None and (isinstance(event, File) or self.file_field != "file"):
                self.filename = getattr(event, "filename", None)
                self.file = _PartReader(self)  # type: ignore[assignment]
                return
            if isinstance(event, Field):
                self._read_field(event.name)
            elif isinstance(event, File):
                self._skip_part()  # another file field: OpenAI's API has none

    def spool(self, limit: int) -> None:
        """Copy the rest of the file part aside, then read the fields after it (file-first forms)."""
        if self.file is None:
            return
        spooled = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY)  # noqa: SIM115 (becomes self.file)
        total = 0
        while chunk := self.file.read(READ_CHUNK):
            total += len(chunk)
            if total > limit:
                spooled.close()
                raise ServiceError(
                    "too_large",
                    f"file is larger than the {limit} byte limit",
                    param="file",
                    code="file_too_large",
                )
            spooled.write(chunk)
        spooled.seek(0)
        self.file = spooled
        self.finish()

    def finish(self) -> None:
        """Read the rest of the body: fields after the file part are kept, other parts skipped."""
        if isinstance(self.file, _PartReader):
            while self.file.read(READ_CHUNK):
                pass
        for event in self._stream:
            if isinstance(event, Field):
                self._read_field(event.name)
            elif isinstance(event, File):
                self._skip_part()


def open_upload(body: IO[bytes], content_type: str | None, file_field: str = "file") -> UploadForm:
    """Start reading a ``multipart/form-data`` body: returns once the part ``file_field`` starts
    (or the form ends without one)."""
    mimetype, options = parse_options_header(content_type or "")
    if mimetype != "multipart/form-data" or not options.get("boundary"):
        raise ServiceError(
            "invalid_request",
            f"uploads must be multipart/form-data with a '{file_field}' part",
            param=file_field,
        )
    # fields are bounded by FIELD_LIMIT as they are read; the decoder buffers one chunk at a time
    decoder = MultipartDecoder(options["boundary"].encode("latin-1"), None, max_parts=MAX_PARTS)
    form = UploadForm(_events(body, decoder), file_field)
    form._advance()
    return form
