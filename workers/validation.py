"""The ``validating`` step: read the input file once, check every line, write the request shards.

Each valid line gets its prompt key (the leading tokens of its rendered prompt, see
``scheduler.ordering``); the rows are sorted by it with an external merge sort and written as
shards in that order, so requests sharing a prefix (a system prompt, a document) run next to each
other and vLLM computes the prefix once. Memory is bounded by the sort buffer
(``FREIGHT_SORT_MEMORY_MB``) plus a 16-byte digest per custom_id, whatever the file size.
A file with any bad line fails the batch with every bad line listed (up to a cap, which is said).
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from scheduler.dispatcher import admit_batch, measured_throughput
from scheduler.ordering import SortStats, sort_records
from storage.models import Batch, StoredFile, WorkUnit
from storage.objectstore import iter_lines
from storage.settings import Settings
from storage.shards import ShardRow, write_shard
from storage.status import BatchStatus, transition
from workers.protocol import RequestError, parse_body
from workers.runtime import Runtime

log = logging.getLogger(__name__)

BOM = b"\xef\xbb\xbf"
UNSUPPORTED = "unsupported_parameter"


@dataclass(frozen=True)
class LineError:
    line: int
    code: str
    message: str
    param: str | None = None

    def as_openai(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(frozen=True)
class ValidLine:
    row: ShardRow
    model: str  # checked against the file's other lines (one model per file)


PromptKeyFn = Callable[[str, str, dict], bytes]  # (model, endpoint, body) -> sort key
PREFIX_KEY_BYTES = 128  # of a unit's first key kept on the unit row: 32 tokens, for packing


@dataclass(frozen=True)
class FileRules:
    endpoint: str
    served_models: frozenset[str]
    max_requests: int
    max_line_bytes: int
    prompt_key: PromptKeyFn | None = None  # None: no ordering key (rows keep file order)


def check_line(raw: bytes, line_no: int, rules: FileRules) -> ValidLine | LineError:
    """One line of an OpenAI batch file -> a validated row or the reason it is not one."""
    if len(raw) > rules.max_line_bytes:
        return LineError(
            line_no, "line_too_large", f"line is {len(raw)} bytes; the limit is {rules.max_line_bytes}"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return LineError(
            line_no, "invalid_json_line", f"line is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        )
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        return LineError(line_no, "invalid_json_line", f"line is not valid JSON: {getattr(exc, 'msg', exc)}")
    if not isinstance(obj, dict):
        return LineError(line_no, "invalid_json_line", "line must be a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(line_no, "missing_custom_id", "custom_id must be a non-empty string", "custom_id")
    if len(custom_id) > 512:
        return LineError(line_no, "invalid_custom_id", "custom_id is longer than 512 characters", "custom_id")
    if obj.get("method") != "POST":
        return LineError(line_no, "invalid_method", "method must be POST", "method")
    if obj.get("url") != rules.endpoint:
        return LineError(
            line_no,
            "mismatched_url",
            f"url {str(obj.get('url'))[:200]!r} does not match the batch endpoint {rules.endpoint}",
            "url",
        )
    extra = set(obj) - {"custom_id", "method", "url", "body"}
    if extra:
        return LineError(line_no, "invalid_request", f"unknown field(s): {', '.join(sorted(extra))[:200]}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return LineError(line_no, "invalid_body", "body must be a JSON object", "body")
    model = body.get("model")
    if not isinstance(model, str) or model not in rules.served_models:
        return LineError(
            line_no, "model_not_found", f"model {str(model)[:200]!r} is not served here", "body.model"
        )
    try:
        parse_body(rules.endpoint, body)
    except RequestError as exc:
        # a well-formed request Freight cannot honour (streaming, tool calling, …) is that
        # request's 400 error line at run time; only malformed input fails the whole file
        if exc.code != UNSUPPORTED:
            param = f"body.{exc.param}" if exc.param else "body"
            return LineError(line_no, exc.code, exc.message, param)
    body_json = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    key = rules.prompt_key(model, rules.endpoint, body) if rules.prompt_key else b""
    return ValidLine(ShardRow(line_no, custom_id, body_json, key), model)


@dataclass
class ScanResult:
    rows: int = 0
    model: str | None = None
    errors: list[LineError] = field(default_factory=list)
    error_count: int = 0


def scan_lines(lines: Iterable[bytes], rules: FileRules, max_listed: int) -> Iterator[ShardRow | ScanResult]:
    """Yield valid rows in file order, then one ScanResult summarising the whole file.

    File-level rules live here: BOM, CRLF, blank lines (only trailing ones are allowed), unique
    custom_ids, one model per file, the request-count limit.
    """
    result = ScanResult()
    seen: set[bytes] = set()
    blank_run_start = 0

    def fail(error: LineError) -> None:
        result.error_count += 1
        if len(result.errors) < max_listed:
            result.errors.append(error)

    line_no = 0
    for line_no, raw in enumerate(lines, start=1):
        if line_no == 1 and raw.startswith(BOM):
            raw = raw[len(BOM) :]
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            blank_run_start = blank_run_start or line_no
            continue
        if blank_run_start:
            fail(LineError(blank_run_start, "empty_line", "empty line inside the file"))
            blank_run_start = 0
        checked = check_line(raw, line_no, rules)
        if isinstance(checked, LineError):
            fail(checked)
            continue
        row, model = checked.row, checked.model
        digest = hashlib.blake2b(row.custom_id.encode(), digest_size=16).digest()
        if digest in seen:
            fail(
                LineError(
                    line_no,
                    "duplicate_custom_id",
                    f"custom_id {row.custom_id[:200]!r} appears more than once",
                    "custom_id",
                )
            )
            continue
        seen.add(digest)
        if result.model is None:
            result.model = model
        elif model != result.model:
            fail(
                LineError(
                    line_no,
                    "mixed_models",
                    f"model {model!r} differs from {result.model!r}: one model per file",
                    "body.model",
                )
            )
            continue
        result.rows += 1
        if result.rows > rules.max_requests:
            fail(
                LineError(
                    line_no, "too_many_requests", f"the file has more than {rules.max_requests} requests"
                )
            )
            break
        yield row
    if result.rows == 0 and result.error_count == 0:
        fail(LineError(max(line_no, 1), "empty_file", "the file contains no requests"))
    yield result


_ID_LEN = struct.Struct(">I")


def _payload(row: ShardRow) -> bytes:
    custom_id = row.custom_id.encode()
    return _ID_LEN.pack(len(custom_id)) + custom_id + row.body_json.encode()


def _row(key: bytes, line: int, payload: bytes) -> ShardRow:
    (n,) = _ID_LEN.unpack_from(payload)
    start = _ID_LEN.size
    return ShardRow(line, payload[start : start + n].decode(), payload[start + n :].decode(), key)


def prompt_keys(settings: Settings) -> PromptKeyFn:
    """Sort keys from each served model's own tokenizer and chat template (each loaded once)."""
    from workers.prompts import PromptKeyer, keyer_for

    keyers: dict[str, PromptKeyer | None] = {}

    def keyer_of(model: str) -> PromptKeyer | None:
        if model not in keyers:
            try:
                keyers[model] = keyer_for(settings.models[model], settings.sort_key_tokens)
            except Exception:  # no tokenizer files: that model's rows keep file order
                log.warning(
                    "no tokenizer for model %r; its requests are not prefix-ordered", model, exc_info=True
                )
                keyers[model] = None
        return keyers[model]

    def key(model: str, endpoint: str, body: dict) -> bytes:
        keyer = keyer_of(model)
        return keyer.key(endpoint, body) if keyer is not None else b""

    return key


