"""Freight's OpenAPI 3.1 document: the /v1 routes, their bodies and every error they answer.

Built as a dict on request (nothing at import) from the settings, so the completion windows it
lists are the ones this deployment accepts. ``tests/api/test_openapi.py`` keeps it in step with the
Flask routes and Schemathesis checks the real responses against it.
"""

from __future__ import annotations

from typing import Any

from api.request_ids import PATTERN as REQUEST_ID_PATTERN
from storage.settings import Settings
from workers.request_bodies import ENDPOINTS

JSON = "application/json"
Schema = dict[str, Any]


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def obj(properties: dict[str, Schema], *, optional: tuple[str, ...] = ()) -> Schema:
    """A closed object whose fields are all required unless named optional."""
    return {
        "type": "object",
        "properties": properties,
        "required": [k for k in properties if k not in optional],
        "additionalProperties": False,
    }


INT = {"type": "integer"}
NUM = {"type": "number"}
STR = {"type": "string"}
BOOL = {"type": "boolean"}
TIME = {"type": "integer", "description": "Unix seconds"}

ERROR = obj(
    {
        "error": obj(
            {
                "message": STR,
                "type": STR,
                "param": nullable(STR),
                "code": nullable(STR),
            }
        )
    }
)

FILE = obj(
    {
        "id": STR,
        "object": {"const": "file"},
        "bytes": INT,
        "created_at": TIME,
        "expires_at": nullable(TIME),
        "filename": STR,
        "purpose": {"enum": ["batch", "batch_output", "vision", "user_data"]},
        "status": {"enum": ["uploaded", "processed", "error"]},
        "status_details": nullable(STR),
    }
)

# OpenAI's expires_after.seconds: an hour to 30 days (workers/intake.py checks the same)
EXPIRES_SECONDS = {"type": "integer", "minimum": 3600, "maximum": 2592000}

UPLOAD = obj(
    {
        "id": STR,
        "object": {"const": "upload"},
        "bytes": INT,
        "created_at": TIME,
        "expires_at": TIME,
        "filename": STR,
        "purpose": {"enum": ["batch"]},
        "status": {"enum": ["pending", "completed", "cancelled", "expired"]},
        "file": nullable(ref("File")),
    }
)
UPLOAD_PART = obj({"id": STR, "object": {"const": "upload.part"}, "created_at": TIME, "upload_id": STR})

DELETED_FILE = obj({"id": STR, "object": {"const": "file"}, "deleted": {"const": True}})

LINE_ERROR = obj({"code": nullable(STR), "message": STR, "param": nullable(STR), "line": nullable(INT)})
# a batch's or an estimate's errors: the file's bad lines (or one error about the whole file)
ERROR_LIST = obj({"object": {"const": "list"}, "data": {"type": "array", "items": LINE_ERROR}})

COST = obj(
    {
        "currency": {"const": "usd"},
        "engine_seconds": NUM,
        "engine_cost": NUM,
        "price_multiplier": NUM,
        "total": NUM,
        "per_1m_tokens": obj({k: nullable(NUM) for k in ("input", "cached_input", "output", "all")}),
        "list_price": nullable(NUM),
        "saving": nullable(NUM),
    }
)

# workers/resume.py's chain_usage: a resume's figures summed over its chain of batches
CHAIN_USAGE = obj(
    {
        "batches": INT,
        "request_completed": INT,
        "input_tokens": INT,
        "cached_tokens": INT,
        "output_tokens": INT,
        "total_tokens": INT,
        "engine_seconds": NUM,
        "cost_micros": INT,
    }
)

BATCH_STATUS = [
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled",
]  # fmt: skip

