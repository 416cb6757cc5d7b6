"""`ServiceError`: a request Freight refuses, with the reason in words a user can act on.

Raised by the use cases of every layer above (intake, the API's services, the CLIs) and carried
without any HTTP in it: ``api.errors`` maps its ``kind`` to a status code and OpenAI's error body,
a CLI prints its message, a drop folder records it as the refusal of an inbox file.
"""

from __future__ import annotations

# what a refusal is about; ``api.errors.STATUS`` gives each its HTTP status
KINDS = frozenset(
    {
        "invalid_request",
        "unauthorized",
        "forbidden",
        "not_found",
        "conflict",
        "too_large",
        "rate_limited",
        "unavailable",
    }
)


class ServiceError(Exception):
    def __init__(
        self,
        kind: str,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,  # seconds: when asking again may succeed (a rate_limited one)
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown ServiceError kind {kind!r}")
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
