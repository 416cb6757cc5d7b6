"""`/v1/score` and `/v1/rerank` batch lines: the body checked against vLLM's own request classes,
each query-document pair run as pooling requests on the model's engine, and the scores written
back in the shapes `vllm serve` returns (`ScoreResponse`, `RerankResponse`).

Why both endpoints here: vLLM's run-batch takes the same bodies on both (its `ScoreRequest` union and
`RerankRequest`), and one engine path serves them. Two kinds of model score (vLLM's score types,
`vllm.tasks.SCORE_TYPE_MAP`):

* a cross-encoder (registry task "score": a `*ForSequenceClassification` with one label) reads query
  and document together, one pooling request (task "classify") per pair, rendered by vLLM's own
  `CrossEncoderIOProcessor` (the tokenizer's pair encoding with its separator, token type ids for
  BERT-like models, the "LLM as reranker" join for decoder models), so a pair scores as `vllm serve`
  scores it;
* an embedding model (registry task "embed") embeds the queries and the documents apart, one
  pooling request (task "embed") per text, and a pair's score is the cosine of its two vectors, as
  vLLM's bi-encoder scoring computes it.

A line is one request whose pairs are several sequences in the engine, like an embeddings line's
inputs: `submit_scoring` hands all of them to the engine at once and the line ends with its last.
`workers.request_bodies.parse_body` validates the body (`scoring_request_class`, vLLM's pydantic
class, `scoring_body`) and raises only `RequestError`. Text only: multimodal content parts, score
templates (`instruction`, `chat_template_kwargs`) and a body's `cache_salt` are refused.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.embeddings import PooledOutputs, check_token_count
from workers.request_errors import RequestError

SCORE = "/v1/score"
RERANK = "/v1/rerank"
SCORING_ENDPOINTS = (SCORE, RERANK)

MAX_DOCUMENTS = 2048  # pairs (or texts) of one line, as OpenAI limits an embeddings line's inputs
# the field pairs of vLLM's ScoreRequest union, in the order it tries them
SCORE_FIELDS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
_TEMPLATE = "score templates are not supported: a pair is joined as the model's tokenizer joins it."
_UNSUPPORTED_FIELDS = {
    "cache_salt": "Freight keeps each tenant's prefix cache apart itself.",
    "mm_processor_kwargs": "multimodal inputs are not supported in scoring batches.",
    "instruction": _TEMPLATE,
    "chat_template_kwargs": _TEMPLATE,
    "padding": "padding is not supported in scoring batches.",
}


@dataclass(frozen=True)
class ScoringBody:
    """A checked score or rerank body: its texts, and vLLM's request object (tokenize and pooling
    parameters come from it)."""

    endpoint: str
    queries: tuple[str, ...]
    documents: tuple[str, ...]
    query_param: str  # the body's field names, for errors
    document_param: str
    request: Any  # vLLM's ScoreRequest class of the body's fields, or RerankRequest
    top_n: int = 0

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """(query, document) indices of each scored pair, in response order: one query against every
        document, or the i-th query against the i-th document."""
        if len(self.queries) == 1:
            return [(0, i) for i in range(len(self.documents))]
        return [(i, i) for i in range(len(self.documents))]

    @property
    def n(self) -> int:
        """Sequences the line occupies in a cross-encoder's engine: one per pair."""
        return len(self.documents)


def scoring_request_class(endpoint: str, data: dict) -> tuple[Any, str | None]:
    """vLLM's request class for a score or rerank body (``data``, a JSON object) and its model name,
    once the fields vLLM's class would take but a batch cannot honour are refused."""
    for name, why in _UNSUPPORTED_FIELDS.items():
        if data.get(name) is not None:
            raise RequestError("unsupported_parameter", f"`{name}` is not supported: {why}", name)
    if data.get("priority"):
        raise RequestError(
            "unsupported_parameter",
            "Per-request `priority` is not supported; jobs are scheduled as a whole.",
            "priority",
        )
    model = data.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise RequestError("invalid_request", "`model` must be a non-empty string.", "model")
    from vllm.entrypoints.pooling.scoring import protocol

    if endpoint == RERANK:
        _texts(data.get("query"), "query", single=True)
        _texts(data.get("documents"), "documents")
        return protocol.RerankRequest, model
    first, second = _score_fields(data)
    queries = _texts(data.get(first), first)
    documents = _texts(data.get(second), second)
    _check_lengths(queries, documents, first, second)
    classes = {
        "documents": protocol.ScoreQueriesDocumentsRequest,
        "items": protocol.ScoreQueriesItemsRequest,
        "data_2": protocol.ScoreDataRequest,
        "text_2": protocol.ScoreTextRequest,
    }
    return classes[second], model