BATCH = obj(
    {
        "id": STR,
        "object": {"const": "batch"},
        "endpoint": STR,
        "model": nullable(STR),
        "errors": nullable(ERROR_LIST),
        "input_file_id": STR,
        "completion_window": STR,
        "status": {"enum": BATCH_STATUS},
        "output_file_id": nullable(STR),
        "error_file_id": nullable(STR),
        "created_at": TIME,
        **{
            f"{k}_at": nullable(TIME)
            for k in (
                "in_progress",
                "finalizing",
                "completed",
                "failed",
                "expired",
                "cancelling",
                "cancelled",
            )
        },
        "expires_at": TIME,
        "request_counts": obj({"total": INT, "completed": INT, "failed": INT}),
        "metadata": nullable({"type": "object", "additionalProperties": STR}),
        "usage": obj(
            {
                "input_tokens": INT,
                "input_tokens_details": obj({"cached_tokens": INT}),
                "output_tokens": INT,
                "output_tokens_details": obj({"reasoning_tokens": INT}),
                "total_tokens": INT,
            }
        ),
        "x_freight": obj(
            {
                "priority": {"type": "integer", "minimum": -100, "maximum": 100},
                "deadline": TIME,
                "eta": nullable(TIME),
                "at_risk": BOOL,
                "at_risk_since": nullable(TIME),
                "sla_met": nullable(BOOL),
                "warnings": {"type": "array", "items": STR},
                "cache_hit_rate": nullable(NUM),
                "planned_cache_hit_rate": nullable(NUM),
                "cost": ref("Cost"),
                "resumed_from": {
                    **nullable(STR),
                    "description": "the batch this one resumes (`resume_from`): it runs only the lines that "
                    "one left without a result worth keeping, and its files carry that one's",
                },
                "chain_usage": {
                    **nullable(CHAIN_USAGE),
                    "description": "a resume's usage and cost summed over it and every batch it resumes, "
                    "once it has ended (each batch's own usage and cost stay its own)",
                },
            }
        ),
    }
)

RANGE = obj({"low": NUM, "high": NUM})
UNKNOWN = {"const": "unknown", "description": "no recent history of the model to measure it from"}
ESTIMATE_RESULT = obj(
    {
        "requests": INT,
        "input_tokens": {**INT, "description": "prompt tokens, as validation counts them"},
        "input_tokens_lower_bound_requests": {
            **INT,
            "description": "requests whose prompt length is a lower bound (the engine renders them itself)",
        },
        "cached_input_tokens": {**INT, "description": "prompt tokens the prefix-sorted plan predicts cached"},
        "cache_hit_rate": nullable(NUM),
        "kv_block_size": INT,
        "output_tokens": obj({"max": INT, "typical": nullable(INT), "typical_per_request": nullable(NUM)}),
        "history": obj(
            {
                "window_seconds": NUM,
                "tokens_per_second": nullable(NUM),
                "engines": INT,
                # the fitted engine model (scheduler/estimate.py); null: priced at the one rate
                "seconds_per_million": nullable(
                    obj({"uncached_input_tokens": NUM, "output_tokens": NUM, "kv_entries_read": NUM})
                ),
            }
        ),
        "engine_seconds": {"anyOf": [RANGE, UNKNOWN]},
        "eta_seconds": {"anyOf": [obj({"low": NUM, "high": NUM, "engines": INT}), UNKNOWN]},
        "cost": obj(
            {
                "currency": {"const": "usd"},
                "price_multiplier": NUM,
                "instance_price_per_hour": NUM,
                "total": {"anyOf": [RANGE, UNKNOWN]},
                "list_price": nullable(RANGE),
            }
        ),
        # what images and audio add to input_tokens (workers/media_tokens.py); only when a line has any
        "media": obj(
            {
                "images": {**INT, "description": "image parts counted by their size"},
                "image_links": {**INT, "description": "links (not fetched): the model's largest image each"},
                "images_refused": {**INT, "description": "parts the batch would refuse: counted as nothing"},
                "images_not_counted": {**INT, "description": "parts of a model whose processor failed here"},
                "image_tokens": INT,
                "audio_lines": INT,
                "audio_refused": {**INT, "description": "audio the engine would refuse: counted as nothing"},
                "audio_seconds": NUM,
                "audio_tokens": INT,
            }
        ),
        # the tenant's monthly spend budget (scheduler/budgets.py); only when it has one
        "budget": obj(
            {
                "period": {**STR, "description": "the UTC calendar month, YYYY-MM"},
                "monthly_usd": NUM,
                "spent_usd": NUM,
                "remaining_usd": NUM,
                "soft": BOOL,
                "fits": {
                    **nullable(BOOL),
                    "description": "true: cost.total.high fits what is left; false: even cost.total.low"
                    " does not; null: in between, or the cost is unknown",
                },
            }
        ),
    },
    optional=("media", "budget"),
)
ESTIMATE = obj(
    {
        "id": {**STR, "description": "estimate_…: retrieve it at /v1/batches/{id}"},
        "object": {"const": "batch.estimate"},
        "endpoint": STR,
        "model": nullable(STR),
        "errors": nullable(ERROR_LIST),
        "input_file_id": STR,
        "completion_window": STR,
        "status": {"enum": ["validating", "completed", "failed"]},
        "created_at": TIME,
        "completed_at": nullable(TIME),
        "failed_at": nullable(TIME),
        "metadata": nullable({"type": "object", "additionalProperties": STR}),
        "estimate": nullable(ESTIMATE_RESULT),
    }
)

