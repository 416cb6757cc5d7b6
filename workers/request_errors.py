"""The error of a request Freight will not run, in OpenAI's shape (code, message, param).

Its own module so that what checks parts of a body (`workers.request_bodies`,
`workers.tool_calls`) raises one type without importing each other.
"""

from __future__ import annotations

from typing import Any

_MAX_MESSAGE_CHARS = 1000

# the one field of the body validation stores for a line it refused alone (a model not served
# here: ``workers.validation.RefusedLine``; a file id of no file of the tenant's:
# ``workers.media_files``): the line's error, raised by `request_bodies.parse_body` when the line
# runs, so it never reaches the engine. A tenant's own body holding this field fails validation as
# an unknown field of its endpoint, as any misspelt parameter does.
REFUSED_LINE = "x_freight_refused"


class RequestError(Exception):
    """A request the platform will not run, with an OpenAI-style error code and param."""

    def __init__(self, code: str, message: str, param: str | None = None, status_code: int = 400):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.status_code = status_code

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param}

    def __repr__(self) -> str:
        return f"RequestError(code={self.code!r}, param={self.param!r}, message={self.message!r})"


def clip_message(message: str) -> str:
    return message if len(message) <= _MAX_MESSAGE_CHARS else message[:_MAX_MESSAGE_CHARS] + "..."