def scoring_body(endpoint: str, request: Any) -> ScoringBody:
    """The checked body of vLLM's validated ``request``."""
    for name in ("max_tokens_per_query", "max_tokens_per_doc"):
        if getattr(request, name) < 0:
            raise RequestError("invalid_request", f"`{name}` must be a non-negative integer.", name)
    if endpoint == RERANK:
        return ScoringBody(
            endpoint,
            (request.query,),
            _as_tuple(request.documents),
            "query",
            "documents",
            request,
            top_n=request.top_n,
        )
    first, second = next(p for p in SCORE_FIELDS if p[1] in type(request).model_fields)
    return ScoringBody(endpoint, _as_tuple(request.data_1), _as_tuple(request.data_2), first, second, request)


def _score_fields(data: dict) -> tuple[str, str]:
    """The body's pair of text fields: the one its second field names (`queries` goes with
    `documents` or `items`), else the one its first field names."""
    for first, second in SCORE_FIELDS:
        if second in data:
            return first, second
    for first, second in SCORE_FIELDS:
        if first in data:
            return first, second
    raise RequestError(
        "invalid_request",
        "`queries` and `documents` are required: a string or an array of strings each "
        "(or `text_1` and `text_2`, `data_1` and `data_2`, `queries` and `items`).",
        "queries",
    )


def _texts(value: Any, name: str, single: bool = False) -> tuple[str, ...]:
    """A text field as vLLM takes it: a string, or (unless ``single``) a non-empty array of
    strings. Multimodal content (`{"content": [...]}`) is refused: Freight's scoring is text only."""
    if isinstance(value, str):
        if not value:
            raise RequestError("invalid_request", f"`{name}` must not be empty.", name)
        return (value,)
    if isinstance(value, dict):
        raise RequestError(
            "unsupported_parameter", f"`{name}`: only text is supported, not multimodal content.", name
        )
    what = "a non-empty string" if single else "a string or a non-empty array of strings"
    if single or not isinstance(value, list) or not value:
        raise RequestError("invalid_request", f"`{name}` is required: {what}.", name)
    if len(value) > MAX_DOCUMENTS:
        raise RequestError(
            "invalid_request",
            f"`{name}` has {len(value)} elements; at most {MAX_DOCUMENTS} are allowed.",
            name,
        )
    for i, item in enumerate(value):
        where = f"{name}.{i}"
        if isinstance(item, dict):
            raise RequestError(
                "unsupported_parameter", f"`{where}`: only text is supported, not multimodal content.", where
            )
        if not isinstance(item, str) or not item:
            raise RequestError("invalid_request", f"`{where}` must be a non-empty string.", where)
    return tuple(value)


def _check_lengths(queries: tuple[str, ...], documents: tuple[str, ...], first: str, second: str) -> None:
    if len(queries) > 1 and len(queries) != len(documents):
        raise RequestError(
            "invalid_request",
            f"`{first}` has {len(queries)} elements and `{second}` {len(documents)}: give one query "
            "for all documents, or one query per document (1:N or N:N).",
            first,
        )


def _as_tuple(value: Any) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def scoring_input_tokens(endpoint: str, body: dict, tokenizer: Any, bi_encoder: bool) -> int:
    """A valid score or rerank body's input tokens as the engine counts them (a dry run's price):
    on a cross-encoder each pair as the tokenizer encodes a text pair, on an embedding model
    (``bi_encoder``) each query and document once with the model's special tokens. Texts are
    counted whole: `truncate_prompt_tokens` and the per-text limits only lower the figure."""
    if endpoint == RERANK:
        queries, documents = (
            _texts(body.get("query"), "query", single=True),
            _texts(body.get("documents"), "documents"),
        )
    else:
        first, second = _score_fields(body)
        queries, documents = _texts(body.get(first), first), _texts(body.get(second), second)
    if bi_encoder:
        return sum(len(tokenizer.encode(t, add_special_tokens=True)) for t in (*queries, *documents))
    pairs = zip(queries * len(documents) if len(queries) == 1 else queries, documents, strict=True)
    return sum(len(tokenizer(text=q, text_pair=d)["input_ids"]) for q, d in pairs)


# --------------------------------------------------------------------------- engine stage


class ScoringFailed(RuntimeError):
    """vLLM reported an error for one of the line's sequences (the line's 500)."""