MODEL = obj(
    {
        "id": STR,
        "object": {"const": "model"},
        "created": INT,
        "owned_by": STR,
        "x_freight": obj(
            {
                "quantization": STR,
                # its engine's task (storage/registry.py)
                "task": {"enum": ["generate", "embed", "score", "transcribe"]},
                "max_model_len": nullable(INT),
                "parameters": nullable(INT),
                "weight_bytes": nullable(INT),
                "tool_call_parser": nullable(STR),  # serves tool_choice "auto"
                "reasoning_parser": nullable(STR),  # message.reasoning; Responses `reasoning`
                "instance_price_per_hour": nullable(NUM),
                "list_price_per_1m": nullable(obj({"input": NUM, "cached_input": NUM, "output": NUM})),
            }
        ),
    }
)

# a LoRA adapter, served as a model id of its own (storage/adapters.py): `parent` is its base model,
# as vLLM's server lists adapters
ADAPTER = obj(
    {
        "id": STR,
        "object": {"const": "model"},
        "created": INT,
        "owned_by": STR,
        "parent": STR,
        "x_freight": obj(
            {"task": {"const": "generate"}, "adapter": {"const": True}, "base": STR, "lora_rank": INT}
        ),
    }
)
MODEL_OR_ADAPTER = {"anyOf": [ref("Model"), ref("Adapter")]}


WEBHOOK_EVENTS = ["batch.completed", "batch.failed", "batch.cancelled", "batch.expired"]
WEBHOOK_ENDPOINT = obj(
    {
        "id": STR,
        "object": {"const": "webhook_endpoint"},
        "url": STR,
        "events": {"type": "array", "items": {"enum": WEBHOOK_EVENTS}},
        "status": {"enum": ["active", "disabled"]},
        "status_at": TIME,
        "disabled_reason": nullable(STR),
        "created_at": TIME,
        "previous_secret_expires_at": nullable(TIME),
        "secret": {
            "type": "string",
            "description": "whsec_<base64>: only in the answer that created or rotated it",
        },
    },
    optional=("secret",),
)
WEBHOOK_DELIVERY = obj(
    {
        "id": STR,
        "object": {"const": "webhook_delivery"},
        "endpoint_id": STR,
        "event": obj({"id": STR, "type": {"enum": WEBHOOK_EVENTS}, "created_at": TIME, "batch_id": STR}),
        "status": {"enum": ["pending", "delivered", "failed"]},
        "status_at": TIME,
        "attempts": INT,
        "next_attempt_at": nullable(TIME),
        "last_attempt_at": nullable(TIME),
        "last_status_code": nullable(INT),
        "last_error": nullable(STR),
    }
)


def list_of(item: str) -> Schema:
    return obj({"object": {"const": "list"}, "data": {"type": "array", "items": ref(item)}, "has_more": BOOL})


def page_of(item: str) -> Schema:
    return obj(
        {
            "object": {"const": "list"},
            "data": {"type": "array", "items": ref(item)},
            "first_id": nullable(STR),
            "last_id": nullable(STR),
            "has_more": BOOL,
        }
    )


