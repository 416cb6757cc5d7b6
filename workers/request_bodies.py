"""OpenAI request bodies, parsed and checked without an engine or tokenizer (the validation stage).

Why this leans on vLLM's own OpenAI layer (the pydantic request models of `vllm serve` and their
`to_sampling_params`): a batch line then accepts exactly the parameters, defaults and error
messages that `vllm serve` accepts, and a vLLM upgrade changes behaviour in one place instead of
drifting from a hand-written copy. `parse_body` raises only `RequestError`, whatever dict it is
given. The engine stage (rendering with the engine's renderer, building response bodies) is
`workers.rendering`.

Deliberate differences from `vllm serve`, because a batch line cannot honour them:
streaming, beam search, `tool_choice: "auto"` on a model whose registry entry names no
tool-call parser (forced calls work on any model: `workers.tool_calls`), request-supplied chat templates,
content parts other than text and images (`workers.images`), prompt embeddings, FIM `suffix`, several prompts in one
completions body (put each on its own line), disaggregated-serving transfer parameters,
non-zero `priority` (Freight schedules by job) and `cache_salt` (Freight salts each tenant's
prefix cache itself; a salt of the body's choosing could name another tenant's). When a body
gives neither `max_tokens` nor `max_completion_tokens`, the output budget is the configured default,
capped by the context left (completions included, where OpenAI's default is 16).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workers import tool_calls
from workers.embeddings import EMBEDDINGS, parse_embedding_body
from workers.request_errors import REFUSED_LINE, RequestError, clip_message
from workers.responses import RESPONSES, to_chat
from workers.scoring import RERANK, SCORE, SCORING_ENDPOINTS, scoring_body, scoring_request_class
from workers.transcription import (
    AUDIO_ENDPOINTS,
    TRANSCRIPTIONS,
    TRANSLATIONS,
    audio_body,
    audio_request_class,
)

if TYPE_CHECKING:  # vLLM is imported lazily: importing it costs seconds.
    from vllm.sampling_params import SamplingParams

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, SCORE, RERANK, TRANSCRIPTIONS, TRANSLATIONS)
# what a model of each registry task serves (storage.registry: a model's task): an embedding model
# also scores, by the cosine of its vectors, as vLLM's bi-encoder scoring does
TASK_ENDPOINTS = {
    "generate": (CHAT, COMPLETIONS, RESPONSES),
    "embed": (EMBEDDINGS, SCORE, RERANK),
    "score": (SCORE, RERANK),
    "transcribe": (TRANSCRIPTIONS, TRANSLATIONS),  # a Whisper model (workers/transcription.py)
}
# the endpoints of vLLM's pooling runner: their lines write no tokens (input is the whole cost)
POOLING_ENDPOINTS = (EMBEDDINGS, SCORE, RERANK)
# endpoints vLLM's run-batch takes that Freight refuses at batch creation, and why (none now)
UNSUPPORTED_ENDPOINTS: dict[str, str] = {}
# REFUSED_LINE (workers/request_errors.py): the one field of the body validation stores for a
# line it refused alone, raised by `parse_body` when the line runs


def refused_line_json(code: str, message: str, param: str | None) -> str:
    """The stored body of a line refused at validation: its error, as compact JSON."""
    refused = {REFUSED_LINE: {"code": code, "message": message, "param": param}}
    return json.dumps(refused, ensure_ascii=False, separators=(",", ":"))


def _line_refusal(given: Any) -> RequestError:
    """The error validation recorded in a refused line's stored body."""
    refused: dict = given if isinstance(given, dict) else {}
    status = refused.get("status")  # a file id of no file of the tenant's is a 404 (media_files)
    return RequestError(
        str(refused.get("code") or "invalid_request"),
        str(refused.get("message") or "The line was refused at validation."),
        str(refused["param"]) if refused.get("param") else None,
        status if isinstance(status, int) and 400 <= status < 500 else 400,
    )