def spill_dir(settings: Settings) -> str:
    path = settings.data_dir / "tmp"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def validate_batch(rt: Runtime, batch_id: str) -> None:
    """Validate a ``validating`` batch; the dispatcher queues its units after this commits."""
    settings: Settings = rt.settings
    with rt.db.read() as s:
        batch = s.get(Batch, batch_id)
        if batch is None or batch.status != BatchStatus.VALIDATING:
            return  # already validated (task re-delivered) or cancelled meanwhile
        input_key = s.get(StoredFile, batch.input_file_id).object_key  # type: ignore[union-attr]
        endpoint = batch.endpoint
    rules = FileRules(
        endpoint=endpoint,
        served_models=frozenset(settings.models),
        max_requests=settings.max_requests_per_file,
        max_line_bytes=settings.max_line_bytes,
        prompt_key=prompt_keys(settings),
    )
    started = time.monotonic()
    units: list[tuple[str, int, int, bytes]] = []  # (shard key, first line, rows, first prompt key)
    shard: list[ShardRow] = []
    summary = ScanResult()
    sort_stats = SortStats()

    def flush() -> None:
        key = f"batches/{batch_id}/shards/{len(units):06d}.parquet"
        write_shard(rt.store, key, shard)
        units.append((key, shard[0].line, len(shard), shard[0].key[:PREFIX_KEY_BYTES]))
        shard.clear()

    with rt.store.open(input_key) as stream:

        def records() -> Iterator[tuple[bytes, int, bytes]]:
            nonlocal summary
            for item in scan_lines(iter_lines(stream), rules, settings.max_listed_errors):
                if isinstance(item, ScanResult):
                    summary = item
                    return
                yield item.key, item.line, _payload(item)

        ordered = sort_records(
            records(),
            memory_bytes=settings.sort_memory_mb * 1024 * 1024,
            spill_dir=spill_dir(settings),
            stats=sort_stats,
        )
        try:
            first = next(ordered, None)  # the sort reads the whole file before its first row
            if first is not None and not summary.error_count:
                shard.append(_row(*first))
                for record in ordered:
                    if len(shard) >= settings.unit_size:
                        flush()
                    shard.append(_row(*record))
                if shard:
                    flush()
        finally:
            ordered.close()
    log.info(
        "validated %s: %d requests, %d errors in %.2fs (%d sorted runs spilled)",
        batch_id,
        summary.rows,
        summary.error_count,
        time.monotonic() - started,
        sort_stats.runs_spilled,
    )

    now = int(time.time())
    rates = measured_throughput(rt, now) if not summary.error_count else {}
    with rt.db.write() as s:
        batch = s.get(Batch, batch_id, with_for_update=True)
        if batch is None or batch.status != BatchStatus.VALIDATING:
            return
        admission = None
        if not summary.error_count:
            admission = admit_batch(rt, s, batch, summary.model or "", summary.rows, now, rates)
        if admission is not None and not admission.accept:
            batch.errors = {
                "object": "list",
                "data": [
                    {
                        "code": "sla_unattainable",
                        "message": admission.warning,
                        "param": "completion_window",
                        "line": None,
                    }
                ],
            }
            batch.request_total = 0
            transition(batch, BatchStatus.FAILED, now)
            log.warning("batch %s refused: %s", batch_id, admission.warning)
        elif summary.error_count:
            data = [e.as_openai() for e in summary.errors]
            if summary.error_count > len(data):
                data.append(
                    {
                        "code": "too_many_errors",
                        "message": f"{summary.error_count} lines failed validation; the first {len(data)} are listed",
                        "param": None,
                        "line": None,
                    }
                )
            batch.errors = {"object": "list", "data": data}
            batch.request_total = 0
            transition(batch, BatchStatus.FAILED, now)
        else:
            batch.model = summary.model
            batch.request_total = summary.rows
            units_made = [
                WorkUnit(
                    batch_id=batch_id,
                    seq=seq,
                    model=summary.model or "",
                    shard_key=key,
                    first_line=first,
                    n_requests=n,
                    prefix_key=prefix,
                )
                for seq, (key, first, n, prefix) in enumerate(units)
            ]
            s.add_all(units_made)
            if admission is not None and admission.warning:
                batch.warnings = [admission.warning]
            transition(batch, BatchStatus.IN_PROGRESS, now)