CREATE_BATCH_403 = (
    "`quota_exceeded`: the tenant has its limit of open batches or queued requests, or stores more"
    " than its limit of bytes; `budget_exceeded`: its hard monthly spend budget is spent (batches"
    " already accepted run on)."
)
ERRORS = {
    400: "The request is malformed or names a value Freight does not accept.",
    401: "Missing, malformed or unknown API key.",
    403: "A quota of the tenant's does not allow it (`quota_exceeded`: stored bytes, parts included).",
    404: "No such object for this tenant (another tenant's ids answer the same), or no such URL.",
    409: "The object's state does not allow this (a running batch's input, a finished batch).",
    413: "The request body or the uploaded file is larger than this deployment accepts.",
    429: "Too many requests for this tenant; retry after `Retry-After` seconds.",
}


def error_response(status: int, note: str = "") -> Schema:
    description = f"{ERRORS[status]} {note}" if note else ERRORS[status]
    response: Schema = {"description": description, "content": {JSON: {"schema": ref("Error")}}}
    if status == 429:
        response["headers"] = {
            "Retry-After": {
                "description": "Seconds to wait before the next request.",
                "required": True,
                "schema": {"type": "integer", "minimum": 0},
            }
        }
    return response


def ok(schema: Schema, description: str = "OK") -> Schema:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def operation(
    op_id: str,
    summary: str,
    response: Schema,
    *errors: int,
    params: tuple[Schema, ...] = (),
    notes: dict[int, str] | None = None,
    **extra: Any,
) -> Schema:
    """An authenticated /v1 operation: every one may also answer 401, 413 and 429. ``notes``: what
    an error status means for this operation beyond its general description (its `code`s)."""
    statuses = sorted({*errors, 401, 413, 429})
    notes = notes or {}
    return {
        "operationId": op_id,
        "summary": summary,
        **({"parameters": list(params)} if params else {}),
        **extra,
        "responses": {"200": response, **{str(s): error_response(s, notes.get(s, "")) for s in statuses}},
    }


def download_operation(content_types: Schema) -> Schema:
    """GET /v1/files/{id}/content: also 202 while the control worker converts the file."""
    download = operation(
        "downloadFile",
        "A file's bytes, as stored or converted to the other format. A conversion is made once by "
        "the control worker and kept: until it is made the answer is 202 with `Retry-After`.",
        {"description": "The file's bytes.", "content": content_types},
        400,
        404,
        params=(
            FILE_ID,
            query("format", "Convert to this format.", {"enum": ["jsonl", "parquet"]}),
            ORDER,
        ),
        notes={
            400: "A conversion refused (`error.code` says why: a Parquet file past the decode "
            "limits, say) answers the same 400 on every later download."
        },
    )
    download["responses"]["202"] = {
        "description": "The file is being converted to `format`; ask again after `Retry-After` seconds.",
        "headers": {"Retry-After": {"description": "Seconds to wait.", "required": True,
                                    "schema": {"type": "integer", "minimum": 0}}},
        "content": {JSON: {"schema": {"type": "object", "properties": {
            "object": {"enum": ["file.content"]}, "id": STR, "format": {"enum": ["jsonl", "parquet"]},
            "status": {"enum": ["preparing"]}, "message": STR}}}},
    }  # fmt: skip
    return download


CREATE_BATCH_400 = (
    "Its `error.code` says which: `invalid_endpoint` (not one of the endpoint enum), "
    "`endpoint_not_served` (no model of this deployment serves the endpoint: an embedding model "
    "serves /v1/embeddings, /v1/score and /v1/rerank, a cross-encoder /v1/score and /v1/rerank, "
    "a speech model /v1/audio/transcriptions and /v1/audio/translations, "
    "a text-generation model every other endpoint; the message names "
    "the models there are), `batch_not_resumable` (`resume_from` names a batch not ended, or "
    "whose result files are gone), `nothing_to_resume` (no line of it is worth running again), "
    "else none, with `param` naming the field. A line of "
    "the file that is wrong is not an error here: the file is read after create, and its errors "
    "fail the batch (`errors.data`) or are that line's error result."
)


def path_param(name: str, description: str, pattern: str = "^[A-Za-z0-9_-]+$") -> Schema:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": description,
        "schema": {"type": "string", "minLength": 1, "maxLength": 200, "pattern": pattern},
    }


def query(name: str, description: str, schema: Schema) -> Schema:
    return {"name": name, "in": "query", "required": False, "description": description, "schema": schema}


