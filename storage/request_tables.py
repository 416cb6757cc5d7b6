"""Batch request files as Parquet: reading a user's Parquet input as OpenAI batch lines, and writing
an OpenAI JSONL input as Parquet (downloads, round trips).

Two input shapes, told apart by their columns:

* **OpenAI batch columns**: ``custom_id``, ``body`` (JSON text, or a struct), and optionally
  ``method`` and ``url`` (default ``POST`` and the batch's endpoint).
* **Simple**: ``custom_id`` and ``prompt`` (``/v1/completions``), ``messages`` (chat; a list of
  ``{role, content}`` structs or JSON text), ``input`` (``/v1/embeddings``: a string, a list of
  strings or of token ids), ``query`` (``/v1/rerank``, beside ``documents``) or ``queries``,
  ``text_1`` or ``data_1`` (``/v1/score``, beside their documents column), every other column
  being a body field of that name (``model``, ``max_tokens``, ``temperature``, ``documents``, …;
  nulls are left out). A chat file may add ``image`` (binary, or a URL string) or ``images`` (a
  list of them): each becomes an ``image_url`` part before the text of the row's last user message.
  A transcription or translation file has ``audio`` (binary: the audio file's bytes, or a string:
  a file id or a data URL), which becomes the body's ``file_url`` (bytes as a base64 ``data:`` URL,
  stored once per distinct content at validation: ``workers.media_files.AudioFiles``), or
  ``file_url`` itself, beside ``model``, ``language``, ``prompt``, ``response_format``, ….

Batch-level defaults (``defaults``) fill the body fields a row does not set, for both shapes: the
caller merges them from the file's Parquet key-value metadata ``freight.defaults`` (a JSON object)
and the batch's ``default_*`` metadata keys. A row that cannot become a line is a ``RowError``
naming the row (1-based) and the column. Reading streams record batches: memory is one batch.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from scheduler import json_text
from storage.parquet_limits import (
    LIST_VALUE_BYTES,
    DecodeLimits,
    batch_rows,
    dictionary_columns,
    list_values,
    page_refusal,
    row_sizes,
    slices,
)
from storage.parquet_records import WRITE_BYTES, record_bytes
from storage.settings import Settings

MAGIC = b"PAR1"
DEFAULTS_KEY = b"freight.defaults"
DEFAULT_PREFIX = "default_"  # batch metadata keys carrying defaults: default_model, default_max_tokens
READ_ROWS = 512
WRITE_ROWS = 4096
OPENAI_COLUMNS = frozenset({"custom_id", "method", "url", "body"})
JSON_TEXT_FIELDS = frozenset({"messages", "response_format", "structured_outputs", "logit_bias", "stop"})
CHAT = "/v1/chat/completions"
# a chat file's image columns (simple shape): binary images or URL strings, one or a list a row
IMAGE_COLUMNS = frozenset({"image", "images"})
# an audio file's column (simple shape): binary audio, or a file id or data URL string
AUDIO_COLUMN = "audio"
AUDIO_ENDPOINTS = ("/v1/audio/transcriptions", "/v1/audio/translations")
_AUDIO_MAGIC = (
    (b"fLaC", "audio/flac"),
    (b"OggS", "audio/ogg"),
    (b"ID3", "audio/mpeg"),
    (b"\xff\xfb", "audio/mpeg"),
    (b"FORM", "audio/aiff"),
)
_IMAGE_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF8", "image/gif"),
    (b"RIFF", "image/webp"),
)

REQUEST_SCHEMA = pa.schema(
    [("custom_id", pa.string()), ("method", pa.string()), ("url", pa.string()), ("body", pa.string())]
)


@dataclass(frozen=True)
class RowError:
    row: int
    code: str
    message: str
    column: str | None = None


def is_parquet(head: bytes) -> bool:
    return head[:4] == MAGIC


def metadata_defaults(metadata: Mapping[str, str] | None) -> dict[str, Any]:
    """``{"default_max_tokens": "64"}`` -> ``{"max_tokens": 64}`` (values are JSON when they parse)."""
    out: dict[str, Any] = {}
    for name, value in (metadata or {}).items():
        if name.startswith(DEFAULT_PREFIX) and len(name) > len(DEFAULT_PREFIX):
            try:
                out[name[len(DEFAULT_PREFIX) :]] = json_text.loads(value)
            except (TypeError, ValueError):  # past the depth or digit limits too: kept as text
                out[name[len(DEFAULT_PREFIX) :]] = value
    return out


def file_defaults(pf: pq.ParquetFile) -> dict[str, Any]:
    """The file's ``freight.defaults`` key-value metadata (ValueError if it is not a JSON object)."""
    raw = (pf.schema_arrow.metadata or {}).get(DEFAULTS_KEY)
    if raw is None:
        return {}
    value = json_text.loads(raw)  # ValueError for depth and digit limits too
    if not isinstance(value, dict):
        raise ValueError("freight.defaults must be a JSON object")
    return value


