"""Batch results as Parquet: the output and error JSONL files, one typed row per line.

Columns: ``custom_id``, ``id`` (the line's ``batch_req_…``), ``status_code`` (null for a request
that never ran), ``content`` (chat: the first choice's message; responses: the output messages'
text), ``text`` (completions: the first choice's text; transcriptions and translations: the body's
``text``), ``finish_reason`` (responses: the status),
``prompt_tokens``, ``cached_tokens``, ``completion_tokens`` (responses: input and output tokens), ``error_code``, ``error_message`` (from the response's error body, or the line's own ``error``),
and ``response_body``: the whole response body as JSON text (every choice, logprobs, …), so
nothing of the JSONL is lost. Written in record batches: memory is one batch, whatever the file.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from typing import IO, Any

import pyarrow as pa

from storage.embedding_tables import embeddings_body, write_embedding_results
from storage.parquet_records import write_records
from storage.score_tables import scores_body, write_score_results

RESULT_SCHEMA = pa.schema(
    [
        ("custom_id", pa.string()),
        ("id", pa.string()),
        ("status_code", pa.int32()),
        ("content", pa.string()),
        ("text", pa.string()),
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("cached_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("error_code", pa.string()),
        ("error_message", pa.string()),
        ("response_body", pa.string()),
    ]
)


def result_record(line: dict[str, Any]) -> dict[str, Any]:
    """One output/error line -> one row of RESULT_SCHEMA."""
    response = line.get("response") or {}
    body = response.get("body") if isinstance(response, dict) else None
    body = body if isinstance(body, dict) else {}
    choices = body.get("choices") or [{}]
    first = choices[0] if isinstance(choices[0], dict) else {}
    raw_message = first.get("message")
    message = raw_message if isinstance(raw_message, dict) else {}
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    raw_error = body.get("error")
    error = raw_error if isinstance(raw_error, dict) else line.get("error") or {}
    if body.get("object") == "response":  # a /v1/responses line's Response object
        return {**_response_record(body), **_line_fields(line, response, error, body)}
    return {
        **_line_fields(line, response, error, body),
        "content": message.get("content"),
        # a transcription's or translation's body has its text at the top, and no choices
        "text": first.get("text") if "choices" in body else _text_of(body),
        "finish_reason": first.get("finish_reason"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens") if usage else None,
        "completion_tokens": usage.get("completion_tokens"),
    }


def _response_record(body: dict[str, Any]) -> dict[str, Any]:
    """A Response object's columns: its output messages' text, its status (``incomplete`` when
    max_output_tokens cut it) and its usage under the chat column names."""
    texts = [
        part.get("text") or ""
        for item in body.get("output") or []
        if isinstance(item, dict) and item.get("type") == "message"
        for part in item.get("content") or []
        if isinstance(part, dict) and part.get("type") == "output_text"
    ]
    usage = body.get("usage") or {}
    return {
        "content": "".join(texts) if texts else None,
        "text": None,
        "finish_reason": body.get("status"),
        "prompt_tokens": usage.get("input_tokens"),
        "cached_tokens": (usage.get("input_tokens_details") or {}).get("cached_tokens"),
        "completion_tokens": usage.get("output_tokens"),
    }


def _text_of(body: dict[str, Any]) -> str | None:
    text = body.get("text")
    return text if isinstance(text, str) else None


def _line_fields(line: dict[str, Any], response: Any, error: dict, body: dict) -> dict[str, Any]:
    return {
        "custom_id": line.get("custom_id"),
        "id": line.get("id"),
        "status_code": response.get("status_code") if isinstance(response, dict) else None,
        "error_code": error.get("code"),
        "error_message": error.get("message"),
        "response_body": json.dumps(body, ensure_ascii=False, separators=(",", ":")) if body else None,
    }


def write_results(lines: Iterable[bytes], sink: IO[bytes] | str) -> int:
    """Result JSONL lines -> Parquet at ``sink``; returns the rows written. An embeddings output
    (its first line an embeddings response) is written a row per vector, the vector a float32 list
    column (``storage.embedding_tables``); a score or rerank output a row per score
    (``storage.score_tables``)."""
    decoded = (json.loads(raw) for raw in lines if raw.strip())
    head = list(itertools.islice(decoded, 1))
    if head and embeddings_body(head[0]) is not None:
        return write_embedding_results(itertools.chain(head, decoded), sink, RESULT_SCHEMA, result_record)
    if head and scores_body(head[0]) is not None:
        return write_score_results(itertools.chain(head, decoded), sink, RESULT_SCHEMA, result_record)
    return write_records(map(result_record, itertools.chain(head, decoded)), sink, RESULT_SCHEMA)