AFTER = query("after", "An object id: list the objects after it (cursor pagination).", STR)
FILE_ID = path_param("file_id", "A file id (`file-…`).")
BATCH_ID = path_param("batch_id", "A batch id (`batch_…`).")
ENDPOINT_ID = path_param("endpoint_id", "A webhook endpoint id (`whep_…`).")
UPLOAD_ID = path_param("upload_id", "An upload id (`upload_…`).")
MODEL_ID = path_param("model", "A served model's name; it may contain `/`.", "^[A-Za-z0-9._:/-]+$")


ORDER = query(
    "order",
    "input: the lines in the input file's line order (a batch's output and error files); "
    "left out: the stored order (prompt-sorted).",
    {"enum": ["input"]},
)
RESULTS_HEADERS: Schema = {
    "x-freight-next-cursor": {
        "description": "The cursor that covers these lines and every earlier response's: `after` of the next request.",
        "required": True,
        "schema": {"type": "string"},
    },
    "x-freight-results-complete": {
        "description": "true once no unit of the batch will be recorded any more (it is finalizing or "
        "ended): the next request with this cursor returns nothing.",
        "required": True,
        "schema": {"enum": ["true", "false"]},
    },
}


IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "description": "Makes the create safe to retry: the same key with the same request (method, path, "
    "body) within 24 hours answers the first answer again (same ids, `Idempotent-Replayed: true`) "
    "and makes nothing; with another request, 409 `idempotency_key_reused`; while the first is "
    "running, 409 `idempotency_key_in_use`. Keys are the tenant's own; a refused request frees its key. "
    "If the first request's process died after its create committed, a retry answers the object it "
    "made as it is now (same ids, `Idempotent-Replayed: true`) and makes nothing.",
    "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[^\\x00-\\x1f\\x7f-\\x9f]+$"},
}
IDEMPOTENCY_409 = (
    "With `Idempotency-Key`: `idempotency_key_reused` (the key was used with another request) or "
    "`idempotency_key_in_use` (a request with the key is still running)."
)
REPLAYED = {
    "Idempotent-Replayed": {
        "description": "`true` on the answer of a retry with an `Idempotency-Key`: the first answer "
        "again, or the object the first request made, as it is now, if it died before answering.",
        "required": False,
        "schema": {"enum": ["true"]},
    }
}


def replayable(schema: Schema) -> Schema:
    """A create's 200: it may be the replay of an earlier answer (``Idempotency-Key``)."""
    return {**ok(schema), "headers": dict(REPLAYED)}


def create_batch_body(settings: Settings) -> Schema:
    return obj(
        {
            "input_file_id": {"type": "string", "minLength": 1},
            "endpoint": {
                "enum": list(ENDPOINTS),
                "description": "One of these that a model of this deployment serves (see "
                "`GET /v1/models`: a model's task); another answers 400 `endpoint_not_served`",
            },
            "completion_window": {
                "enum": [t.window for t in settings.sla_tiers],
                "default": settings.default_window,
            },
            "metadata": nullable(
                {
                    "type": "object",
                    "maxProperties": 16,
                    "propertyNames": {"maxLength": 64},
                    "additionalProperties": {"type": "string", "maxLength": 512},
                }
            ),
            "priority": {"type": "integer", "minimum": -100, "maximum": 100, "default": 0},
            "output_expires_after": obj({"anchor": {"enum": ["created_at"]}, "seconds": EXPIRES_SECONDS}),
            "dry_run": {
                "type": "boolean",
                "default": False,
                "description": "true: validate the file and answer a batch.estimate (polled at "
                "/v1/batches/{id}) instead of making a batch; nothing runs",
            },
            "resume_from": {
                "type": "string",
                "description": "Freight's extension: a batch of yours that has ended, resumed: the new "
                "batch runs only the lines it left without a result worth keeping (not run, or an "
                "engine error, timeout or rate limit; not a 4xx), on its input file (input_file_id "
                "and endpoint may then be omitted); its output file holds the earlier results too. "
                "400 `batch_not_resumable` or `nothing_to_resume` says why one cannot be",
            },
        },
        optional=(
            "completion_window",
            "metadata",
            "priority",
            "output_expires_after",
            "dry_run",
            "resume_from",
        ),
    )