def decode_limits(settings: Settings) -> DecodeLimits:
    """A JSONL file's limits, for what a Parquet file decodes to."""
    return DecodeLimits(settings.max_requests_per_file, settings.max_line_bytes, settings.max_file_bytes)


# the simple shape's request columns, each with the endpoint it implies for a file not in a batch
SIMPLE_COLUMNS = {
    "audio": "/v1/audio/transcriptions",  # before prompt: an audio file may carry a prompt column
    "file_url": "/v1/audio/transcriptions",
    "messages": "/v1/chat/completions",
    "prompt": "/v1/completions",
    "input": "/v1/embeddings",
    "query": "/v1/rerank",
    "queries": "/v1/score",
    "text_1": "/v1/score",
    "data_1": "/v1/score",
}


def _shape(names: list[str]) -> str | None:
    if "body" in names:
        return "openai"
    if any(name in SIMPLE_COLUMNS for name in names):
        return "simple"
    return None


def column_of(param: str | None, columns: Iterable[str]) -> str | None:
    """The input column a validation error's ``param`` (``body.temperature``) comes from."""
    if not param:
        return None
    names = set(columns)
    if param in names:
        return param
    field = param.removeprefix("body.").split(".", 1)[0]
    if field in names:
        return field
    return "body" if param.startswith("body") and "body" in names else None


@dataclass
class ParquetChunk:
    """Row groups ``[start, stop)`` of a file, validated apart from the rest (a chunk of a large
    input, workers/validation_chunks.py): its rows are numbered from ``first_row + 1`` (the rows of
    the groups before it), and ``decoded`` is set to the bytes its rows decoded to, which the
    merge sums against the file's decoded limit."""

    start: int
    stop: int
    first_row: int
    decoded: int = 0


@dataclass
class _Opened:
    pf: pq.ParquetFile
    shape: str
    endpoint: str
    defaults: dict[str, Any]


def _open(
    source: IO[bytes] | str,
    endpoint: str | None,
    defaults: Mapping[str, Any] | None,
    limits: DecodeLimits | None,
) -> _Opened | RowError:
    """The file opened, or the refusal of the whole file (about its row 1 or the row a page
    header names): unreadable, wrong columns, list or page bombs."""
    try:
        columns = dictionary_columns(pq.ParquetFile(source).schema)
        # a local file is mapped, not read into buffers: a column chunk of big binary cells (audio,
        # images) is otherwise copied whole into Arrow's pool before its pages are decoded
        pf = pq.ParquetFile(source, read_dictionary=columns or None, memory_map=isinstance(source, str))
        merged = {**file_defaults(pf), **(defaults or {})}
    except (pa.ArrowException, OSError, ValueError) as exc:
        return RowError(1, "invalid_parquet", f"the file is not readable Parquet: {exc}"[:500])
    names = pf.schema_arrow.names
    shape = _shape(names)
    if "custom_id" not in names or shape is None:
        return RowError(
            1,
            "invalid_parquet_columns",
            "a Parquet batch file needs a custom_id column and either body (OpenAI batch columns) "
            f"or prompt / messages / input / query / queries / audio (simple shape); it has {', '.join(names)[:300]}",
        )
    if shape == "openai" and set(names) - OPENAI_COLUMNS:
        extra = ", ".join(sorted(set(names) - OPENAI_COLUMNS))[:200]
        return RowError(1, "invalid_parquet_columns", f"unknown column(s) beside body: {extra}", extra)
    if endpoint is None:  # a download's JSONL view: the batch's endpoint is not at hand
        endpoint = next((url for name, url in SIMPLE_COLUMNS.items() if name in names), "/v1/embeddings")
    opened = _Opened(pf, shape, endpoint, merged)
    if limits is None:
        return opened
    values = list_values(pf)
    if values * LIST_VALUE_BYTES > limits.max_total_bytes:
        return RowError(
            1,
            "file_too_large",
            f"the file's list columns hold {values} values: decoded, more than the "
            f"{limits.max_total_bytes} byte limit",
        )
    if isinstance(source, str):
        with open(source, "rb") as raw:
            refusal = page_refusal(raw, pf, limits)
    else:
        refusal = page_refusal(source, pf, limits)
    if refusal is not None:
        return RowError(refusal.row, refusal.code, refusal.message)
    return opened


