"""Lines of the output and error files, in OpenAI's batch output format.

Every input line ends in exactly one of the two files: a 200 response in the output file; a
request the engine refused (status 4xx/5xx with an error body) or one the batch stopped before
(``error`` set, ``response`` null) in the error file.
"""

from __future__ import annotations

from typing import Any

import msgspec

from storage.models import new_id

STOP_MESSAGES = {
    "batch_cancelled": "The batch was cancelled before this request ran.",
    "batch_expired": "The batch's completion window ended before this request ran.",
    "worker_failed": "The workers running this request died repeatedly; it was not retried again.",
}


def success_line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    request_id = new_id("req_")
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def request_error_line(custom_id: str, status_code: int, error: dict[str, Any]) -> dict[str, Any]:
    """The engine answered this request with an error (bad parameter, prompt too long, …)."""
    kind = "invalid_request_error" if 400 <= status_code < 500 else "server_error"
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {
            "status_code": status_code,
            "request_id": new_id("req_"),
            "body": {
                "error": {
                    "message": error.get("message", ""),
                    "type": kind,
                    "param": error.get("param"),
                    "code": error.get("code"),
                }
            },
        },
        "error": None,
    }


def stopped_line(custom_id: str, code: str) -> dict[str, Any]:
    """The request never ran: the batch was cancelled or expired, or its unit was given up."""
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": STOP_MESSAGES.get(code, code)},
    }


# statuses of an engine's answer that a later run may not repeat: a timeout, a rate limit
RETRYABLE_STATUSES = frozenset({408, 429})


def worth_retrying(line: dict[str, Any]) -> bool:
    """Whether a line of an error file is one a resume runs again (issue #48 part 3).

    Yes for a line that never ran (``stopped_line``: the batch was cancelled or expired, or its
    workers died: ``STOP_MESSAGES``) and for an engine error, timeout or rate limit (a response of
    status 5xx, 408 or 429). No for any other response (a 4xx ``request_error_line``: a bad
    parameter, a prompt too long, a model not served here): the same request would fail the same
    way. A line of another shape is retried: what is not known to be final is not left behind."""
    response = line.get("response")
    if not isinstance(response, dict):
        return True
    status = response.get("status_code")
    if not isinstance(status, int) or isinstance(status, bool):
        return True
    return status >= 500 or status in RETRYABLE_STATUSES


def encode(line: dict[str, Any]) -> bytes:
    """One line of a results file: compact JSON in UTF-8, keys in the dict's order.

    msgspec, not ``json.dumps``: every result line of every batch is encoded on the engine
    worker's loop thread, where ``json.dumps`` was about 3% of its samples on the request-rate
    workload; msgspec writes the same line some 15 times faster. What differs is spelling only:
    floats in their shortest exact form (``0.00001`` where json wrote ``1e-05``, both the same
    number), and a NaN or infinite float as ``null``, where json wrote ``NaN``, which is not JSON
    and which a strict reader of the file refuses.
    """
    return msgspec.json.encode(line) + b"\n"
