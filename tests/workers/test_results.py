"""The error lines a resume runs again (``workers.results.worth_retrying``, issue #48 part 3),
over the lines the engine worker and finalization write."""

from __future__ import annotations

import json

import pytest

from workers.results import encode, request_error_line, stopped_line, success_line, worth_retrying


def line(raw: bytes) -> dict:
    return json.loads(raw)


@pytest.mark.parametrize("code", ["batch_cancelled", "batch_expired", "worker_failed"])
def test_a_line_that_never_ran_is_worth_retrying(code: str) -> None:
    assert worth_retrying(line(encode(stopped_line("r-1", code))))


@pytest.mark.parametrize(("status", "retried"), [(500, True), (503, True), (408, True), (429, True),
                                                 (400, False), (404, False), (413, False), (422, False)])  # fmt: skip
def test_engine_errors_and_timeouts_are_retried_and_request_errors_are_not(
    status: int, retried: bool
) -> None:
    error = request_error_line("r-1", status, {"message": "m", "code": "c"})
    assert worth_retrying(line(encode(error))) is retried


def test_a_refused_model_line_is_not_retried() -> None:
    """A line naming a model not served here runs as its 400 model_not_found: the same again."""
    error = request_error_line("r-1", 400, {"message": "no such model", "code": "model_not_found"})
    assert not worth_retrying(error)


def test_a_line_of_an_unknown_shape_is_retried_rather_than_lost() -> None:
    assert worth_retrying({"custom_id": "r-1", "response": {"status_code": "500"}})
    assert worth_retrying({"custom_id": "r-1"})
    assert not worth_retrying(success_line("r-1", {"ok": 1}))  # never in an error file: a 200 is kept


def test_a_result_line_is_strict_json_in_utf8_with_its_id_and_custom_id_first() -> None:
    body = {
        "choices": [{"message": {"content": 'héllo \u2028 "q" \\ \x01', "role": "assistant"}}],
        "logprob": -1e-05,
        "big": 1e16,
        "nan": float("nan"),
        "inf": float("-inf"),
        "usage": {"prompt_tokens": 3},
    }
    raw = encode(success_line("c-1", body))
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1  # one line, whatever the text holds
    assert raw.startswith(b'{"id":"batch_req_') and b',"custom_id":"c-1",' in raw[:80]
    assert "héllo".encode() in raw  # UTF-8 as is, not \\u escapes
    # strict JSON: NaN and infinities (not JSON) are written as null, every other value exactly
    decoded = json.loads(raw, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    got = decoded["response"]["body"]
    assert got["nan"] is None and got["inf"] is None
    assert {k: got[k] for k in ("choices", "logprob", "big", "usage")} == {
        k: body[k] for k in ("choices", "logprob", "big", "usage")
    }
