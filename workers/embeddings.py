"""`/v1/embeddings` batch lines: the body parsed and checked, its inputs tokenized for the engine, and
the vectors written back in OpenAI's response shape.

Why a module of its own rather than vLLM's `EmbeddingRequest` model: OpenAI's embeddings body has
five fields (`model`, `input`, `encoding_format`, `dimensions`, `user`), and every check a batch
line needs is on `input`'s shape, which pydantic's union errors describe badly ("input: Input
should be a valid string; input.0: ..."). Here each refusal names the element at fault
(`input.3`), and a line costs microseconds at validation, with no vLLM import.

`workers.request_bodies.parse_body` calls `parse_embedding_body` for `/v1/embeddings`, with the
same contract as for chat and completions: it raises only `RequestError`, whatever it is given. A line is one request
whose `input` may hold many texts (or token-id lists); each is one sequence in the engine and one
`data[i]` in the response, in the order given.

Encoding: "float" gives the float32 values as JSON numbers; "base64" the same values as
little-endian float32 bytes, base64-encoded, as OpenAI sends them (`numpy.frombuffer(b64decode(s),
"<f4")` reads them back).
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.request_errors import RequestError

EMBEDDINGS = "/v1/embeddings"

MAX_INPUTS = 2048  # OpenAI's limit on the elements of one embeddings `input` array
MAX_INPUT_TOKENS = 300_000  # OpenAI's limit on the tokens of all inputs of one request
MAX_TOKEN_ID = 2**31 - 1  # token ids are stored as uint32; vLLM checks them against the vocabulary
ENCODINGS = ("float", "base64")
FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


@dataclass(frozen=True)
class EmbeddingBody:
    """A checked embeddings body: each input a text or a list of token ids, in request order."""

    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: str = "float"
    dimensions: int | None = None

    @property
    def n(self) -> int:
        """Sequences the request occupies in the engine: one per input."""
        return len(self.inputs)


def parse_embedding_body(data: dict) -> tuple[str | None, EmbeddingBody]:
    """An embeddings body (a JSON object already) -> its model name (None when absent) and the
    checked `EmbeddingBody` (`parse_body` wraps it: a ParsedRequest with an output budget of 0, as a
    pooling request writes no tokens)."""
    unknown = sorted(set(data) - FIELDS, key=str)
    if unknown:  # as for chat: a misspelt parameter silently ignored hides bugs
        name = str(unknown[0])[:100]
        raise RequestError("invalid_request", f"Unrecognized request argument supplied: {name}", name)
    model = data.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise RequestError("invalid_request", "`model` must be a non-empty string.", "model")
    encoding = data.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODINGS:
        raise RequestError(
            "invalid_request", '`encoding_format` must be "float" or "base64".', "encoding_format"
        )
    dimensions = data.get("dimensions")
    if dimensions is not None and (
        isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1
    ):
        raise RequestError("invalid_request", "`dimensions` must be a positive integer.", "dimensions")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError("invalid_request", "`user` must be a string.", "user")
    return model, EmbeddingBody(parse_inputs(data.get("input")), encoding, dimensions)


def parse_inputs(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """`input` as OpenAI takes it: a string, an array of strings, an array of token ids (one
    input), or an array of token-id arrays; never empty, at most MAX_INPUTS elements."""
    if isinstance(value, str):
        if not value:
            raise RequestError("invalid_request", "`input` must not be empty.", "input")
        return (value,)
    if not isinstance(value, list) or not value:
        raise RequestError(
            "invalid_request",
            "`input` is required: a string, an array of strings, an array of token ids, "
            "or an array of token-id arrays.",
            "input",
        )
    if len(value) > MAX_INPUTS:
        raise RequestError(
            "invalid_request",
            f"`input` has {len(value)} elements; at most {MAX_INPUTS} are allowed.",
            "input",
        )
    first = value[0]
    if _is_token(first):  # one input given as token ids
        return (_token_ids(value, "input"),)
    inputs: list[str | tuple[int, ...]] = []
    tokens = 0
    for i, item in enumerate(value):
        where = f"input.{i}"
        if isinstance(item, str) and isinstance(first, str):
            if not item:
                raise RequestError("invalid_request", f"`{where}` must not be empty.", where)
            inputs.append(item)
        elif isinstance(item, list) and isinstance(first, list):
            ids = _token_ids(item, where)
            tokens += len(ids)
            inputs.append(ids)
        else:
            raise RequestError(
                "invalid_request",
                f"`{where}`: every element of `input` must be a string, or every one an array of token ids.",
                where,
            )
    if tokens > MAX_INPUT_TOKENS:
        raise RequestError(
            "invalid_request",
            f"`input` holds {tokens} tokens; at most {MAX_INPUT_TOKENS} are allowed in one request.",
            "input",
        )
    return tuple(inputs)


def _is_token(value: Any) -> bool:
    return type(value) is int


def _token_ids(value: list, where: str) -> tuple[int, ...]:
    if not value:
        raise RequestError("invalid_request", f"`{where}` must not be empty.", where)
    if len(value) > MAX_INPUT_TOKENS:
        raise RequestError(
            "invalid_request",
            f"`{where}` holds {len(value)} tokens; at most {MAX_INPUT_TOKENS} are allowed.",
            where,
        )
    for t in value:
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise RequestError(
                "invalid_request", f"`{where}` must be an array of non-negative integer token ids.", where
            )
    return tuple(value)


def input_tokens(inputs: Sequence[str | tuple[int, ...]], tokenizer: Any) -> int:
    """The tokens of a line's inputs as the engine counts them (``render_embeddings``): each text
    with the model's special tokens, token-id inputs as given."""
    return sum(
        len(item) if isinstance(item, tuple) else len(tokenizer.encode(item, add_special_tokens=True))
        for item in inputs
    )