def request_lines(
    source: IO[bytes] | str,
    endpoint: str | None,
    defaults: Mapping[str, Any] | None = None,
    limits: DecodeLimits | None = None,
    chunk: ParquetChunk | None = None,
) -> Iterator[bytes | RowError]:
    """One OpenAI batch line (JSON bytes, no newline) or RowError per row of a Parquet file.

    ``endpoint``: the batch's; None (a file not yet in a batch) infers it from the columns.
    ``limits``: what the file may decode to (storage/parquet_limits.py), checked on the page
    headers before anything is decompressed, then per record batch before its rows become Python
    objects; the first row past a file limit ends the lines. ``chunk`` (with ``limits``): only
    those row groups' rows, numbered as in the whole file."""
    opened = _open(source, endpoint, defaults, limits)
    if isinstance(opened, RowError):
        yield opened
        return
    pf, shape, endpoint, merged = opened.pf, opened.shape, opened.endpoint, opened.defaults
    if limits is None:
        row = 0
        for batch in group_batches(pf, READ_ROWS):
            for record in batch.to_pylist():
                row += 1
                yield _line(record, row, shape, endpoint, merged)
        return
    yield from _limited_lines(pf, shape, endpoint, merged, limits, chunk)


def group_batches(
    pf: pq.ParquetFile, rows: int, groups: Iterable[int] | None = None
) -> Iterator[pa.RecordBatch]:
    """Record batches of at most ``rows`` rows, none across two row groups (``groups``: those
    only, in order; None: all). Strings are read as dictionaries (``_open``), and each row group
    has dictionaries of its own: a batch across two would hold two, which pyarrow cannot return
    for a nested column ("Nested data conversions not implemented for chunked array outputs"), so
    a file of several row groups with a list-of-struct column (chat ``messages``) stopped at the
    first batch that crossed one."""
    for group in range(pf.metadata.num_row_groups) if groups is None else groups:
        yield from pf.iter_batches(batch_size=rows, row_groups=[group])


def row_group_runs(
    path: str, endpoint: str, limits: DecodeLimits, target_bytes: int
) -> list[tuple[int, int]] | None:
    """The file's row groups cut into runs ``[start, stop)`` of about ``target_bytes`` stored
    bytes each, to validate apart; None when it is refused as a whole or has more rows than the
    limit (the one-task validation reports that) or is a single run."""
    opened = _open(path, endpoint, None, limits)
    if isinstance(opened, RowError):
        return None
    meta = opened.pf.metadata
    if meta.num_rows > limits.max_rows:  # refused at the row limit, where a record batch ends:
        return None  # batches run across row groups, so only the whole file's say where
    runs: list[tuple[int, int]] = []
    start = size = 0
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        size += sum(group.column(c).total_compressed_size for c in range(group.num_columns))
        if size >= target_bytes:
            runs.append((start, i + 1))
            start, size = i + 1, 0
    if start < meta.num_row_groups:
        runs.append((start, meta.num_row_groups))
    return runs if len(runs) > 1 else None


def first_rows(path: str, runs: Iterable[tuple[int, int]]) -> list[int]:
    """The rows before each run (a chunk's rows are numbered from there)."""
    meta = pq.ParquetFile(path).metadata
    before = [0]
    for i in range(meta.num_row_groups):
        before.append(before[-1] + meta.row_group(i).num_rows)
    return [before[start] for start, _ in runs]