@dataclass
class ScoredLine(PooledOutputs):
    """One score or rerank line in the engine: its vLLM request ids (one per pair on a
    cross-encoder; on an embedding model one per query, then one per document) and the outputs of
    those that finished."""

    body: ScoringBody
    request_ids: list[str]
    prompt_tokens: int
    bi_encoder: bool
    outputs: dict[str, Any] = field(default_factory=dict)

    def response(self, model: str) -> tuple[dict[str, Any], int]:
        """The line's response body and its cached prompt tokens. Raises ScoringFailed if vLLM
        failed a sequence; any other exception means the body could not be built."""
        outputs, cached = self.finished(ScoringFailed("The engine failed while scoring this request."))
        scores = self._bi_encoder_scores(outputs) if self.bi_encoder else self._cross_encoder_scores(outputs)
        if self.body.endpoint == RERANK:
            return rerank_body(scores, self.body, model, self.prompt_tokens), cached
        return score_body(scores, model, self.prompt_tokens), cached

    @staticmethod
    def _cross_encoder_scores(outputs: list[Any]) -> list[float]:
        from vllm.outputs import ScoringOutput

        return [ScoringOutput.from_base(o.outputs).score for o in outputs]

    def _bi_encoder_scores(self, outputs: list[Any]) -> list[float]:
        import torch.nn.functional as F

        queries = len(self.body.queries)
        vectors = [o.outputs.data.float() for o in outputs]
        return [
            float(F.cosine_similarity(vectors[q], vectors[queries + d], dim=0)) for q, d in self.body.pairs
        ]


def score_body(scores: list[float], model: str, prompt_tokens: int) -> dict[str, Any]:
    """vLLM's ScoreResponse: one `score` object per pair in request order; usage counts prompt
    tokens only (scoring writes none)."""
    from vllm.entrypoints.pooling.scoring.protocol import ScoreResponse, ScoreResponseData
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    response = ScoreResponse(
        id=f"score-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model,
        data=[ScoreResponseData(index=i, score=_finite(s)) for i, s in enumerate(scores)],
        usage=UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
    )
    return response.model_dump()


def rerank_body(scores: list[float], body: ScoringBody, model: str, prompt_tokens: int) -> dict[str, Any]:
    """vLLM's RerankResponse: the documents by relevance, highest first, the first `top_n` of them
    (all when 0), each with its index in the request and its text."""
    from vllm.entrypoints.pooling.scoring.protocol import (
        RerankDocument,
        RerankResponse,
        RerankResult,
        RerankUsage,
    )

    results = [
        RerankResult(index=i, document=RerankDocument(text=body.documents[i]), relevance_score=_finite(s))
        for i, s in enumerate(scores)
    ]
    results.sort(key=lambda r: r.relevance_score, reverse=True)
    if 0 < body.top_n < len(results):
        results = results[: body.top_n]
    response = RerankResponse(
        id=f"rerank-{uuid.uuid4().hex}",
        model=model,
        usage=RerankUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
        results=results,
    )
    return response.model_dump()


def _finite(score: float) -> float:
    """A score JSON can hold (a NaN from a degenerate vector is not JSON)."""
    return score if math.isfinite(score) else 0.0


def cross_encoder(llm: Any) -> Any:
    """vLLM's cross-encoder input processor over the engine's renderer (no score template)."""
    from vllm.entrypoints.pooling.scoring.io_processor import CrossEncoderIOProcessor
    from vllm.renderers.chat_utils import ChatTemplateConfig

    return CrossEncoderIOProcessor(llm.vllm_config, llm.renderer, ChatTemplateConfig())


def submit_scoring(
    llm: Any,
    body: ScoringBody,
    id_prefix: str,
    cache_salt: str | None,
    abort: Callable[[list[str]], None],
    processor: Any | None,
) -> ScoredLine:
    """Render a line and hand its sequences to vLLM's engine (``llm``: its LLMEngine), ids
    ``{id_prefix}.{i}``: on a cross-encoder (``processor``: `cross_encoder`'s) one per pair, on
    an embedding model (``processor`` None) one per text.

    All or nothing: if vLLM refuses a sequence, those already added are aborted (``abort``).
    Raises RequestError for what the line is at fault for (a pair longer than the context, a
    token limit past it); anything else is raised as it came (the line's 500)."""
    if processor is not None:
        inputs = _cross_encoder_inputs(llm, body, cache_salt, processor)
    else:
        inputs = _bi_encoder_inputs(llm, body, cache_salt)
    request_ids = [f"{id_prefix}.{i}" for i in range(len(inputs))]
    added: list[str] = []
    try:
        for request_id, (engine_input, params) in zip(request_ids, inputs, strict=True):
            llm.add_request(request_id, engine_input, params)
            added.append(request_id)
    except Exception as exc:
        if added:
            abort(added)
        blamed = _blamed(exc, body.document_param)
        if blamed is exc:
            raise
        raise blamed from exc
    tokens = sum(len(engine_input.get("prompt_token_ids") or ()) for engine_input, _ in inputs)
    return ScoredLine(body, request_ids, tokens, bi_encoder=processor is None)