# --------------------------------------------------------------------------- engine stage


@dataclass(frozen=True)
class RenderedEmbeddings:
    """What the engine runs for one embeddings line: each input's token ids, in order."""

    body: EmbeddingBody
    inputs: list[list[int]]
    pooling_params: Any  # vLLM's PoolingParams(task="embed"), shared by the inputs

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.inputs)


def render_embeddings(
    body: EmbeddingBody,
    tokenizer: Any,
    model_config: Any,
    prompt_token_ids: Sequence[int] | None = None,
) -> RenderedEmbeddings:
    """Token ids of each input (texts tokenized with the model's special tokens, as vLLM's
    embeddings server does) and the pooling parameters; raises RequestError for an input longer
    than the model's context, too many tokens in all, or `dimensions` the model cannot give.
    ``prompt_token_ids``: the single input's ids, tokenized at validation already."""
    from vllm.pooling_params import PoolingParams

    check_dimensions(body.dimensions, model_config)
    max_len = int(model_config.max_model_len)
    if prompt_token_ids is not None and len(body.inputs) == 1:
        inputs = [list(prompt_token_ids)]
    else:
        inputs = [
            list(item) if isinstance(item, tuple) else list(tokenizer.encode(item, add_special_tokens=True))
            for item in body.inputs
        ]
    total = 0
    for i, ids in enumerate(inputs):
        check_token_count(ids, "input" if len(inputs) == 1 else f"input.{i}", max_len)
        total += len(ids)
    if total > MAX_INPUT_TOKENS:
        raise RequestError(
            "invalid_request",
            f"`input` holds {total} tokens; at most {MAX_INPUT_TOKENS} are allowed in one request.",
            "input",
        )
    return RenderedEmbeddings(body, inputs, PoolingParams(task="embed", dimensions=body.dimensions))


def check_token_count(ids: list[int], where: str, max_len: int, remedy: str = "shorten it") -> None:
    """Refuse a pooled input (``where``: its param) with no tokens or more than the context holds."""
    if not ids:
        raise RequestError("invalid_request", f"`{where}` has no tokens.", where)
    if len(ids) > max_len:
        raise RequestError(
            "context_length_exceeded",
            f"This model's maximum context length is {max_len} tokens. However, `{where}` has "
            f"{len(ids)} tokens. Please {remedy}.",
            where,
        )


class PooledOutputs:
    """A line that ran as several vLLM pooling requests (``request_ids``, one per input, pair or
    text), whose outputs are kept by request id until every one is in: an embeddings line's and
    a scoring line's."""

    request_ids: list[str]
    outputs: dict[str, Any]

    def collect(self, output: Any) -> bool:
        """Keep one request's finished output; True once every one is in (the line is done)."""
        self.outputs[output.request_id] = output
        return len(self.outputs) >= len(self.request_ids)

    def finished(self, failed: Exception) -> tuple[list[Any], int]:
        """The outputs in request order and their cached prompt tokens; raises ``failed`` if vLLM
        failed any of them."""
        outputs = [self.outputs[i] for i in self.request_ids]
        if any(getattr(o, "error", None) is not None or o.outputs is None for o in outputs):
            raise failed
        return outputs, sum(int(o.num_cached_tokens or 0) for o in outputs)