def _limited_lines(
    pf: pq.ParquetFile,
    shape: str,
    endpoint: str,
    defaults: Mapping[str, Any],
    limits: DecodeLimits,
    chunk: ParquetChunk | None = None,
) -> Iterator[bytes | RowError]:
    row = chunk.first_row if chunk else 0  # rows read (before the chunk's own: its first row's)
    total = 0  # their decoded bytes (a chunk's own; the merge sums them)
    groups = None if chunk is None else list(range(chunk.start, chunk.stop))
    try:
        for batch in group_batches(pf, batch_rows(pf, READ_ROWS), groups):
            sizes = sum((row_sizes(column) for column in batch.columns), np.zeros(batch.num_rows, np.int64))
            for start, end in slices(sizes, alone=limits.max_line_bytes):
                if row + (end - start) > limits.max_rows:
                    yield RowError(
                        limits.max_rows + 1,
                        "too_many_requests",
                        f"the file has more than {limits.max_rows} requests",
                    )
                    return
                total += int(sizes[start:end].sum())  # rows too large count too, as a JSONL file's lines
                if (
                    end - start == 1
                    and sizes[start] > limits.max_line_bytes
                    and total <= limits.max_total_bytes
                ):
                    row += 1  # never made an object
                    yield RowError(
                        row,
                        "line_too_large",
                        f"row {row} is {sizes[start]} bytes decoded; the limit is {limits.max_line_bytes}",
                    )
                    continue
                if total > limits.max_total_bytes:
                    yield RowError(
                        row + 1,
                        "file_too_large",
                        f"decoded, the file is larger than the {limits.max_total_bytes} byte limit "
                        f"(by row {row + (end - start)})",
                    )
                    return
                for record in batch.slice(start, end - start).to_pylist():
                    row += 1
                    yield _line(record, row, shape, endpoint, defaults)
    finally:
        if chunk is not None:
            chunk.decoded = total


def _line(
    record: dict[str, Any], row: int, shape: str, endpoint: str, defaults: Mapping[str, Any]
) -> bytes | RowError:
    if shape == "openai":
        body = record.get("body")
        if isinstance(body, bytes):
            body = body.decode("utf-8", "replace")
        if isinstance(body, str):
            try:
                body = json_text.loads(body)
            except ValueError as exc:  # malformed, a number past the digit limit, too deep
                return RowError(
                    row, "invalid_body", f"row {row}, column 'body': not valid JSON ({exc})", "body"
                )
        if isinstance(body, dict):
            body = {**defaults, **_drop_nulls(body)}
        line = {
            "custom_id": record.get("custom_id"),
            "method": record.get("method") or "POST",
            "url": record.get("url") or endpoint,
            "body": body,
        }
    else:
        simple = _simple_body(record, row, endpoint, defaults)
        if isinstance(simple, RowError):
            return simple
        body = simple
        line = {"custom_id": record.get("custom_id"), "method": "POST", "url": endpoint, "body": body}
    try:
        return json_text.dumps(line, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError):
        for name, value in record.items():
            try:
                json_text.dumps(value, allow_nan=False)
            except json_text.JSONTextError as exc:
                return RowError(row, "invalid_value", f"row {row}, column '{name}': {exc}", name)
            except (TypeError, ValueError):
                return RowError(
                    row,
                    "invalid_value",
                    f"row {row}, column '{name}': a {type(value).__name__} value cannot be part of a request",
                    name,
                )
        return RowError(row, "invalid_value", f"row {row}: the row cannot be made a request")


def _simple_body(
    record: dict[str, Any], row: int, endpoint: str, defaults: Mapping[str, Any]
) -> dict[str, Any] | RowError:
    """A simple-shape row's body: its columns as body fields, images as parts of its messages."""
    body = dict(defaults)
    images: list[Any] = []
    for name, value in record.items():
        if name == "custom_id" or value is None:
            continue
        if name in IMAGE_COLUMNS and endpoint == CHAT:
            images.extend(value if name == "images" and isinstance(value, list) else [value])
            continue
        if name == AUDIO_COLUMN and endpoint in AUDIO_ENDPOINTS:
            url = _audio_url(value)
            if url is None or record.get("file_url") is not None:
                why = (
                    "audio is binary or a string (a file id or a data URL)"
                    if url is None
                    else "the audio is given twice: in 'audio' and in 'file_url'"
                )
                return RowError(row, "invalid_value", f"row {row}, column 'audio': {why}", AUDIO_COLUMN)
            body["file_url"] = url
            continue
        if name in JSON_TEXT_FIELDS and isinstance(value, str) and value[:1] in ("[", "{"):
            try:
                value = json_text.loads(value)
            except ValueError as exc:
                return RowError(
                    row, "invalid_value", f"row {row}, column '{name}': not valid JSON ({exc})", name
                )
        if name == "messages" and isinstance(value, list):
            value = [_drop_nulls(m) if isinstance(m, dict) else m for m in value]
        body[name] = value
    if images:
        error = _attach_images(body, images, row)
        if error is not None:
            return error
    return body