def serves(task: str, endpoint: str) -> bool:
    """Whether a model of registry task ``task`` serves ``endpoint``."""
    return endpoint in TASK_ENDPOINTS.get(task, ())


def endpoint_mismatch(model: str, endpoint: str, task: str | None = None) -> str:
    """Why ``model`` (of registry task ``task``; None: an embedding model for any endpoint but
    /v1/embeddings, a text model for that) cannot serve ``endpoint``: an embedding model writes no
    text, a text model makes no embeddings and scores nothing, a cross-encoder only scores (a
    model's task is in its registry entry: ``freight models list``)."""
    if task is None:
        task = "generate" if endpoint == EMBEDDINGS else "embed"
    name = f"model {model[:200]!r}"
    if endpoint in AUDIO_ENDPOINTS and task != "transcribe":
        return f"{name} is not a speech model; it does not serve {endpoint} (use a Whisper model)"
    if task == "generate":
        if endpoint in SCORING_ENDPOINTS:
            return (
                f"{name} generates text; it does not serve {endpoint} "
                "(use a cross-encoder or an embedding model)"
            )
        return f"{name} generates text; it does not serve {EMBEDDINGS} (use an embedding model)"
    if task == "score":
        return f"{name} is a cross-encoder (a scoring model); it serves {SCORE} and {RERANK} only, not {endpoint}"
    if task == "transcribe":
        return f"{name} is a speech model; it serves {TRANSCRIPTIONS} and {TRANSLATIONS} only, not {endpoint}"
    return f"{name} is an embedding model; it serves {EMBEDDINGS}, {SCORE} and {RERANK} only, not {endpoint}"


MAX_N = 128  # OpenAI's own limit on choices per request; n fans out into n sequences.
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# vLLM's "before" validators call .get() on these; a non-object would surface as a crash.
_OBJECT_FIELDS = (
    "response_format",
    "structured_outputs",
    "chat_template_kwargs",
    "stream_options",
    "logit_bias",
)
_UNSUPPORTED_FIELDS = {
    "kv_transfer_params": "disaggregated-serving transfer parameters are internal to vLLM serve.",
    "ec_transfer_params": "disaggregated-serving transfer parameters are internal to vLLM serve.",
    "prompt_embeds": "prompt embeddings are not accepted in batch input.",
    "chat_template": "request-supplied chat templates are not trusted; the model's template is used.",
    "cache_salt": "Freight keeps each tenant's prefix cache apart itself.",
}


@dataclass(frozen=True)
class ParsedRequest:
    """A validated body: `request` is vLLM's ChatCompletionRequest or CompletionRequest, or for
    embeddings Freight's `workers.embeddings.EmbeddingBody`. A Responses body runs as the chat
    request it translates to (`workers.responses`): `request` is that ChatCompletionRequest and
    `responses` the Responses fields its Response object echoes.

    `max_tokens` is the output budget the body asked for explicitly (None: use the
    engine's default); `model` is the body's model name (None when absent; the caller
    decides whether it matches the served model).
    """

    endpoint: str
    model: str | None
    request: Any
    max_tokens: int | None = None
    responses: dict[str, Any] | None = None
    # the engine worker's shape cache key (`workers.request_shapes.ParsedShapes`): lines with the
    # same one differ only in their messages' texts, so they share their SamplingParams for a
    # given output budget; None: not a cached shape, its parameters are built for it alone
    shape: tuple[bool, bool, str] | None = field(default=None, compare=False)

    @property
    def is_chat(self) -> bool:
        """Rendered and answered as chat (a Responses body runs as its chat translation)."""
        return self.endpoint == CHAT or self.endpoint == RESPONSES

    @property
    def prompt_param(self) -> str:
        """The body field a prompt error names (too long for the context, ...)."""
        if self.endpoint == RESPONSES:
            return "input"
        return "messages" if self.endpoint == CHAT else "prompt"

    @property
    def n(self) -> int:
        """Number of sequences the request occupies in the engine."""
        return self.request.n or 1


