"""One error type for the HTTP layer, one JSON shape: OpenAI's ``{"error": {...}}``.

Services raise ``ServiceError``; views never build error responses by hand. Anything unexpected
still answers in the same shape (500, logged) so clients always get parseable JSON.
"""

from __future__ import annotations

import logging

from flask import Flask, jsonify
from werkzeug.exceptions import HTTPException

from storage.objectstore import ObjectStoreError

log = logging.getLogger(__name__)

STATUS = {
    "invalid_request": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "conflict": 409,
    "too_large": 413,
    "unavailable": 503,
}
TYPES = {401: "authentication_error", 404: "invalid_request_error", 503: "server_error"}


class ServiceError(Exception):
    """A request Freight refuses, with the reason in words a user can act on."""

    def __init__(self, kind: str, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code

    @property
    def status(self) -> int:
        return STATUS[self.kind]


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(ServiceError)
    def _service(exc: ServiceError):  # type: ignore[no-untyped-def]
        return jsonify(error_body(exc.status, exc.message, exc.param, exc.code)), exc.status

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException):  # type: ignore[no-untyped-def]
        status = exc.code or 500
        code = {404: "not_found", 405: "method_not_allowed", 413: "file_too_large"}.get(status)
        message = {
            404: "Unknown URL; see /v1 for the routes Freight serves.",
            413: "The request body is larger than this deployment accepts.",
        }.get(status, exc.description or exc.name)
        response = jsonify(error_body(status, message, None, code))
        if status == 405 and exc.get_headers():
            response.headers.update({k: v for k, v in exc.get_headers() if k.lower() == "allow"})
        return response, status

    @app.errorhandler(ObjectStoreError)
    def _store(exc: ObjectStoreError):  # type: ignore[no-untyped-def]
        log.error("object store unavailable: %s", exc)
        return jsonify(
            error_body(503, "The object store is unavailable; retry shortly.", None, "store_unavailable")
        ), 503

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):  # type: ignore[no-untyped-def]
        log.exception("unhandled error")
        return jsonify(error_body(500, "Internal error; it has been logged.", None, "internal_error")), 500