def _image_url(value: Any) -> str | None:
    """An image column's value as an image URL: bytes become a base64 ``data:`` URL of the type
    their first bytes say (checked again, like any image, at validation); a string is a URL as it
    is. None for anything else."""
    if isinstance(value, str):
        return value
    if not isinstance(value, bytes):
        return None
    mime = next((m for magic, m in _IMAGE_MAGIC if value.startswith(magic)), "application/octet-stream")
    if mime == "image/webp" and value[8:12] != b"WEBP":
        mime = "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(value).decode()}"


def _audio_url(value: Any) -> str | None:
    """An audio column's value as a transcription body's ``file_url``: bytes become a base64
    ``data:`` URL of the type their first bytes say (libsndfile reads the bytes whatever the type;
    the engine refuses what it cannot decode as the line's ``invalid_audio``); a string (a file id
    or a data URL) is kept as it is. None for anything else."""
    if isinstance(value, str):
        return value
    if not isinstance(value, bytes):
        return None
    mime = next((m for magic, m in _AUDIO_MAGIC if value.startswith(magic)), "application/octet-stream")
    if value.startswith(b"RIFF") and value[8:12] == b"WAVE":
        mime = "audio/wav"
    return f"data:{mime};base64,{base64.b64encode(value).decode()}"


def _attach_images(body: dict[str, Any], images: list[Any], row: int) -> RowError | None:
    """The row's images as ``image_url`` parts before the text of its last user message."""
    messages = body.get("messages")
    users = (
        [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        if isinstance(messages, list)
        else []
    )
    if not users:
        return RowError(
            row,
            "invalid_value",
            f"row {row}: an image column needs a messages column with a user message",
            "image",
        )
    parts = []
    for value in images:
        url = _image_url(value)
        if url is None:
            return RowError(
                row,
                "invalid_value",
                f"row {row}, column 'image': an image is binary or a URL string",
                "image",
            )
        parts.append({"type": "image_url", "image_url": {"url": url}})
    content = users[-1].get("content")
    text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    users[-1]["content"] = parts + text
    return None


def _drop_nulls(value: dict[str, Any]) -> dict[str, Any]:
    """Struct columns give every field to every row; a field a row leaves null is left out."""
    return {k: v for k, v in value.items() if v is not None}


def write_requests(lines: Iterable[bytes], sink: IO[bytes] | str) -> int:
    """OpenAI batch JSONL lines -> Parquet (``custom_id, method, url, body`` as JSON text); the
    body is re-serialised compactly, so values survive but not the input's spacing. Returns rows."""
    rows = 0
    held = [0]  # record_bytes of the buffered rows: a batch is written at WRITE_BYTES of them
    buffer: list[tuple[Any, Any, Any, Any]] = []
    with pq.ParquetWriter(sink, REQUEST_SCHEMA, compression="zstd") as writer:

        def flush() -> None:
            if buffer:
                columns = [pa.array([r[i] for r in buffer], pa.string()) for i in range(4)]
                writer.write_table(pa.Table.from_arrays(columns, schema=REQUEST_SCHEMA))
                buffer.clear()
                held[0] = 0

        for raw in lines:
            text = raw.decode("utf-8", "replace").strip().lstrip("\ufeff")
            if not text:
                continue
            try:
                obj = json_text.loads(text)
            except ValueError:  # depth and digit limits too: the line is kept as text
                obj = None
            if not isinstance(obj, dict):
                buffer.append((None, None, None, text))
            else:
                body = obj.get("body")
                buffer.append(
                    (
                        _text(obj.get("custom_id")),
                        _text(obj.get("method")),
                        _text(obj.get("url")),
                        None if body is None else json.dumps(body, ensure_ascii=False, separators=(",", ":")),
                    )
                )
            rows += 1
            held[0] += record_bytes(buffer[-1])
            if len(buffer) >= WRITE_ROWS or held[0] >= WRITE_BYTES:
                flush()
        flush()
    return rows


def _text(value: Any) -> str | None:
    return None if value is None else value if isinstance(value, str) else json.dumps(value)
