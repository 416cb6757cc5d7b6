"""The ``validating`` step: read the input file once, check every line, write the request shards.

The input is JSONL or Parquet (``workers/batch_input.py``): either way it becomes OpenAI batch
lines, checked here. Each valid line's prompt is rendered and tokenized once
(``workers/prompt_tokens.py``): its token ids, length and output budget go into the request store
beside the body, and its prompt key (the leading token ids, see ``scheduler.ordering``) orders the
rows: an external merge sort writes them as Parquet shards (``storage/shards.py``) in that order,
so requests sharing a prefix (a system prompt, a document) run next to each other and vLLM computes
the prefix once. Planning then cuts the shards into work units from their columns alone
(``workers/planning.py``). Memory is bounded by the sort buffer (``FREIGHT_SORT_MEMORY_MB``), one
row group, and a 16-byte digest per custom_id, whatever the file size. A file with any bad line
fails the batch with every bad line listed (up to a cap, which is said); Parquet errors name the
row and the column. A well-formed line naming a model not served here (a typo, an adapter of a
base not served or of other tenants), a model whose task does not serve the endpoint, an adapter of
another base than the file's model, or holding a vision model's image token as text, is not such a
bad line: it is a row of the file whose run is its error (``RefusedLine``), unless no line of the
file names a served model. An
input past FREIGHT_VALIDATION_CHUNK_BYTES is validated in chunks across control processes with
these same line rules, then merged into the same shards (``workers/validation_chunks.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import itertools
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import exists, func, or_, select, update
from sqlalchemy.orm import Session

from scheduler import json_text
from scheduler.leases import validation_wait
from scheduler.ordering import SortStats, common_prefix_tokens, sort_records
from scheduler.request_work import request_sequences
from scheduler.unit_plan import kv_block_size
from storage.adapters import usable_adapters
from storage.checkpoint_cache import CheckpointError
from storage.leases import ESTIMATE_LEASE, VALIDATION_CHUNK_LEASE, VALIDATION_LEASE, LeaseKeeper
from storage.lifecycle import fail_validating
from storage.models import Batch, Estimate, StoredFile, Tenant, ValidationChunk
from storage.object_ledger import charge_listed
from storage.quotas import queued_refusal
from storage.registry import (
    EMBED,
    GENERATE,
    SCORE,
    TRANSCRIBE,
    Catalog,
    catalog,
)
from storage.request_tables import RowError, column_of, decode_limits, metadata_defaults
from storage.retention import validated_prefixes
from storage.runtime import Runtime
from storage.settings import Settings
from storage.shards import SHARD_UNITS, ShardRow, ShardWriter
from storage.status import BatchStatus, EstimateStatus, transition
from workers.batch_input import open_requests
from workers.checkpoint import checkpoint_dir
from workers.dispatcher import admit_batch, measured_throughput
from workers.head_start import HeadStart, asked, sliced, unit_rows
from workers.image_tokens import checkpoint_image_tokens, injected_image_token
from workers.images import ImageResolver, checkpoint_takes_images
from workers.planning import plan_batch
from workers.prefix_caching import prediction_block_size
from workers.prompt_tokens import PromptRenderer, RenderedPrompt, TokenizerUnavailable, renderer_for
from workers.render_blocks import CheckedLine, PromptFn, PromptsFn, RenderBlock
from workers.request_bodies import (
    CHAT,
    REFUSED_LINE,
    RequestError,
    endpoint_mismatch,
    refused_line_json,
    serves,
)
from workers.request_shapes import RequestShapes
from workers.responses import RESPONSES
from workers.resume import settled
from workers.transcription import AUDIO_ENDPOINTS

log = logging.getLogger(__name__)

BOM = b"\xef\xbb\xbf"
UNSUPPORTED = "unsupported_parameter"
MAX_OUTPUT_TOKENS = 2**31 - 1
SURROGATE = (
    "holds an unpaired surrogate (a \\ud800-\\udfff escape that is not half of a pair): not valid Unicode"
)


def line_content(raw: bytes, first_of_file: bool) -> bytes:
    """A JSONL line as the file's encoding allows it to be written: a UTF-8 BOM before the first
    line and a CR before each newline (files saved on Windows) are not part of the line."""
    if first_of_file and raw.startswith(BOM):
        raw = raw[len(BOM) :]
    return raw.rstrip(b"\r")


def _is_utf8(text: str) -> bool:
    """JSON may escape half a surrogate pair (``"\\ud800"``); such a string has no UTF-8 form, so
    it can be neither hashed, stored nor tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class LineError:
    line: int
    code: str
    message: str
    param: str | None = None

    def as_openai(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(frozen=True, slots=True)
class RefusedLine:
    """A well-formed line refused alone: its ``body.model`` is a model not served here, nor an
    adapter its tenant may use (one restricted to other tenants reads the same, so no tenant learns
    another's adapter exists: ``model_not_found``); or a served model whose task does not serve
    the batch's endpoint (``invalid_model``: a rerank line for a text model); or a vision model's
    line holding one of its image tokens as text (``image_token_in_text``); or, found by the file's
    rules, an adapter of another base than the file's model (``adapter_base_mismatch``,
    ``FileChecks.accept``). It is a row of the file, joining the model its other lines name, that
    runs as its ``error`` (a 400 in the error file) while they run; its body is not kept, the
    stored one is the refusal (``request_bodies.REFUSED_LINE``, raised by ``parse_body`` on the
    engine worker). A file in which no line passes naming a served model fails as a whole with
    these errors (``FileChecks``)."""

    line: int
    custom_id: str
    error: LineError

    def row(self) -> ShardRow:
        """Its row: the refusal as its body, a fixed prompt key, no prompt, no output budget."""
        e = self.error
        param = e.param.removeprefix("body.") if e.param else None  # OpenAI's param: the body's field
        body = refused_line_json(e.code, e.message, param)
        return ShardRow(self.line, self.custom_id, body, b"", None, 0, None)


@dataclass(frozen=True, slots=True)
class SkippedLine:
    """A line whose custom_id the batch this one resumes settled (``FileRules.skip``): not a row,
    not an error; its body is not checked further (it passed when it ran before)."""

    line: int
    custom_id: str


REFUSED_PREFIX = '{"' + REFUSED_LINE + '":'


def is_refused(row: ShardRow) -> bool:
    """Whether a row is a ``RefusedLine``'s (a tenant's body with that field fails validation)."""
    return row.body_json.startswith(REFUSED_PREFIX)


@dataclass(frozen=True)
class ValidLine:
    row: ShardRow
    model: str  # checked against the file's other lines (one model per file)


@dataclass(frozen=True)
class FileRules:
    endpoint: str
    served_models: frozenset[str]
    max_requests: int
    max_line_bytes: int
    render: PromptFn | None = None  # None: no token ids, no ordering key (rows keep file order)
    render_many: PromptsFn | None = None  # the same for a block of bodies (else render, each)
    auto_tool_models: frozenset[str] = frozenset()  # their tool-call parser serves tool_choice "auto"
    reasoning_models: frozenset[str] = frozenset()  # they read reasoning back (Responses `reasoning`)
    # the served models whose task is embeddings: they serve /v1/embeddings, and only that
    embed_models: frozenset[str] = frozenset()
    # the served cross-encoders: they serve /v1/score and /v1/rerank, and only those
    score_models: frozenset[str] = frozenset()
    # the served speech models: they serve the two audio endpoints, and only those
    speech_models: frozenset[str] = frozenset()
    # the file's accepted request shapes: vLLM's request model runs once per shape, not per line
    shapes: RequestShapes = field(default_factory=RequestShapes, compare=False)
    # the LoRA adapters the batch's tenant may name, {adapter: its base}: a line naming one is a
    # line of its base (rendered with the base's tokenizer, one base per file); its body keeps the
    # adapter's name, which the engine worker serves it with (storage/adapters.py)
    adapters: Mapping[str, str] = field(default_factory=dict, compare=False)
    # the batch's image checks and store (workers/images.py); None: image parts stay as given
    # (a dry-run estimate, which stores nothing)
    images: ImageResolver | None = field(default=None, compare=False)
    # a resume's settled lines (workers/resume.py): the 16-byte digests of the custom_ids the
    # batch it resumes settled, whose lines are skipped (``SkippedLine``); empty: none is
    skip: frozenset[bytes] = field(default=frozenset(), compare=False)
    # a served model's image tokens (workers/image_tokens.py; () for a text model): a line holding
    # one as text is refused alone. None: not checked
    image_tokens: Callable[[str], tuple[str, ...]] | None = field(default=None, compare=False)
    # a generated request's expected output when its body sets no budget (the engine's default):
    # what its work counts (scheduler.request_work)
    default_max_tokens: int = 0


def check_line(raw: bytes, line_no: int, rules: FileRules) -> ValidLine | LineError:
    """One line of an OpenAI batch file -> a validated row or the reason it is not one (a
    ``RefusedLine``'s error: whether the file runs it as its error row is the file's to say)."""
    checked = check_fields(raw, line_no, rules)
    if isinstance(checked, LineError):
        return checked
    if isinstance(checked, RefusedLine):
        return checked.error
    assert not isinstance(checked, SkippedLine), "check_line is not given a resume's rules"
    rendered = None if rules.render is None else rules.render(checked.model, rules.endpoint, checked.body)
    return ValidLine(checked.row(rendered), checked.model)


def check_fields(
    raw: bytes, line_no: int, rules: FileRules
) -> CheckedLine | RefusedLine | SkippedLine | LineError:
    """``check_line`` but for the prompt: scanners render a block of lines at a time. A line that
    names (a string) a model not served here, or one whose task does not serve the endpoint, or a
    vision model's line holding its image tokens as text, is a ``RefusedLine``; one naming none, or
    not as a string, is malformed and a ``LineError`` as before; one a resume skips a
    ``SkippedLine``."""
    obj = _line_object(raw, line_no, rules)
    if isinstance(obj, LineError):
        return obj
    custom_id = _envelope_custom_id(obj, line_no, rules)
    if isinstance(custom_id, LineError):
        return custom_id
    if rules.skip and hashlib.blake2b(custom_id.encode(), digest_size=16).digest() in rules.skip:
        return SkippedLine(line_no, custom_id)
    body: Any = obj.get("body")
    # a line with image parts is stored once, after they become references (its data: URLs are
    # most of its bytes), as is one naming a file id (an image's or an audio line's) and an audio
    # line (its data URL: workers/media_files.py); any other body now
    images = rules.images if rules.images is not None and _names_media(raw, body, rules.images) else None
    body_json = None if images is not None and isinstance(body, dict) else _stored_body(body, line_no)
    if isinstance(body_json, LineError):
        return body_json
    model = body.get("model")
    if isinstance(model, str) and model in rules.adapters:
        model = rules.adapters[model]
    if not isinstance(model, str) or model not in rules.served_models:
        error = LineError(
            line_no, "model_not_found", f"model {str(model)[:200]!r} is not served here", "body.model"
        )
        return RefusedLine(line_no, custom_id, error) if isinstance(model, str) else error
    task = (
        EMBED
        if model in rules.embed_models
        else SCORE
        if model in rules.score_models
        else TRANSCRIBE
        if model in rules.speech_models
        else GENERATE
    )
    if not serves(task, rules.endpoint):  # well-formed, for a model of another task: that line's error
        mismatch = endpoint_mismatch(model, rules.endpoint, task)
        return RefusedLine(line_no, custom_id, LineError(line_no, "invalid_model", mismatch, "body.model"))
    max_tokens = _body_max_tokens(body, model, line_no, rules)
    if isinstance(max_tokens, LineError):
        return max_tokens
    # image parts become references to the images stored, or the refusal that is the line's error
    # when it runs (checked after the body's shape: a malformed part fails the file like any field)
    if images is not None:
        images.resolve(model, body)
        body_json = _stored_body(body, line_no)
        if isinstance(body_json, LineError):
            return body_json
    assert body_json is not None  # stored above, or before the checks
    if rules.image_tokens is not None:
        tokens = rules.image_tokens(model)  # () for a text model: nothing more to test
        injected = injected_image_token(body, body_json, tokens) if tokens else None
        if injected is not None:
            return _image_token_refusal(line_no, custom_id, model, *injected)
    # what the line weighs in the fair shares and the queued-requests quota (scheduler.request_work)
    sequences = request_sequences(task, body)
    expected = None if task in (EMBED, SCORE) else max_tokens
    if task not in (EMBED, SCORE) and max_tokens is None:
        expected = rules.default_max_tokens
    return CheckedLine(line_no, custom_id, body_json, body, model, max_tokens, sequences, expected)


def _names_media(raw: bytes, body: Any, images: ImageResolver) -> bool:
    """Whether a line may hold media to resolve: may answer yes for a line that holds none (its
    resolve then changes nothing and the body is stored as it is: the same one serialization),
    never no for one that holds some, whatever the tenant's spacing or escapes.

    An audio endpoint's line is judged from its parsed body (a string ``file_url``: a data URL or
    a file id), so ``"file_url": "data:`` with any whitespace, or a key or value spelled with
    ``\\u`` escapes, is found. Any other line by its bytes (cheap: most lines hold no media): a
    JSON string's quote opens ``image_url``, ``input_image`` and ``file-``; only a ``\\u`` escape
    can spell one of their characters otherwise, so a line holding one is looked at too."""
    if images.audio.data_urls:
        return isinstance(body, dict) and isinstance(body.get("file_url"), str)
    return b'"image_url"' in raw or b'"input_image"' in raw or b'"file-' in raw or b"\\u" in raw


def _line_object(raw: bytes, line_no: int, rules: FileRules) -> dict | LineError:
    """The line decoded: within the size limit, UTF-8, JSON, an object."""
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
        obj = json_text.loads(text)
    except ValueError as exc:  # malformed, a number past the digit limit, nested too deeply
        return LineError(line_no, "invalid_json_line", f"line is not valid JSON: {getattr(exc, 'msg', exc)}")
    if not isinstance(obj, dict):
        return LineError(line_no, "invalid_json_line", "line must be a JSON object")
    return obj


def _envelope_custom_id(obj: dict, line_no: int, rules: FileRules) -> str | LineError:
    """The batch line's own fields (custom_id, method, url, nothing else but body): its custom_id."""
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(line_no, "missing_custom_id", "custom_id must be a non-empty string", "custom_id")
    if len(custom_id) > 512:
        return LineError(line_no, "invalid_custom_id", "custom_id is longer than 512 characters", "custom_id")
    if not _is_utf8(custom_id):
        return LineError(line_no, "invalid_custom_id", f"custom_id {SURROGATE}", "custom_id")
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
    return custom_id


def _stored_body(body: Any, line_no: int) -> str | LineError:
    """The body as the compact JSON text the request store keeps."""
    if not isinstance(body, dict):
        return LineError(line_no, "invalid_body", "body must be a JSON object", "body")
    try:
        body_json = json_text.dumps(body, ensure_ascii=False, separators=(",", ":"))
    except ValueError as exc:
        return LineError(line_no, "invalid_body", f"body cannot be stored: {exc}", "body")
    if not _is_utf8(body_json):
        return LineError(line_no, "invalid_body", f"body {SURROGATE}", "body")
    return body_json


def _body_max_tokens(body: dict, model: str, line_no: int, rules: FileRules) -> int | LineError | None:
    """The output budget the body asks for (None: the engine's default), once its shape passes."""
    max_tokens = None
    try:
        max_tokens = rules.shapes.max_tokens(
            rules.endpoint, body, model in rules.auto_tool_models, model in rules.reasoning_models
        )
    except RequestError as exc:
        # a well-formed request Freight cannot honour (streaming, tool calling, …) is that
        # request's 400 error line at run time; only malformed input fails the whole file
        if exc.code != UNSUPPORTED:
            param = f"body.{exc.param}" if exc.param else "body"
            return LineError(line_no, exc.code, exc.message, param)
    if max_tokens is not None and not 0 <= max_tokens <= MAX_OUTPUT_TOKENS:  # stored as int32
        return LineError(
            line_no, "invalid_request", f"max_tokens must be at most {MAX_OUTPUT_TOKENS}", "body.max_tokens"
        )
    return max_tokens


def _image_token_refusal(line_no: int, custom_id: str, model: str, where: str, token: str) -> RefusedLine:
    """A vision model's line with one of its image tokens as text (``workers.image_tokens``)."""
    message = (
        f"`{where or 'body'}` holds {token!r}, an image token of model {model[:200]!r}: it would stand "
        "for an image the line does not have; send images as image_url content parts"
    )
    param = f"body.{where}" if where else "body"
    return RefusedLine(line_no, custom_id, LineError(line_no, "image_token_in_text", message, param))


@dataclass
class ScanResult:
    rows: int = 0
    model: str | None = None
    errors: list[LineError] = field(default_factory=list)
    error_count: int = 0


class FileChecks:
    """The file-wide rules of a batch input, each written once: runs of blank lines inside the
    file, unique custom_ids, one model per file, the request limit (FREIGHT_MAX_REQUESTS_PER_FILE),
    the error cap (FREIGHT_MAX_LISTED_ERRORS) and the empty file. ``scan_lines`` drives it with the
    lines it checks in place, the chunked validation's merge (``validation_chunks.replay``) with the
    chunks' events of the same lines: both say the same errors, messages and line numbers because
    there is one copy of the rules. On the hot path (a call for each line of up to a million):
    ``__slots__``, and a valid line costs what the inline code it replaced did.

    A ``RefusedLine`` (``refuse``) is a row like an accepted line (its custom_id unique, counted
    in the request limit, of the file's model), but until a line names a served model the file's
    outcome is open: if none ever does, the file fails as it did before refused lines were rows,
    each listed as its ``model_not_found`` (``_unnamed``); the errors that only a file with a
    served model has (a refused line's duplicate custom_id, ``_held``) are listed only then."""

    __slots__ = (
        "_blank_from", "_held", "_held_count", "_max_listed", "_max_requests", "_named", "_seen",
        "_skipped", "_unnamed", "_unnamed_count", "full", "result",
    )  # fmt: skip

    def __init__(self, max_requests: int, max_listed: int) -> None:
        self.result = ScanResult()
        self.full = False  # past the request limit: the file's lines end at the one that said so
        self._seen: set[bytes] = set()  # 16-byte blake2b digests of the accepted custom_ids
        self._blank_from = 0  # the first line of the run of blank lines just read; 0: none
        self._max_requests = max_requests
        self._max_listed = max_listed
        self._named = False  # a line passed its own checks naming a served model
        self._unnamed: list[LineError] = []  # refused lines' errors while none had (the first listed)
        self._unnamed_count = 0
        self._held: list[LineError] = []  # a refused line's file-rule errors while none had
        self._held_count = 0
        self._skipped = 0  # lines a resume skipped (``SkippedLine``)

    def clean(self) -> str | None:
        """The file's model if no line so far failed (nor will for what was read: no run of
        blank lines open, no refused line's error held) and a line named a served model; else
        None. What ``workers.head_start`` asks before a slice of the file runs."""
        if not self._named or self.result.error_count or self._held_count or self._blank_from:
            return None
        return self.result.model

    def failed(self, error: LineError | None) -> None:
        """Count one error, listed while fewer than the cap are. None: an error the caller did not
        keep, which is fine only past the cap (a chunk keeps its first max_listed errors, so any
        later one has as many before it in the file)."""
        result = self.result
        result.error_count += 1
        if len(result.errors) < self._max_listed:
            assert error is not None, "a listed error a chunk did not keep"
            result.errors.append(error)

    def blank(self, line_no: int) -> None:
        """A blank line: an error only if a line with text follows it (trailing ones are fine)."""
        self._blank_from = self._blank_from or line_no

    def _blank_run_ends(self) -> None:
        """A line with text after a run of blank lines: the run was inside the file (one error, at
        its first line)."""
        self.failed(LineError(self._blank_from, "empty_line", "empty line inside the file"))
        self._blank_from = 0

    def bad(self, error: LineError | None) -> None:
        """A line with text that failed its own checks (``check_line``)."""
        if self._blank_from:
            self._blank_run_ends()
        self.failed(error)

    def accept(
        self, line_no: int, custom_id: bytes, model: str, named: str | None = None
    ) -> bool | LineError:
        """A line that passed its own checks (its custom_id's UTF-8 bytes, its model, the name its
        body gives: an adapter's, or None or ``model`` for the base): True if it is a row of the
        file; False if a file rule failed it, ``full`` then True if the file is past its request
        limit and no later line counts; a LineError if it is a row that runs as that error.

        The file's model is the model of its first line to get here (a base, or an adapter's base).
        A later line of another base fails the file (``mixed_models``: one model per file), but one
        naming an adapter of another base is refused alone (``adapter_base_mismatch``)."""
        if self._blank_from:
            self._blank_run_ends()
        self._named = True
        digest = hashlib.blake2b(custom_id, digest_size=16).digest()
        if digest in self._seen:
            self.failed(_duplicate(line_no, custom_id))
            return False
        self._seen.add(digest)
        result = self.result
        if result.model is None:
            result.model = model
        elif model != result.model:
            if named is None or named == model:
                message = f"model {model!r} differs from {result.model!r}: one model per file"
                self.failed(LineError(line_no, "mixed_models", message, "body.model"))
                return False
            refusal = _adapter_mismatch(line_no, named, model, result.model)
            result.rows += 1
            if result.rows > self._max_requests:
                self.failed(self._past_limit(line_no))
                return False
            return refusal
        result.rows += 1
        if result.rows > self._max_requests:
            self.failed(self._past_limit(line_no))
            return False
        return True

    def skip(self, line_no: int, custom_id: bytes) -> None:
        """A ``SkippedLine``: a line with text, but no row and no error. Its custom_id still counts
        as seen: a later line of the same id is a duplicate, as it was when the file first ran."""
        if self._blank_from:
            self._blank_run_ends()
        self._skipped += 1
        digest = hashlib.blake2b(custom_id, digest_size=16).digest()
        if digest in self._seen:
            self.failed(_duplicate(line_no, custom_id))
            return
        self._seen.add(digest)

    def _past_limit(self, line_no: int) -> LineError:
        """The line past the request limit: its error; no later line counts."""
        self.full = True
        return LineError(
            line_no, "too_many_requests", f"the file has more than {self._max_requests} requests"
        )

    def refuse(self, line_no: int, custom_id: bytes, error: LineError | None) -> bool:
        """A ``RefusedLine`` (its custom_id's UTF-8 bytes, its error; None: one the caller did not
        keep, as for ``failed``): True if it is a row of the file (whose run is its error) for
        as long as some line names a served model; False as ``accept``'s."""
        if self._blank_from:
            self._blank_run_ends()
        named = self._named
        if not named:  # the file fails with this error if no line ever names a served model
            self._unnamed_count += 1
            if len(self._unnamed) < self._max_listed:
                assert error is not None, "a listed error a chunk did not keep"
                self._unnamed.append(error)
        digest = hashlib.blake2b(custom_id, digest_size=16).digest()
        if digest in self._seen:
            duplicate = _duplicate(line_no, custom_id)
            if named:
                self.failed(duplicate)
            else:
                self._held_count += 1
                if len(self._held) < self._max_listed:
                    self._held.append(duplicate)
            return False
        self._seen.add(digest)
        result = self.result
        result.rows += 1
        if result.rows > self._max_requests:
            # the file fails whichever way it ends: at this line if a served model was named,
            # else at the next line naming one, or with its lines' model_not_found if none does
            if named:
                self.failed(self._past_limit(line_no))
            return False
        return True

    def finish(self, last_line: int) -> ScanResult:
        """The file's summary, its lines all given (``last_line``: the number of the last one)."""
        result = self.result
        extra, count = (self._held, self._held_count) if self._named else (self._unnamed, self._unnamed_count)
        if not self._named:
            result.rows = 0  # refused lines only: none is a row
        if count:  # each list is the first of its kind in file order: merged, the first of all
            merged = sorted([*result.errors, *extra], key=lambda e: e.line)
            result.errors = merged[: self._max_listed]
            result.error_count += count
        if result.rows == 0 and result.error_count == 0 and self._skipped:
            message = f"the batch resumed settled all {self._skipped} lines of the file: none is left to run"
            self.failed(LineError(0, "nothing_to_resume", message))
        elif result.rows == 0 and result.error_count == 0:
            self.failed(LineError(max(last_line, 1), "empty_file", "the file contains no requests"))
        return result


def _adapter_mismatch(line_no: int, adapter: str, base: str, file_model: str) -> LineError:
    """A line naming an adapter of ``base`` in a file of ``file_model``: that line's error."""
    message = (
        f"model {adapter[:200]!r} is a LoRA adapter of {base!r}, not of {file_model!r}, this file's "
        "model (its first line naming a served model): a file's lines name one base model or its adapters"
    )
    return LineError(line_no, "adapter_base_mismatch", message, "body.model")


def _duplicate(line_no: int, custom_id: bytes) -> LineError:
    message = f"custom_id {custom_id.decode()[:200]!r} appears more than once"
    return LineError(line_no, "duplicate_custom_id", message, "custom_id")


def scan_lines(
    lines: Iterable[bytes | LineError], rules: FileRules, max_listed: int, checks: FileChecks | None = None
) -> Iterator[ShardRow | ScanResult]:
    """Yield valid rows in file order, then one ScanResult summarising the whole file.

    The file's encoding is read here (a BOM on line 1, CRLF, blank lines), each line checked by
    ``check_line`` and the file-wide rules applied by ``FileChecks``. A ``RefusedLine``'s row is
    yielded as soon as it is read (before the rendered rows of the lines waiting in the block): if
    no line of the file names a served model, the summary lists it as an error instead and counts
    no rows (a failed file's rows are not stored). ``checks``: the file rules' state, for a
    caller that asks how the file stands while it reads (``workers.head_start``).
    """
    if checks is None:
        checks = FileChecks(rules.max_requests, max_listed)
    accept = checks.accept  # bound once: called for every valid line
    block = RenderBlock(rules.endpoint, rules.render, rules.render_many)
    line_no = 0
    for line_no, raw in enumerate(lines, start=1):
        if isinstance(raw, LineError):  # a row the input format could not make a line of
            checks.failed(raw)
            continue
        raw = line_content(raw, line_no == 1)
        if not raw.strip():
            checks.blank(line_no)
            continue
        checked = check_fields(raw, line_no, rules)
        if isinstance(checked, LineError):
            checks.bad(checked)
            continue
        if isinstance(checked, SkippedLine):
            checks.skip(line_no, checked.custom_id.encode())
            continue
        if isinstance(checked, RefusedLine):  # not rendered: its row runs as its error
            if checks.refuse(line_no, checked.custom_id.encode(), checked.error):
                yield checked.row()
            elif checks.full:
                break
            continue
        accepted = accept(line_no, checked.custom_id.encode(), checked.model, checked.body.get("model"))
        if accepted is True:
            yield from block.add(checked)
        elif accepted is not False:  # an adapter of another base: not rendered, runs as its error
            yield RefusedLine(line_no, checked.custom_id, accepted).row()
        elif checks.full:
            break
    yield from block.flush()
    yield checks.finish(line_no)


# sort payload: custom_id length, prompt length, output budget (-1: none), ids present, sequences,
# work; then the custom_id, the ids (big-endian uint32) when present, and the body
_HEAD = struct.Struct(">IIiBIQ")


def _payload(row: ShardRow) -> bytes:
    custom_id = row.custom_id.encode()
    ids = row.prompt_token_ids
    budget = -1 if row.max_tokens is None else row.max_tokens
    head = _HEAD.pack(len(custom_id), row.prompt_len, budget, ids is not None, row.sequences, row.work)
    return b"".join((head, custom_id, bytes(ids or b""), row.body_json.encode()))


def _row(key: bytes, line: int, payload: bytes, shared: int = 0) -> ShardRow:
    n, prompt_len, max_tokens, exact, sequences, work = _HEAD.unpack_from(payload)
    start = _HEAD.size + n
    custom_id = payload[_HEAD.size : start].decode()
    ids = None
    if exact:
        ids, start = payload[start : start + 4 * prompt_len], start + 4 * prompt_len
    body = payload[start:].decode()
    budget = None if max_tokens < 0 else max_tokens
    return ShardRow(line, custom_id, body, key, ids, prompt_len, budget, shared, sequences, work)


class PromptRenders:
    """Each served model's prompt rendering (its own tokenizer and chat template, loaded once per
    process); a model whose tokenizer cannot be loaded raises TokenizerUnavailable."""

    def __init__(self, rt: Runtime, models: Catalog | None = None) -> None:
        self.rt = rt
        self.models = models  # the registry as the caller read it (None: asked per model)
        self.paths: dict[str, str] = {}  # model -> checkpoint directory, asked of the registry once
        self.vision: dict[str, bool] = {}  # model -> whether it takes images
        self.tokens: dict[str, tuple[str, ...]] = {}  # model -> its image tokens (none: a text model)

    def renderer(self, model: str) -> PromptRenderer:
        path = self.renderer_path(model)
        try:
            return renderer_for(str(path), self.rt.settings.sort_key_tokens)
        except Exception as exc:
            raise TokenizerUnavailable(model, str(path), exc) from exc

    def takes_images(self, model: str) -> bool:
        """Whether the model has a vision encoder (its config.json, read once); False if its files
        are missing (the tokenizer's failure says so for the file)."""
        known = self.vision.get(model)
        if known is None:
            try:
                known = checkpoint_takes_images(self.renderer_path(model))
            except TokenizerUnavailable:
                known = False
            self.vision[model] = known
        return known

    def image_tokens(self, model: str) -> tuple[str, ...]:
        """The model's image tokens (``workers.image_tokens``, read once); none for a text model,
        or one whose files are missing (the tokenizer's failure says so for the file)."""
        known = self.tokens.get(model)
        if known is None:
            try:
                known = checkpoint_image_tokens(self.renderer_path(model))
            except TokenizerUnavailable:
                known = ()
            self.tokens[model] = known
        return known

    def renderer_path(self, model: str) -> str:
        path = self.paths.get(model)
        if path is None:
            try:
                entry = self.models.get(model) if self.models is not None else None
                path = self.paths[model] = checkpoint_dir(self.rt, model, entry)
            except CheckpointError as exc:  # served, but its files are missing or unreachable
                raise TokenizerUnavailable(model, str(exc.args[0]).split(":")[0], exc) from exc
        return path

    def one(self, model: str, endpoint: str, body: dict) -> RenderedPrompt:
        return self.renderer(model).render(endpoint, body)

    def many(self, model: str, endpoint: str, bodies: list[dict]) -> list[RenderedPrompt]:
        return self.renderer(model).render_many(endpoint, bodies)


def prompt_keys(rt: Runtime) -> Callable[[str, str, dict], bytes]:
    """Prompt keys only, never raising: the control worker calls this at start-up to load every
    served model's tokenizer ahead of the first batch; a tokenizer that fails is logged here and
    fails the batches of its model (``tokenizer_unavailable``) when they are validated."""
    render = PromptRenders(rt).one

    def key(model: str, endpoint: str, body: dict) -> bytes:
        try:
            return render(model, endpoint, body).key
        except (TokenizerUnavailable, KeyError) as exc:
            log.warning("no tokenizer for model %r: %s", model, exc)
            return b""

    return key


def line_error(error: RowError) -> LineError:
    """A row the Parquet decoder could not turn into a line, as the error a bad line gets."""
    return LineError(error.row, error.code, error.message, error.column)


def name_columns(errors: list[LineError], columns: tuple[str, ...]) -> list[LineError]:
    """Parquet input: errors say the row and the column they are about."""
    named = []
    for e in errors:
        if e.message.startswith("row "):
            named.append(e)
            continue
        column = column_of(e.param, columns)
        where = f"row {e.line}, column '{column}'" if column else f"row {e.line}"
        named.append(LineError(e.line, e.code, f"{where}: {e.message}", column or e.param))
    return named


def spill_dir(settings: Settings) -> str:
    path = settings.data_dir / "tmp"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


@dataclass
class SortedInput:
    """A scanned input's summary and its valid lines as sort records ``(key, line, payload)`` in
    prompt-key order. The summary is final as soon as ``rows`` exists: the sort reads the whole
    file before it gives its first record."""

    summary: ScanResult
    rows: Iterator[tuple[bytes, int, bytes]]
    empty: bool = True  # no valid line


@contextlib.contextmanager
def sorted_input(
    settings: Settings,
    store: Any,
    input_key: str,
    rules: FileRules,
    defaults: dict,
    payload: Callable[[Any], bytes],
    stats: SortStats | None = None,
    head: HeadStart | None = None,
) -> Iterator[SortedInput]:
    """Read the stored input once with ``scan_lines``'s rules and sort its valid lines by prompt
    key in bounded memory (FREIGHT_SORT_MEMORY_MB, spilled beyond). Validation (the record's
    payload: the request store row) and the dry-run estimate (a few numbers) share it, so an
    estimate reads a file exactly as its batch would be read. ``payload`` makes a valid line's
    sort payload; the spill files are removed on exit. ``head``: a validation's early slices,
    whose rows it takes before the sort sees them (``workers.head_start``)."""
    spill = spill_dir(settings)
    result = SortedInput(ScanResult(), iter(()))
    with open_requests(store, input_key, rules.endpoint, defaults, spill, decode_limits(settings)) as source:
        lines = (line_error(x) if isinstance(x, RowError) else x for x in source.lines)

        checks = FileChecks(rules.max_requests, settings.max_listed_errors)

        def records() -> Iterator[tuple[bytes, int, bytes]]:
            for item in scan_lines(lines, rules, settings.max_listed_errors, checks):
                if isinstance(item, ScanResult):
                    result.summary = item
                    return
                yield item.key, item.line, payload(item)

        ordered = sort_records(
            records() if head is None else head.records(records(), checks),
            memory_bytes=settings.sort_memory_mb * 1024 * 1024,
            spill_dir=spill,
            stats=stats,
        )
        try:
            first = next(ordered, None)  # the sort reads the whole file before its first row
            if source.parquet:
                result.summary.errors = name_columns(result.summary.errors, source.columns)
            if first is not None:
                result.rows = itertools.chain([first], ordered)
                result.empty = False
            yield result
        finally:
            ordered.close()


def write_store(
    rt: Runtime, batch_id: str, input_key: str, rules: FileRules, defaults: dict
) -> tuple[ScanResult, list[str], int]:
    """Scan the input, start its early slices (``workers.head_start``), sort the other valid rows
    by prompt key and write them as shards (only when every line is valid); the scan's summary,
    the shards' keys in order, and the rows the batch's slices hold (``conclude`` checks it)."""
    shard_keys: list[str] = []
    sort_stats = SortStats()
    head = HeadStart(rt, batch_id, write_shards)
    with sorted_input(
        rt.settings, rt.store, input_key, rules, defaults, _payload, sort_stats, head
    ) as scanned:
        if not scanned.summary.error_count:
            shard_keys = write_shards(rt, batch_id, scanned.rows)
    if sort_stats.runs_spilled:
        log.info("batch %s: %d sorted runs spilled", batch_id, sort_stats.runs_spilled)
    return scanned.summary, shard_keys, head.rows


def write_shards(
    rt: Runtime, batch_id: str, ordered: Iterable[tuple[bytes, int, bytes]], stem: str = ""
) -> list[str]:
    """Sorted records ``(key, line, payload)`` as the batch's shards, in order; their keys. The
    one-task validation and the merge of a chunked one both write through here, so the same rows
    make the same shard objects byte for byte. ``stem`` starts each name: an early slice's
    (``workers.head_start``), so its shards and the rest's never share a key."""
    settings: Settings = rt.settings
    spill = spill_dir(settings)
    per_shard = SHARD_UNITS * settings.unit_size
    shard_keys: list[str] = []
    writer: ShardWriter | None = None
    try:
        previous: bytes | None = None  # the key of the row before, across shards
        for record in ordered:
            if writer is None or writer.rows >= per_shard:
                if writer is not None:
                    writer.close()
                shard_keys.append(f"batches/{batch_id}/shards/{stem}{len(shard_keys):06d}.parquet")
                writer = ShardWriter(rt.store, shard_keys[-1], settings.unit_size, spill)
            # what the row's prompt shares with the one run before it: its predicted cache hit
            shared = 0 if previous is None else common_prefix_tokens(previous, record[0])
            previous = record[0]
            writer.add(_row(*record, shared))
        if writer is not None:
            writer.close()
            writer = None
    finally:
        if writer is not None:
            writer.abort()
    return shard_keys


class _LeaseKeeper:
    """Renews a validation's lease from a small thread every quarter lease while the file is read,
    sorted and planned (minutes for a million lines), and gives it back at the end, whatever the
    outcome: a validation that failed on an outage is free to run again at once."""

    def __init__(
        self,
        rt: Runtime,
        batch_id: str,
        token: float,
        keeper: LeaseKeeper = VALIDATION_LEASE,
        row_id: object = None,
    ) -> None:
        self.rt = rt
        self.batch_id = batch_id
        self.token = token
        # whose lease: the batch's validation, or (``VALIDATION_CHUNK_LEASE``) one of its chunks
        self.keeper = keeper
        self.row_id = batch_id if row_id is None else row_id
        self._stop = threading.Event()
        # in a copy of this context: its lines carry the batch id the task bound (storage/logs.py)
        self._thread = threading.Thread(
            target=contextvars.copy_context().run, args=(self._renew,), name=f"lease-{batch_id}", daemon=True
        )

    def __enter__(self) -> _LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        try:
            with self.rt.db.write() as s:
                self.keeper.release(s, self.row_id, self.token)
        except Exception as exc:  # the database is down: the lease runs out instead
            log.warning("batch %s: could not give back the validation lease: %s", self.batch_id, exc)

    def _renew(self) -> None:
        while not self._stop.wait(self.rt.settings.lease_seconds / 4):
            renewed = time.time()
            try:
                with self.rt.db.write() as s:
                    held = self.keeper.renew(s, self.row_id, self.token, renewed)
            except Exception as exc:  # a blip: the next beat tries again, well within the lease
                log.warning("batch %s: renewing the validation lease failed: %s", self.batch_id, exc)
                continue
            if not held:  # ran out and taken over; only one of us commits (from validating)
                log.warning("batch %s: another validation took over the lease", self.batch_id)
                return
            self.token = renewed


def tenant_turns_taken(
    s: Session,
    settings: Settings,
    tenant_id: str,
    now: float,
    batch_id: str | None = None,
    estimate_id: str | None = None,
) -> int:
    """The tenant's turns of the validation pool taken now (at most FREIGHT_TENANT_VALIDATIONS):
    its batches' validations holding a live lease (a batch validated in chunks holds its own only
    while it sends them and merges, and a chunk's lease meanwhile) and its dry runs' estimates
    holding one (``workers.estimates``), other than ``batch_id``'s and ``estimate_id``'s. Both
    kinds run on the validation role, so one limit covers both. Exact when the caller holds the
    tenant's row lock, which a racing turn of the same tenant waits for."""
    validations = s.scalar(
        select(func.count())
        .select_from(Batch)
        .where(
            Batch.tenant_id == tenant_id,
            Batch.status == BatchStatus.VALIDATING,
            Batch.id != (batch_id or ""),
            or_(
                ~VALIDATION_LEASE.free(now, settings.lease_seconds),
                exists().where(
                    ValidationChunk.batch_id == Batch.id,
                    ~VALIDATION_CHUNK_LEASE.free(now, settings.lease_seconds),
                ),
            ),
        )
    )
    estimates = s.scalar(
        select(func.count())
        .select_from(Estimate)
        .where(
            Estimate.tenant_id == tenant_id,
            Estimate.status == EstimateStatus.VALIDATING,
            Estimate.id != (estimate_id or ""),
            ~ESTIMATE_LEASE.free(now, settings.lease_seconds),
        )
    )
    return int(validations or 0) + int(estimates or 0)


def _tenant_wait(s: Session, settings: Settings, batch_id: str, now: float) -> float | None:
    """None if the batch's tenant may start another validation (FREIGHT_TENANT_VALIDATIONS, its
    running estimates counted too), else the seconds to wait; the batch then notes the wait as its
    next delivery due, so the tick sends no copy of its own meanwhile. Locks the batch, then its
    tenant (the order the commit of a validation takes them in): two validations of one tenant
    never both take the last turn."""
    batch = s.get(Batch, batch_id, with_for_update=True)
    if batch is None or batch.status != BatchStatus.VALIDATING:
        return None  # nothing to validate: VALIDATION_LEASE.take says so
    s.get(Tenant, batch.tenant_id, with_for_update=True)
    running = tenant_turns_taken(s, settings, batch.tenant_id, now, batch_id=batch_id)
    wait = validation_wait(running, settings.tenant_validations)
    if wait is not None:
        s.execute(update(Batch).where(Batch.id == batch_id).values(validation_due_at=now + wait))
    return wait


InChunks = Callable[[Runtime, str, str, str, dict], bool]
"""(rt, batch_id, input key, endpoint, defaults) -> False if the input is validated in one task."""


def validate_batch(rt: Runtime, batch_id: str, in_chunks: InChunks | None = None) -> float | None:
    """Validate a ``validating`` batch; the dispatcher queues its units after this commits.

    Runs under the batch's validation lease (compare-and-set): a delivery that finds a fresh lease
    leaves the work to its holder; the dispatcher's tick sends validation again once it runs out.
    Returns the seconds to wait, having done nothing, when the batch's tenant already runs
    FREIGHT_TENANT_VALIDATIONS validations (the task sends itself again after that long).

    ``in_chunks``: how a large input is validated across control processes; the task passes
    ``validation_chunks.validate_in_chunks`` (which builds on this module), so every batch a
    broker carries is chunked past FREIGHT_VALIDATION_CHUNK_BYTES. None: one task, in-process."""
    settings: Settings = rt.settings
    now = time.time()
    with rt.db.write() as s:
        wait = _tenant_wait(s, settings, batch_id, now)
        if wait is not None:
            return wait
        taken = VALIDATION_LEASE.take(s, batch_id, now, Batch.status == BatchStatus.VALIDATING,
                                      now=now, lease_seconds=settings.lease_seconds)  # fmt: skip
        if not taken:
            return None  # validated already (task re-delivered), cancelled, or another validation runs
        batch = s.get(Batch, batch_id)
        assert batch is not None  # its lease was just taken
        input_key = s.get(StoredFile, batch.input_file_id).object_key  # type: ignore[union-attr]
        endpoint = batch.endpoint
        defaults = metadata_defaults(batch.metadata_)
    with _LeaseKeeper(rt, batch_id, now):
        if in_chunks is None or not in_chunks(rt, batch_id, input_key, endpoint, defaults):
            _validate(rt, batch_id, input_key, endpoint, defaults)
    return None


def file_rules(
    rt: Runtime, endpoint: str, tenant_id: str | None = None, batch_id: str | None = None
) -> FileRules:
    """The rules of a file of ``tenant_id`` (None: no tenant, so no adapter restricted to some);
    with ``batch_id`` too, the images of its chat lines, and the audio its audio lines name by
    file id, are checked and stored for that batch."""
    settings: Settings = rt.settings
    models = catalog(rt.db, settings)  # one read of the registry answers every question below
    renders = PromptRenders(rt, models)
    images = None
    if batch_id is not None and tenant_id is not None and endpoint in (CHAT, RESPONSES, *AUDIO_ENDPOINTS):
        # an audio batch's data URLs are stored once per content too, JSONL's as Parquet's
        images = ImageResolver(rt, batch_id, tenant_id, renders.takes_images, endpoint in AUDIO_ENDPOINTS)
    return FileRules(
        images=images,
        endpoint=endpoint,
        served_models=models.names(),
        embed_models=models.names(EMBED),
        score_models=models.names(SCORE),
        speech_models=models.names(TRANSCRIBE),
        max_requests=settings.max_requests_per_file,
        max_line_bytes=settings.max_line_bytes,
        render=renders.one,
        render_many=renders.many,
        auto_tool_models=models.auto_tool,
        reasoning_models=models.reasoning,
        adapters=usable_adapters(rt.db, tenant_id),
        image_tokens=renders.image_tokens,
        default_max_tokens=settings.engine_default_max_tokens,
    )


def batch_rules(rt: Runtime, endpoint: str, batch_id: str) -> FileRules:
    """The rules of a batch's input file: its tenant's adapters, its own image store, and for a
    resume the lines the batch it resumes settled, skipped (``workers.resume``)."""
    rules = file_rules(rt, endpoint, batch_tenant(rt, batch_id), batch_id)
    with rt.db.read() as s:
        earlier = s.scalar(select(Batch.resumed_from).where(Batch.id == batch_id))
    return rules if earlier is None else replace(rules, skip=settled(rt, earlier))


def batch_tenant(rt: Runtime, batch_id: str) -> str | None:
    """The tenant of a batch: whose adapters its lines may name."""
    with rt.db.read() as s:
        return s.scalar(select(Batch.tenant_id).where(Batch.id == batch_id))


def tokenizer_failure(batch_id: str, message: str) -> ScanResult:
    """A model whose tokenizer cannot be loaded fails the file as a whole (line 0: no line)."""
    log.error("batch %s: %s", batch_id, message)
    summary = ScanResult()
    summary.error_count = 1
    summary.errors.append(LineError(0, "tokenizer_unavailable", message[:1000], "body.model"))
    return summary


def _validate(rt: Runtime, batch_id: str, input_key: str, endpoint: str, defaults: dict) -> None:
    started = time.monotonic()
    try:
        rules = batch_rules(rt, endpoint, batch_id)
        summary, shard_keys, sliced_rows = write_store(rt, batch_id, input_key, rules, defaults)
    except TokenizerUnavailable as exc:
        summary, shard_keys, sliced_rows = tokenizer_failure(batch_id, str(exc)), [], 0
    conclude(rt, batch_id, summary, shard_keys, started, sliced_rows)


def error_list(summary: ScanResult) -> dict[str, Any]:
    """A failed file's errors as the batch object shows them: the listed lines, then a count of
    the rest when the cap (FREIGHT_MAX_LISTED_ERRORS) left some out."""
    data = [e.as_openai() for e in summary.errors]
    if summary.errors and summary.errors[0].line == 0:  # not about a line: the whole file
        data[0]["line"] = None
    if summary.error_count > len(data):
        data.append(
            {
                "code": "too_many_errors",
                "message": f"{summary.error_count} lines failed validation; the first {len(data)} are listed",
                "param": None,
                "line": None,
            }
        )
    return {"object": "list", "data": data}


def conclude(
    rt: Runtime,
    batch_id: str,
    summary: ScanResult,
    shard_keys: list[str],
    started: float,
    sliced_rows: int = 0,
) -> None:
    """Plan the shards into units and commit the outcome from ``validating``: ``in_progress`` with
    its units, or ``failed`` with its errors (or refused by quota or admission). ``sliced_rows``:
    the rows of the early slices this run counted, whose units exist already
    (``workers.head_start``); the shards hold the others. If the batch's slices are no longer
    those (another run of its validation started one), this run commits nothing."""
    settings: Settings = rt.settings
    # what validation stored (shards, images, audio) counts in the tenant's stored bytes
    charge_listed(rt, batch_id, validated_prefixes(batch_id))
    units = []
    if not summary.error_count:
        block = prediction_block_size(rt, summary.model or "", kv_block_size(settings.engine_block_size))
        units = plan_batch(rt.store, shard_keys, settings, block_size=block)
    log.info(
        "validated %s: %d requests, %d errors, %d units in %.2fs",
        batch_id,
        summary.rows,
        summary.error_count,
        len(units),
        time.monotonic() - started,
    )

    now = int(time.time())
    rates = measured_throughput(rt, now) if not summary.error_count else {}
    with rt.db.write() as s:
        batch = s.get(Batch, batch_id, with_for_update=True)
        if batch is None or batch.status != BatchStatus.VALIDATING:
            return
        prior = sliced(s, batch_id)
        if not summary.error_count and prior.rows != sliced_rows:
            log.warning(
                "batch %s: another validation run started slices; it concludes, not this one", batch_id
            )
            return
        admission = None
        # the quota counts what the lines ask for: a line's n sequences, inputs or pairs
        over_quota = (
            None if summary.error_count else queued_refusal(s, settings, batch, prior.asked + asked(units))
        )
        if not summary.error_count and over_quota is None:
            admission = admit_batch(rt, s, batch, summary.model or "", summary.rows, now, rates)
        if over_quota is not None:  # the tenant's other batches hold its queue already
            fail_validating(s, batch, _refusal("quota_exceeded", over_quota), now)
            log.warning("batch %s refused: %s", batch_id, over_quota)
        elif admission is not None and not admission.accept:
            refusal = _refusal("sla_unattainable", admission.warning, "completion_window")
            fail_validating(s, batch, refusal, now)
            log.warning("batch %s refused: %s", batch_id, admission.warning)
        elif summary.error_count:
            fail_validating(s, batch, error_list(summary), now)
        else:
            batch.model = summary.model
            batch.request_total = summary.rows
            # the plan's prediction, fixed with the units (their rows never change)
            batch.planned_prompt_tokens = prior.prompt_tokens + sum(unit.prompt_tokens for unit in units)
            batch.planned_cached_tokens = prior.cached_tokens + sum(unit.cached_tokens for unit in units)
            s.add_all(unit_rows(batch_id, summary.model or "", units, prior.units))
            if admission is not None and admission.warning:
                batch.warnings = [admission.warning]
            transition(batch, BatchStatus.IN_PROGRESS, now)


def _refusal(code: str, message: str | None, param: str | None = None) -> dict[str, Any]:
    """A batch's errors when the whole of it was refused: one error, about no line."""
    return {"object": "list", "data": [{"code": code, "message": message, "param": param, "line": None}]}
