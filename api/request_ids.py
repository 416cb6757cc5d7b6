"""``x-request-id``: every response carries one, and every line logged about the request carries it.

A client may send its own (to find its request in the operator's logs, or to follow one request
through its own proxies); the header is the client's to write, so it is taken only when it is
short and plain: 1 to 128 characters of letters, digits and ``. _ : -``. Anything else (too long,
a space, a newline that would start a forged log line, a quote that would end a JSON string early)
is not echoed or logged: the request gets a fresh id instead, as does one that sent none.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from storage.logs import set_current

HEADER = "X-Request-Id"
ENVIRON_KEY = "freight.request_id"  # the request's id in the WSGI environ (gunicorn's access line reads it)
MAX_LENGTH = 128
PATTERN = (
    rf"[A-Za-z0-9._:-]{{1,{MAX_LENGTH}}}"  # what a client's id must be, whole (the OpenAPI document's too)
)
_ACCEPTED = re.compile(PATTERN)


def accepted(sent: str | None) -> str | None:
    """The client's request id if it may be used as it is, else None."""
    if sent is None or _ACCEPTED.fullmatch(sent) is None:
        return None
    return sent


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


class RequestIds:
    """WSGI middleware, outermost: picks the request's id, puts it in the environ, in the log
    context (``storage.logs``) until the response is finished (its body sent too, which happens
    after this call returns), and in the response's headers in place of any the app set."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        request_id = accepted(environ.get("HTTP_X_REQUEST_ID")) or new_request_id()
        environ[ENVIRON_KEY] = request_id

        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            headers = [(k, v) for k, v in headers if k.lower() != HEADER.lower()]
            headers.append((HEADER, request_id))
            return start_response(status, headers, exc_info)

        # set back, not reset: the body may be sent, and closed, from another context than this
        previous = set_current("request_id", request_id)
        try:
            body = self.app(environ, start)
        except BaseException:
            set_current("request_id", previous)
            raise
        file_wrapper = environ.get("wsgi.file_wrapper")
        if isinstance(file_wrapper, type) and isinstance(body, file_wrapper):
            # the server sends a file it recognises with sendfile(): no log line comes of that
            set_current("request_id", previous)
            return body  # type: ignore[return-value]  # the server's own wrapper, sent as it is
        return _Finished(body, lambda: set_current("request_id", previous))


class _Finished:
    """The app's response body, with ``when_closed`` run once the server closes it."""

    def __init__(self, body: Iterable[bytes], when_closed: Callable[[], object]) -> None:
        self.body = body
        self.when_closed = when_closed

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.body)

    def close(self) -> None:
        try:
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
        finally:
            self.when_closed()