def paths(settings: Settings) -> Schema:
    upload_body = {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": obj(
                    {
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": "JSONL or Parquet (batch); an image or audio a batch line"
                            " names by file id (vision, user_data)",
                        },
                        "purpose": {"enum": ["batch", "vision", "user_data"]},
                        "expires_after[anchor]": {"enum": ["created_at"]},
                        "expires_after[seconds]": EXPIRES_SECONDS,
                    },
                    optional=("expires_after[anchor]", "expires_after[seconds]"),
                )
            }
        },
    }
    content_types = {
        media: {"schema": {"type": "string", "format": "binary"}}
        for media in ("application/jsonl", "application/vnd.apache.parquet")
    }
    return {
        "/v1/files": {
            "post": operation(
                "uploadFile",
                "Upload a batch input file (streamed to the object store).",
                replayable(ref("File")),
                400,
                409,
                params=(IDEMPOTENCY_KEY,),
                notes={409: IDEMPOTENCY_409},
                requestBody=upload_body,
            ),
            "get": operation(
                "listFiles",
                "The tenant's files, newest first.",
                ok(page_of("File")),
                400,
                params=(
                    query("purpose", "Only files of this purpose.", STR),
                    AFTER,
                    query("limit", "Page size.", {"type": "integer", "minimum": 1, "maximum": 10_000}),
                ),
            ),
        },
        "/v1/files/{file_id}": {
            "get": operation("retrieveFile", "One file.", ok(ref("File")), 404, params=(FILE_ID,)),
            "delete": operation(
                "deleteFile",
                "Delete a file that no running batch reads.",
                ok(ref("DeletedFile")),
                404,
                409,
                params=(FILE_ID,),
            ),
        },
        "/v1/files/{file_id}/content": {"get": download_operation(content_types)},
        "/v1/batches": {
            "post": operation(
                "createBatch",
                "Create a batch from an uploaded file; it is validated asynchronously. With "
                "`dry_run: true`, a batch.estimate instead: no batch is made and nothing runs.",
                replayable({"anyOf": [ref("Batch"), ref("Estimate")]}),
                400,
                403,
                404,
                409,
                params=(IDEMPOTENCY_KEY,),
                notes={400: CREATE_BATCH_400, 403: CREATE_BATCH_403, 409: IDEMPOTENCY_409},
                requestBody={"required": True, "content": {JSON: {"schema": create_batch_body(settings)}}},
            ),
            "get": operation(
                "listBatches",
                "The tenant's batches, newest first.",
                ok(page_of("Batch")),
                400,
                params=(
                    AFTER,
                    query("limit", "Page size.", {"type": "integer", "minimum": 1, "maximum": 100}),
                ),
            ),
        },
        "/v1/batches/{batch_id}": {
            "get": operation(
                "retrieveBatch",
                "One batch, or one estimate (an id `estimate_…` a dry run answered).",
                ok({"anyOf": [ref("Batch"), ref("Estimate")]}),
                404,
                params=(BATCH_ID,),
            ),
        },
        "/v1/batches/{batch_id}/results": {
            "get": operation(
                "listBatchResults",
                "Freight's extension: the output (or error) lines of the batch's units recorded so far, "
                "while it runs and after; each line as the final file will hold it. Pass the previous "
                "response's `x-freight-next-cursor` as `after` to get only units recorded since.",
                {"description": "The lines.", "content": content_types, "headers": RESULTS_HEADERS},
                400,
                404,
                params=(
                    BATCH_ID,
                    query(
                        "kind",
                        "Which lines: output (default), errors, or all.",
                        {"enum": ["output", "errors", "all"]},
                    ),
                    query(
                        "after",
                        "A cursor an earlier results response gave (`x-freight-next-cursor`).",
                        {"type": "string", "pattern": "^r1\\.[A-Za-z0-9_-]*$"},
                    ),
                    query("format", "jsonl (default) or parquet.", {"enum": ["jsonl", "parquet"]}),
                    ORDER,
                ),
            ),
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": operation(
                "cancelBatch",
                "Cancel a validating or running batch.",
                ok(ref("Batch")),
                404,
                409,
                params=(BATCH_ID,),
            ),
        },
        "/v1/models": {
            "get": operation(
                "listModels",
                "The served models, then the LoRA adapters the tenant may use.",
                ok(obj({"object": {"const": "list"}, "data": {"type": "array", "items": MODEL_OR_ADAPTER}})),
            ),
        },
        "/v1/models/{model}": {
            "get": operation(
                "retrieveModel", "One served model or adapter.", ok(MODEL_OR_ADAPTER), 404, params=(MODEL_ID,)
            ),
        },
        **upload_paths(),
        **webhook_paths(),
        "/healthz": {
            "get": {
                "operationId": "health",
                "summary": "Liveness.",
                "security": [],
                "responses": {"200": ok(obj({"status": {"const": "ok"}}))},
            }
        },
    }