# --------------------------------------------------------------------------- parsing


def parse_body(
    endpoint: str, body: dict, *, validated: bool = False, auto_tools: bool = False, reasoning: bool = False
) -> ParsedRequest:
    """Validate an OpenAI request body with vLLM's pydantic models; raise RequestError only.

    ``auto_tools``: the model has a tool-call parser, so `tool_choice: "auto"` (and `tools`
    without a `tool_choice`) can be served; without one such a body is refused as unsupported.
    ``reasoning``: the model also reads reasoning back, so a Responses body's `reasoning` can be
    honoured (`workers.responses`).

    ``validated``: this body passed `parse_body` at validation and was decoded afresh from the
    request store, so the defensive deep copy and the early sampling-parameter check are skipped
    (`render_request` builds the sampling parameters, and reports a bad one, in any case). The
    worker parses every request again before it runs; this about halves that cost (0.11 -> 0.05 ms
    a line on the benchmark machine). A refused line's stored body (`REFUSED_LINE`) raises the
    error validation recorded for it.
    """
    if validated and isinstance(body, dict) and REFUSED_LINE in body:
        raise _line_refusal(body[REFUSED_LINE])
    try:
        if endpoint == RESPONSES and isinstance(body, dict):
            return _parse_responses(body, validated, auto_tools, reasoning)
        return _parse_body(endpoint, body, validated, auto_tools)
    except RequestError:
        raise
    except Exception as exc:  # vLLM validators can trip over odd input (KeyError, TypeError...)
        detail = f"{type(exc).__name__}: {exc}"
        raise RequestError("invalid_request", clip_message(f"Invalid request body ({detail}).")) from None


def _parse_body(endpoint: str, body: Any, validated: bool = False, auto_tools: bool = False) -> ParsedRequest:
    data = _body_data(endpoint, body, validated)
    if endpoint == EMBEDDINGS:  # served by embedding models only (workers/embeddings.py)
        model, embedding = parse_embedding_body(data)
        return ParsedRequest(endpoint=endpoint, model=model, request=embedding, max_tokens=0)
    if endpoint in SCORING_ENDPOINTS:  # cross-encoders and embedding models (workers/scoring.py)
        model_cls, model = scoring_request_class(endpoint, data)
        _refuse_unknown_fields(data, model_cls)
        scoring = scoring_body(endpoint, _validate(model_cls, data))
        return ParsedRequest(endpoint=endpoint, model=model, request=scoring, max_tokens=0)
    if endpoint in AUDIO_ENDPOINTS:  # Whisper models (workers/transcription.py)
        model_cls, model = audio_request_class(endpoint, data, validated)
        _refuse_unknown_fields(data, model_cls)
        audio = audio_body(endpoint, _validate(model_cls, data))
        max_tokens = audio.request.max_completion_tokens
        return ParsedRequest(endpoint=endpoint, model=model, request=audio, max_tokens=max_tokens)
    model = _check_generation_fields(data)
    model_cls = (
        _chat_request_class(data, auto_tools, validated)
        if endpoint == CHAT
        else _completion_request_class(data)
    )
    _refuse_unknown_fields(data, model_cls)
    request = _validate(model_cls, data)
    _check_batch_options(request)
    if endpoint == CHAT:
        tool_calls.constrain(request)  # "required" / a named function: the call's JSON schema

    max_tokens = _requested_max_tokens(endpoint, request, data)
    if validated:
        return ParsedRequest(endpoint=endpoint, model=model, request=request, max_tokens=max_tokens)
    # Build sampling params once now, so that bad values (temperature, top_p, stop, min_tokens,
    # response_format...) are reported at validation time rather than in the engine.
    sampling_params_of(request, max_tokens if max_tokens is not None else max(1, request.min_tokens or 1), {})
    return ParsedRequest(endpoint=endpoint, model=model, request=request, max_tokens=max_tokens)


