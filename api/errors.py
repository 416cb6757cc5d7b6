"""The HTTP face of errors, one JSON shape: OpenAI's ``{"error": {...}}``.

Services raise ``storage.errors.ServiceError``; this maps its kind to a status code, and views never
build error responses by hand. Anything unexpected
still answers in the same shape (500, logged) so clients always get parseable JSON.
"""

from __future__ import annotations

import logging

from flask import Flask, Response, jsonify, request
from kombu.exceptions import OperationalError as KombuOperationalError
from sqlalchemy.exc import DBAPIError, OperationalError
from werkzeug.exceptions import HTTPException

from storage.errors import ServiceError
from storage.objectstore import ObjectStoreError

log = logging.getLogger(__name__)

STATUS = {
    "invalid_request": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "conflict": 409,
    "too_large": 413,
    "rate_limited": 429,
    "unavailable": 503,
}
DB_RETRY_AFTER_SECONDS = 2  # a database restart takes seconds; clients retry after this
TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "requests", 503: "server_error"}
# routes whose body is a file: they take up to FREIGHT_MAX_FILE_BYTES, every other body is held to
# FREIGHT_MAX_JSON_BODY_BYTES
UPLOAD_ENDPOINTS = frozenset({"v1.upload_file", "console.upload_post"})
# an upload's part: a body of up to one part (64 MiB) and its multipart envelope, whatever the above
PART_ENDPOINT = "v1.add_upload_part"


def status_of(exc: ServiceError) -> int:
    return STATUS[exc.kind]


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(ServiceError)
    def _service(exc: ServiceError) -> tuple[Response, int]:
        status = status_of(exc)
        response = jsonify(error_body(status, exc.message, exc.param, exc.code))
        if exc.retry_after is not None:  # a 429's Retry-After: clients (openai's) wait, then retry
            response.headers["Retry-After"] = str(exc.retry_after)
        return response, status

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException) -> tuple[Response, int]:
        status = exc.code or 500
        too_large = "file_too_large" if request.endpoint in UPLOAD_ENDPOINTS else "request_too_large"
        too_large = "part_too_large" if request.endpoint == PART_ENDPOINT else too_large
        code = {404: "not_found", 405: "method_not_allowed", 413: too_large, 429: "rate_limit_exceeded"}.get(
            status
        )
        message = {
            404: "Unknown URL; see /v1 for the routes Freight serves.",
            413: "The request body is larger than this deployment accepts.",
        }.get(status, exc.description or exc.name)
        response = jsonify(error_body(status, message, None, code))
        if status == 405 and exc.get_headers():
            response.headers.update({k: v for k, v in exc.get_headers() if k.lower() == "allow"})
        return response, status

    def unavailable(what: str, code: str, exc: Exception) -> tuple[Response, int]:
        """A backing service is down or restarting: 503 with ``Retry-After``, so clients (the
        ``openai`` client among them) retry instead of failing."""
        log.error("%s unavailable: %s", what, exc)
        response = jsonify(error_body(503, f"The {what} is unavailable; retry shortly.", None, code))
        response.headers["Retry-After"] = str(DB_RETRY_AFTER_SECONDS)
        return response, 503

    @app.errorhandler(ObjectStoreError)
    def _store(exc: ObjectStoreError) -> tuple[Response, int]:
        return unavailable("object store", "store_unavailable", exc)

    @app.errorhandler(KombuOperationalError)
    @app.errorhandler(ConnectionError)
    def _broker(exc: Exception) -> tuple[Response, int]:
        return unavailable("job queue", "queue_unavailable", exc)

    @app.errorhandler(DBAPIError)
    def _database(exc: DBAPIError) -> tuple[Response, int]:
        if not (isinstance(exc, OperationalError) or exc.connection_invalidated):
            return _unexpected(exc)
        return unavailable("database", "service_unavailable", exc)  # down, restarting, or a cut connection

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> tuple[Response, int]:
        log.exception("unhandled error")
        return jsonify(error_body(500, "Internal error; it has been logged.", None, "internal_error")), 500