UPLOAD_400 = (
    "Its `error.code` says which: `upload_completed`, `upload_cancelled` or `upload_expired` (the "
    "upload takes no more parts and cannot be completed), `unknown_part` (a part id not of this "
    "upload), `bytes_mismatch` (the parts named do not sum to the create's `bytes`), "
    "`md5_mismatch`, `upload_parts_exceed_bytes`; else none, with `param` naming the field."
)


def upload_paths() -> Schema:
    """OpenAI's Uploads API: a file of up to FREIGHT_MAX_UPLOAD_BYTES in parts of up to 64 MiB."""
    part_body = {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": obj(
                    {"data": {"type": "string", "format": "binary", "description": "at most 64 MiB"}}
                )
            }
        },
    }
    create_body = obj(
        {
            "bytes": {"type": "integer", "minimum": 1},
            "filename": {"type": "string", "minLength": 1},
            "purpose": {"enum": ["batch"]},
            "mime_type": {"type": "string", "description": "text/jsonl, application/jsonl, ... or Parquet's"},
            "expires_after": obj({"anchor": {"enum": ["created_at"]}, "seconds": EXPIRES_SECONDS}),
        },
        optional=("expires_after",),
    )
    complete_body = obj(
        {
            "part_ids": {"type": "array", "items": STR, "minItems": 1},
            "md5": {"type": "string", "pattern": "^[0-9a-fA-F]{32}$"},
        },
        optional=("md5",),
    )
    return {
        "/v1/uploads": {
            "post": operation(
                "createUpload",
                "Start a file sent in parts; it expires an hour after creation unless completed.",
                replayable(ref("Upload")),
                400,
                403,
                409,
                params=(IDEMPOTENCY_KEY,),
                notes={409: IDEMPOTENCY_409},
                requestBody={"required": True, "content": {JSON: {"schema": create_body}}},
            ),
        },
        "/v1/uploads/{upload_id}/parts": {
            "post": operation(
                "addUploadPart",
                "Add a part (streamed to the object store).",
                replayable(ref("UploadPart")),
                400,
                403,
                404,
                409,
                notes={400: UPLOAD_400, 409: IDEMPOTENCY_409},
                params=(UPLOAD_ID, IDEMPOTENCY_KEY),
                requestBody=part_body,
            ),
        },
        "/v1/uploads/{upload_id}/complete": {
            "post": operation(
                "completeUpload",
                "Join the parts named, in that order, into a file; the upload's `file` is that File.",
                replayable(ref("Upload")),
                400,
                403,
                404,
                409,
                notes={400: UPLOAD_400, 409: IDEMPOTENCY_409},
                params=(UPLOAD_ID, IDEMPOTENCY_KEY),
                requestBody={"required": True, "content": {JSON: {"schema": complete_body}}},
            ),
        },
        "/v1/uploads/{upload_id}/cancel": {
            "post": operation(
                "cancelUpload",
                "Cancel a pending upload; its parts are deleted.",
                ok(ref("Upload")),
                400,
                404,
                notes={400: UPLOAD_400},
                params=(UPLOAD_ID,),
            ),
        },
    }