@dataclass
class PooledLine(PooledOutputs):
    """One embeddings line in the engine: one vLLM pooling request per input (``request_ids``, in
    input order), and the outputs of those that finished."""

    rendered: RenderedEmbeddings
    request_ids: list[str]
    outputs: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return self.rendered.prompt_tokens

    def response(self, model: str) -> tuple[dict[str, Any], int]:
        """The line's response body and its cached prompt tokens. Raises EmbeddingFailed if vLLM
        failed an input; any other exception means the body could not be built."""
        outputs, cached = self.finished(EmbeddingFailed("The engine failed while embedding this request."))
        vectors = [o.outputs.data.float().tolist() for o in outputs]
        return embeddings_body(vectors, self.rendered.body.encoding_format, model, self.prompt_tokens), cached


class EmbeddingFailed(RuntimeError):
    """vLLM reported an error for one of the line's inputs (the line's 500)."""


def submit_embeddings(
    llm: Any,
    body: EmbeddingBody,
    prompt_token_ids: Sequence[int] | None,
    id_prefix: str,
    cache_salt: str | None,
    abort: Callable[[list[str]], None],
) -> PooledLine:
    """Render a line (`render_embeddings`) and hand each of its inputs to vLLM's engine (``llm``:
    its LLMEngine) as one pooling request, ids ``{id_prefix}.{i}``.

    All or nothing: if vLLM refuses an input, the inputs already added are aborted (``abort``).
    Raises RequestError for what the line is at fault for (an input vLLM blames, such as
    out-of-vocabulary token ids, names `input`); anything else is raised as it came (the line's 500)."""
    rendered = render_embeddings(body, llm.get_tokenizer(), llm.model_config, prompt_token_ids)
    request_ids = [f"{id_prefix}.{i}" for i in range(len(rendered.inputs))]
    added: list[str] = []
    try:
        for request_id, ids in zip(request_ids, rendered.inputs, strict=True):
            engine_input: dict[str, Any] = {"prompt_token_ids": ids}
            if cache_salt:
                engine_input["cache_salt"] = cache_salt
            llm.add_request(request_id, engine_input, rendered.pooling_params)
            added.append(request_id)
    except Exception as exc:
        if added:
            abort(added)
        from vllm.exceptions import VLLMClientError

        if isinstance(exc, (VLLMClientError, ValueError, TypeError)):
            message = str(exc.args[0]) if exc.args else str(exc)
            raise RequestError(
                "invalid_request", message[:1000], getattr(exc, "parameter", None) or "input"
            ) from exc
        raise
    return PooledLine(rendered, request_ids)


def check_dimensions(dimensions: int | None, model_config: Any) -> None:
    """`dimensions` is honoured only by models trained for shorter vectors (Matryoshka), and only
    for the lengths they were trained for; vLLM's own message names neither the field nor why."""
    if dimensions is None:
        return
    size = int(model_config.get_hidden_size())
    if not model_config.is_matryoshka:
        raise RequestError(
            "unsupported_parameter",
            f"This model does not support `dimensions`: its embeddings have {size} dimensions. Omit it.",
            "dimensions",
        )
    allowed = model_config.matryoshka_dimensions
    if allowed and dimensions not in allowed:
        listed = ", ".join(str(d) for d in allowed)
        raise RequestError(
            "invalid_request", f"`dimensions` must be one of {listed} for this model.", "dimensions"
        )
    if not 1 <= dimensions <= size:
        raise RequestError(
            "invalid_request", f"`dimensions` must be from 1 to {size} for this model.", "dimensions"
        )


def encode_embedding(values: Sequence[float], encoding_format: str) -> list[float] | str:
    """One vector as OpenAI sends it: float32 values as numbers, or their little-endian bytes in
    base64."""
    floats = array("f", values)  # float32, as the engine computed them
    if encoding_format == "base64":
        if sys.byteorder != "little":
            floats.byteswap()
        return base64.b64encode(floats.tobytes()).decode("ascii")
    return floats.tolist()


def embeddings_body(
    vectors: Sequence[Sequence[float]], encoding_format: str, model: str, prompt_tokens: int
) -> dict[str, Any]:
    """OpenAI's embeddings response: a list of `embedding` objects in input order, and usage
    counting input tokens only (an embedding writes none)."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_embedding(v, encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