def _body_data(endpoint: str, body: Any, validated: bool) -> dict:
    """The body of a known endpoint as a JSON object: a deep copy unless it was ``validated``."""
    if endpoint not in ENDPOINTS:
        raise RequestError(
            "invalid_request",
            f"Unsupported endpoint {str(endpoint)[:100]!r}; expected one of {', '.join(ENDPOINTS)}.",
            "url",
        )
    if not isinstance(body, dict):
        raise RequestError("invalid_request", "The request body must be a JSON object.", "body")
    try:
        # A JSON round trip is a deep copy (vLLM's validators mutate messages) that also
        # rejects what no JSON line can hold (NaN, sets, non-string keys, objects).
        return body if validated else json.loads(json.dumps(body, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as exc:
        raise RequestError(
            "invalid_request", clip_message(f"The body is not valid JSON data: {exc}"), "body"
        ) from None


def _check_generation_fields(data: dict) -> str | None:
    """What a chat or completions body must not hold before vLLM sees it; its model name."""
    if data.get("stream") is True:  # other spellings ("true", 1) are caught after validation
        raise RequestError("unsupported_parameter", "Streaming is not available in batch requests.", "stream")
    for name, why in _UNSUPPORTED_FIELDS.items():
        if data.get(name) is not None:
            raise RequestError("unsupported_parameter", f"`{name}` is not supported: {why}", name)
    for name in _OBJECT_FIELDS:
        if data.get(name) is not None and not isinstance(data[name], dict):
            raise RequestError("invalid_request", f"`{name}` must be an object.", name)
    model = data.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise RequestError("invalid_request", "`model` must be a non-empty string.", "model")
    return model


def _chat_request_class(data: dict, auto_tools: bool, validated: bool = False) -> Any:
    """vLLM's ChatCompletionRequest, once the messages, tools and template arguments pass."""
    _check_messages(data.get("messages"), validated)
    if tool_calls.check_tools(data) == tool_calls.AUTO and not auto_tools:
        raise tool_calls.auto_tools_error()
    kwargs = data.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("chat_template") is not None:
        raise RequestError(
            "unsupported_parameter",
            "Request-supplied chat templates are not trusted; the model's template is used.",
            "chat_template_kwargs.chat_template",
        )
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest


def _completion_request_class(data: dict) -> Any:
    """vLLM's CompletionRequest, once the body holds one prompt (set back as ``data["prompt"]``)
    and no suffix."""
    data["prompt"] = _single_prompt(data.get("prompt"))
    if data.get("suffix") is not None:
        raise RequestError(
            "unsupported_parameter", "`suffix` (fill-in-the-middle) is not supported.", "suffix"
        )
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest


def _refuse_unknown_fields(data: dict, model_cls: Any) -> None:
    unknown = sorted(set(data) - set(model_cls.model_fields))
    if unknown:  # OpenAI refuses these too; silently ignoring a misspelt parameter hides bugs
        raise RequestError(
            "invalid_request",
            clip_message(f"Unrecognized request argument supplied: {unknown[0]}"),
            unknown[0],
        )


def _check_batch_options(request: Any) -> None:
    """What vLLM accepts but a batch line cannot honour: streaming, beam search, n past MAX_N,
    a priority."""
    if request.stream:
        raise RequestError("unsupported_parameter", "Streaming is not available in batch requests.", "stream")
    if request.use_beam_search:
        raise RequestError("unsupported_parameter", "Beam search is not supported.", "use_beam_search")
    n = request.n if request.n is not None else 1
    if not 1 <= n <= MAX_N:
        raise RequestError("invalid_request", f"`n` must be between 1 and {MAX_N}.", "n")
    if request.priority:
        raise RequestError(
            "unsupported_parameter",
            "Per-request `priority` is not supported; jobs are scheduled as a whole.",
            "priority",
        )


def _parse_responses(body: dict, validated: bool, auto_tools: bool, reasoning: bool) -> ParsedRequest:
    """A Responses body parsed as the chat body it translates to; errors name Responses fields."""
    translated = to_chat(body, reasoning=reasoning)
    try:
        parsed = _parse_body(CHAT, translated.chat, validated, auto_tools)
    except RequestError as exc:
        raise translated.responses_error(exc) from None
    return dataclasses.replace(parsed, endpoint=RESPONSES, responses=translated.echo)


def _check_messages(messages: Any, validated: bool = False) -> None:
    """Clear errors for the message shapes OpenAI accepts (pydantic's union errors are not)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("invalid_request", "`messages` must be a non-empty array of messages.", "messages")
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise RequestError("invalid_request", f"`{where}` must be an object.", where)
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise RequestError(
                "invalid_request",
                f"`{where}.role` must be one of {', '.join(sorted(_ROLES))}.",
                f"{where}.role",
            )
        _check_tool_calls(message.get("tool_calls"), f"{where}.tool_calls")
        content = message.get("content")
        if content is None:
            if role == "assistant" and (message.get("tool_calls") or message.get("function_call")):
                continue
            raise RequestError("invalid_request", f"`{where}.content` is required.", f"{where}.content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise RequestError(
                "invalid_request",
                f"`{where}.content` must be a string or an array of parts.",
                f"{where}.content",
            )
        for j, part in enumerate(content):
            part_where = f"{where}.content.{j}"
            if isinstance(part, dict) and part.get("type") == "image_url":
                _check_image_part(part, part_where, validated)
                continue
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError(
                    "unsupported_parameter",
                    f"`{part_where}`: only text and image_url content parts are supported.",
                    part_where,
                )
            if not isinstance(part.get("text"), str):
                raise RequestError(
                    "invalid_request", f"`{part_where}.text` must be a string.", f"{part_where}.text"
                )


def _check_image_part(part: dict, where: str, validated: bool) -> None:
    """An ``image_url`` part: ``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}``.
    In a tenant's body the URL is only checked to be a string here: what it holds (a data: URL, a
    link, an image at all) is ``workers.images``' to judge, line by line. In a body validation
    stored (``validated``), it is the reference validation wrote: an image it stored, or the
    refusal that is this line's error."""
    from workers.images import REFUSED_REF, is_image_ref, refusal

    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else None
    if validated:
        if url == REFUSED_REF:
            raise refusal(part)
        if is_image_ref(url):
            return
        raise RequestError("invalid_request", f"`{where}` holds no image validation stored.", where)
    extra = sorted(set(part) - {"type", "image_url"})
    if extra:
        raise RequestError(
            "invalid_request", f"`{where}`: unknown field {extra[0][:64]!r}.", f"{where}.{extra[0][:64]}"
        )
    if not isinstance(url, str) or not url:
        raise RequestError(
            "invalid_request",
            f"`{where}.image_url` must be an object with a non-empty string `url`.",
            f"{where}.image_url",
        )
    assert isinstance(image_url, dict)
    extra = sorted(set(image_url) - {"url", "detail"})
    if extra:
        raise RequestError(
            "invalid_request", f"`{where}.image_url`: unknown field {extra[0][:64]!r}.", f"{where}.image_url"
        )
    if image_url.get("detail", "auto") not in ("auto", "low", "high"):
        raise RequestError(
            "invalid_request",
            f"`{where}.image_url.detail` must be auto, low or high.",
            f"{where}.image_url.detail",
        )