def webhook_paths() -> Schema:
    """Freight's own: a tenant's webhook endpoints and delivery logs (OpenAI has no API for them)."""
    create_body = obj(
        {
            "url": {"type": "string", "minLength": 1, "maxLength": 2048, "description": "http(s) URL"},
            "events": {"type": "array", "minItems": 1, "items": {"enum": WEBHOOK_EVENTS}},
        }
    )
    deliveries = ok(list_of("WebhookDelivery"))
    return {
        "/v1/webhooks": {
            "post": operation(
                "createWebhook",
                "Add a webhook endpoint; the answer holds its signing secret, shown this once.",
                ok(ref("WebhookEndpoint")),
                400,
                requestBody={"required": True, "content": {JSON: {"schema": create_body}}},
            ),
            "get": operation(
                "listWebhooks", "The tenant's webhook endpoints.", ok(list_of("WebhookEndpoint"))
            ),
        },
        "/v1/webhooks/{endpoint_id}": {
            "get": operation(
                "retrieveWebhook",
                "One webhook endpoint.",
                ok(ref("WebhookEndpoint")),
                404,
                params=(ENDPOINT_ID,),
            ),
            "delete": operation(
                "deleteWebhook",
                "Remove an endpoint; its pending deliveries end failed.",
                ok(obj({"id": STR, "object": {"const": "webhook_endpoint"}, "deleted": {"const": True}})),
                404,
                params=(ENDPOINT_ID,),
            ),
        },
        "/v1/webhooks/{endpoint_id}/disable": {
            "post": operation(
                "disableWebhook",
                "Disable an endpoint; its deliveries wait.",
                ok(ref("WebhookEndpoint")),
                404,
                params=(ENDPOINT_ID,),
            ),
        },
        "/v1/webhooks/{endpoint_id}/enable": {
            "post": operation(
                "enableWebhook",
                "Enable an endpoint again; its pending deliveries resume.",
                ok(ref("WebhookEndpoint")),
                404,
                params=(ENDPOINT_ID,),
            ),
        },
        "/v1/webhooks/{endpoint_id}/rotate_secret": {
            "post": operation(
                "rotateWebhookSecret",
                "A new signing secret, shown this once; the old one also signs for"
                " FREIGHT_WEBHOOK_SECRET_GRACE_SECONDS.",
                ok(ref("WebhookEndpoint")),
                404,
                params=(ENDPOINT_ID,),
            ),
        },
        "/v1/webhooks/{endpoint_id}/deliveries": {
            "get": operation(
                "listWebhookDeliveries",
                "An endpoint's latest deliveries, newest first.",
                deliveries,
                404,
                params=(ENDPOINT_ID,),
            ),
        },
        "/v1/batches/{batch_id}/webhook_deliveries": {
            "get": operation(
                "listBatchWebhookDeliveries",
                "A batch's webhook delivery log.",
                deliveries,
                404,
                params=(BATCH_ID,),
            ),
        },
    }


REQUEST_ID_HEADER: Schema = {
    "description": "This request's id, on every response and on the log lines about the request: the "
    "client's own X-Request-Id if it sent one of 1-128 letters, digits and `. _ : -`, else a new one.",
    "required": True,
    "schema": {"type": "string", "pattern": f"^{REQUEST_ID_PATTERN}$"},
}


def with_request_ids(paths: Schema) -> Schema:
    """Every response of every operation documents the x-request-id header (api/request_ids.py)."""
    for item in paths.values():
        for operation in item.values():
            if isinstance(operation, dict):
                for response in operation.get("responses", {}).values():
                    response.setdefault("headers", {})["x-request-id"] = {
                        "$ref": "#/components/headers/RequestId"
                    }
    return paths


def openapi_document(settings: Settings) -> Schema:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Freight",
            "version": "1",
            "description": "OpenAI-compatible Batch API (files, batches, models) with Freight's "
            '`x_freight` extensions. Every error is `{"error": {message, type, param, code}}`.',
        },
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        "paths": with_request_ids(paths(settings)),
        "components": {
            "headers": {"RequestId": REQUEST_ID_HEADER},
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "A tenant's API key."}
            },
            "schemas": {
                "Error": ERROR,
                "File": FILE,
                "DeletedFile": DELETED_FILE,
                "Upload": UPLOAD,
                "UploadPart": UPLOAD_PART,
                "Batch": BATCH,
                "Estimate": ESTIMATE,
                "Cost": COST,
                "Model": MODEL,
                "Adapter": ADAPTER,
                "WebhookEndpoint": WEBHOOK_ENDPOINT,
                "WebhookDelivery": WEBHOOK_DELIVERY,
            },
        },
    }