def _check_token_limits(body: ScoringBody, max_len: int) -> None:
    for name in ("max_tokens_per_query", "max_tokens_per_doc"):
        value = getattr(body.request, name)
        if value >= max_len:
            raise RequestError(
                "invalid_request",
                f"`{name}` ({value}) must be less than the model's context ({max_len}).",
                name,
            )


def _cross_encoder_inputs(
    llm: Any, body: ScoringBody, cache_salt: str | None, processor: Any
) -> list[tuple[Any, Any]]:
    """Each pair rendered as `vllm serve` renders it (the processor's `render`)."""
    request = body.request
    _check_token_limits(body, int(llm.model_config.max_model_len))
    tok_params = request.build_tok_params(llm.model_config)
    params = request.to_pooling_params("classify")
    extras = {"cache_salt": cache_salt} if cache_salt else None
    inputs = []
    for q, d in body.pairs:
        try:
            rendered = processor.render(
                {
                    "data_1": body.queries[q],
                    "data_2": body.documents[d],
                    "chat_template": None,
                    "max_tokens_per_query": request.max_tokens_per_query,
                    "max_tokens_per_doc": request.max_tokens_per_doc,
                    "tok_params": tok_params,
                    "prompt_extras": extras,
                    "skip_mm_cache": False,
                    "params": params,
                    "lora_requests": None,
                    "priorities": 0,
                }
            )
        except Exception as exc:
            blamed = _blamed(
                exc, f"{body.document_param}.{d}" if len(body.documents) > 1 else body.document_param
            )
            if blamed is exc:
                raise
            raise blamed from exc
        inputs.append((rendered["prompts"], rendered["params"]))
    return inputs


def _bi_encoder_inputs(llm: Any, body: ScoringBody, cache_salt: str | None) -> list[tuple[Any, Any]]:
    """Each query, then each document, tokenized as vLLM's bi-encoder scoring does (the per-query
    and per-document limits cut the text, then the model's special tokens are added)."""
    from vllm.entrypoints.pooling.scoring.utils import truncate_text_to_tokens

    request = body.request
    max_len = int(llm.model_config.max_model_len)
    _check_token_limits(body, max_len)
    tokenizer = llm.get_tokenizer()
    params = request.to_pooling_params("embed")
    texts = [(t, request.max_tokens_per_query, body.query_param, i) for i, t in enumerate(body.queries)]
    texts += [(t, request.max_tokens_per_doc, body.document_param, i) for i, t in enumerate(body.documents)]
    inputs = []
    for text, limit, name, i in texts:
        if limit > 0:
            text = truncate_text_to_tokens(text, tokenizer, limit)
        ids = list(tokenizer.encode(text, add_special_tokens=True))
        ids = _truncated(ids, request.truncate_prompt_tokens, request.truncation_side, max_len)
        where = (
            name if len(body.queries if name == body.query_param else body.documents) == 1 else f"{name}.{i}"
        )
        check_token_count(ids, where, max_len, "shorten it (or set `truncate_prompt_tokens`)")
        engine_input: dict[str, Any] = {"prompt_token_ids": ids}
        if cache_salt:
            engine_input["cache_salt"] = cache_salt
        inputs.append((engine_input, params))
    return inputs


def _truncated(ids: list[int], limit: int | None, side: str | None, max_len: int) -> list[int]:
    """`truncate_prompt_tokens` as vLLM applies it: -1 is the model's context."""
    if limit is None:
        return ids
    if limit < 0:
        limit = max_len
    if len(ids) <= limit:
        return ids
    return ids[-limit:] if side == "left" else ids[:limit]


def _blamed(exc: Exception, param: str) -> Exception:
    """vLLM's refusal of a line's input as the line's 400; any other exception as it came."""
    if isinstance(exc, RequestError):
        return exc
    from vllm.exceptions import VLLMClientError

    if isinstance(exc, (VLLMClientError, ValueError, TypeError)):
        message = str(exc.args[0]) if exc.args else str(exc)
        if "maximum context length" in message:  # vLLM names its own count (input_tokens): name the text
            return RequestError("context_length_exceeded", message[:1000], param)
        return RequestError("invalid_request", message[:1000], getattr(exc, "parameter", None) or param)
    return exc