def _check_tool_calls(tool_calls: Any, where: str) -> None:
    """Earlier assistant tool calls, in OpenAI's shape (they are replayed to the template)."""
    if tool_calls is None:
        return
    if not isinstance(tool_calls, list):
        raise RequestError("invalid_request", f"`{where}` must be an array.", where)
    for k, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or not isinstance(call.get("id"), str)
            or call.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise RequestError(
                "invalid_request",
                f"`{where}.{k}` must be {{id, type: function, function: {{name, arguments}}}} with string values.",
                f"{where}.{k}",
            )


def _single_prompt(prompt: Any) -> Any:
    """One prompt per batch line: a string or a list of token ids (one-element lists unwrap)."""
    if prompt is None or prompt == "" or prompt == []:
        raise RequestError("invalid_request", "`prompt` is required and must not be empty.", "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise RequestError(
                "unsupported_parameter",
                "Several prompts in one body are not supported; put each prompt on its own line.",
                "prompt",
            )
        prompt = prompt[0]
        if prompt == "" or prompt == []:
            raise RequestError("invalid_request", "`prompt` must not be empty.", "prompt")
    if isinstance(prompt, list) and not all(type(t) is int and t >= 0 for t in prompt):
        raise RequestError(
            "invalid_request", "`prompt` must be a string or an array of non-negative token ids.", "prompt"
        )
    return prompt


def _validate(model_cls: Any, data: dict) -> Any:
    import pydantic
    from vllm.exceptions import VLLMValidationError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return model_cls.model_validate(data)
    except pydantic.ValidationError as exc:
        raise _from_validation_error(exc) from None
    except VLLMValidationError as exc:
        raise _from_vllm_error(exc, model_cls) from None


def _from_vllm_error(exc: Any, model_cls: Any) -> RequestError:
    """vLLM's own validation errors, with `param` guessed from the message when vLLM gives none."""
    message = str(exc.args[0]) if exc.args else str(exc)
    param = getattr(exc, "parameter", None)
    if param is None and message:
        first = message.split(None, 1)[0].strip("`'\":,.")
        if first in model_cls.model_fields:
            param = first
        elif "structured output" in message:
            param = "structured_outputs"
    return RequestError("invalid_request", clip_message(message), param)


def _from_validation_error(exc: Any) -> RequestError:
    from vllm.entrypoints.serve.exception_handling.handlers.validation import clean_loc_for_param
    from vllm.exceptions import VLLMValidationError

    errors = exc.errors(include_url=False, include_input=False)
    param = None
    seen: list[str] = []
    for error in errors:
        ctx_error = (error.get("ctx") or {}).get("error")
        # drop pydantic's union-branch class names (ChatCompletionUserMessageParam...)
        loc_parts = tuple(p for p in error.get("loc") or () if not str(p)[:1].isupper())
        loc = clean_loc_for_param(loc_parts) if loc_parts else ""
        if isinstance(ctx_error, VLLMValidationError) and ctx_error.parameter:
            loc = ctx_error.parameter
        param = param or loc or None
        line = f"{loc}: {error.get('msg')}" if loc else str(error.get("msg"))
        if line not in seen:
            seen.append(line)
    message = "Invalid request: " + "; ".join(seen[:3]) if seen else "Invalid request body."
    if len(seen) > 3:
        message += f" (and {len(seen) - 3} more)"
    return RequestError("invalid_request", clip_message(message), param)


def _requested_max_tokens(endpoint: str, request: Any, data: dict) -> int | None:
    if endpoint == CHAT and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    # CompletionRequest turns a missing max_tokens into 16; read the body to see what was asked.
    value = data.get("max_tokens")
    return None if value is None else _field(request, "max_tokens")


def _field(request: Any, name: str) -> Any:
    """A pydantic field's value without its deprecation warning (chat's max_tokens is one): read
    from the model's ``__dict__``, where pydantic keeps declared fields, not through
    ``warnings.catch_warnings``, which rewrites the process's warning filters on every call
    (the engine worker does this for each request it runs, from several threads)."""
    values = getattr(request, "__dict__", {})
    if name in values:
        return values[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(request, name)


def sampling_params_of(request: Any, max_tokens: int, defaults: dict) -> SamplingParams:
    from vllm.exceptions import VLLMValidationError

    try:
        return request.to_sampling_params(max_tokens, defaults)
    except VLLMValidationError as exc:
        raise _from_vllm_error(exc, type(request)) from None
    except (ValueError, TypeError) as exc:
        raise _from_vllm_error(exc, type(request)) from None
