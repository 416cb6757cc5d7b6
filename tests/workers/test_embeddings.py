"""/v1/embeddings bodies: what `parse_body` accepts and how it refuses the rest (each refusal names
the element at fault), the vectors' two encodings, and how a line's inputs are collected back into
one response. No engine, no tokenizer."""

from __future__ import annotations

import base64
import struct
from typing import Any

import pytest

from tests.factories import decode_base64_embedding
from workers.embeddings import (
    MAX_INPUT_TOKENS,
    MAX_INPUTS,
    EmbeddingBody,
    EmbeddingFailed,
    PooledLine,
    RenderedEmbeddings,
    embeddings_body,
    encode_embedding,
)
from workers.request_bodies import EMBEDDINGS, RequestError, parse_body


def _parse(**body: object) -> EmbeddingBody:
    parsed = parse_body(EMBEDDINGS, {"model": "embed", **body})
    assert parsed.endpoint == EMBEDDINGS and parsed.max_tokens == 0
    return parsed.request


def _refused(body: dict) -> RequestError:
    with pytest.raises(RequestError) as caught:
        parse_body(EMBEDDINGS, body)
    assert caught.value.status_code == 400
    return caught.value


def test_every_input_shape_openai_takes() -> None:
    assert _parse(input="one text").inputs == ("one text",)
    texts = _parse(input=["a", "b", "a"])
    assert texts.inputs == ("a", "b", "a") and texts.n == 3
    assert _parse(input=[1, 2, 3]).inputs == ((1, 2, 3),)  # token ids: one input
    assert _parse(input=[[1, 2], [3]]).inputs == ((1, 2), (3,))
    full = _parse(input="x", encoding_format="base64", dimensions=64, user="u-1")
    assert (full.encoding_format, full.dimensions) == ("base64", 64)
    assert _parse(input="x").encoding_format == "float"
    assert _parse(input="x", encoding_format=None).encoding_format == "float"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({}, "input", "`input` is required"),
        ({"input": ""}, "input", "must not be empty"),
        ({"input": []}, "input", "`input` is required"),
        ({"input": ["a", ""]}, "input.1", "`input.1` must not be empty"),
        ({"input": [[1], []]}, "input.1", "`input.1` must not be empty"),
        ({"input": ["a", [1]]}, "input.1", "every element of `input` must be a string"),
        ({"input": [[1], "a"]}, "input.1", "every element"),
        ({"input": [1, "a"]}, "input", "non-negative integer token ids"),
        ({"input": [1, -2]}, "input", "non-negative integer token ids"),
        ({"input": [1, True]}, "input", "non-negative integer token ids"),
        ({"input": [[1, 2.5]]}, "input.0", "non-negative integer token ids"),
        ({"input": [[1, 2**31]]}, "input.0", "non-negative integer token ids"),
        ({"input": 7}, "input", "`input` is required"),
        ({"input": {"text": "a"}}, "input", "`input` is required"),
        ({"input": ["a"] * (MAX_INPUTS + 1)}, "input", f"at most {MAX_INPUTS}"),
        ({"input": [[1] * 200_000, [1] * 200_000]}, "input", f"at most {MAX_INPUT_TOKENS}"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", '"float" or "base64"'),
        ({"input": "a", "dimensions": 0}, "dimensions", "positive integer"),
        ({"input": "a", "dimensions": "64"}, "dimensions", "positive integer"),
        ({"input": "a", "dimensions": True}, "dimensions", "positive integer"),
        ({"input": "a", "user": 5}, "user", "`user` must be a string"),
        ({"input": "a", "model": ""}, "model", "non-empty string"),
        (
            {"input": "a", "normalize": False},
            "normalize",
            "Unrecognized request argument supplied: normalize",
        ),
        ({"input": "a", "temperature": 0}, "temperature", "Unrecognized request argument"),
    ],
)
def test_each_bad_body_is_refused_naming_the_field(body: dict, param: str, message: str) -> None:
    error = _refused(body)
    assert error.param == param and message in error.message, error
    assert error.code == "invalid_request"


def test_what_no_json_line_holds_is_refused_not_crashed() -> None:
    assert _refused({"input": float("nan")}).param == "body"
    assert _refused([1, 2]).param == "body"  # type: ignore[arg-type]


def test_float_encoding_is_the_float32_values() -> None:
    assert encode_embedding([0.5, -1.25, 3.0], "float") == [0.5, -1.25, 3.0]
    # float32 rounding, as the engine computed them: 0.1 is not a float32
    assert encode_embedding([0.1], "float") == [struct.unpack("<f", struct.pack("<f", 0.1))[0]]


def test_base64_is_little_endian_float32_and_round_trips() -> None:
    values = [0.5, -1.25, 3.0, 1e-8, -0.0]
    text = encode_embedding(values, "base64")
    assert isinstance(text, str)
    raw = base64.b64decode(text)
    assert len(raw) == 4 * len(values)
    assert list(struct.unpack(f"<{len(values)}f", raw)) == encode_embedding(values, "float")
    assert decode_base64_embedding(text) == encode_embedding(values, "float")


def test_response_body_is_openais_shape() -> None:
    body = embeddings_body([[1.0, 0.0], [0.0, 1.0]], "float", "embed", prompt_tokens=7)
    assert body == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": [1.0, 0.0]},
            {"object": "embedding", "index": 1, "embedding": [0.0, 1.0]},
        ],
        "model": "embed",
        "usage": {"prompt_tokens": 7, "total_tokens": 7},
    }
    encoded = embeddings_body([[1.0, 0.0]], "base64", "embed", prompt_tokens=2)
    assert decode_base64_embedding(encoded["data"][0]["embedding"]) == [1.0, 0.0]


def _pooled(request_id: str, values: list[float], cached: int = 0, failed: bool = False) -> Any:
    """vLLM's own output of one finished pooling request, as its output processor builds it: a
    failed one carries vLLM's RequestError. Built, not run: a request vLLM accepted fails inside
    its engine only on a fault (a worker crash, an out-of-memory) that no input can cause, so the
    failure path is reached with vLLM's own object here; the success path also runs on the real
    engine in tests/workers/test_scoring_engine.py and tests/e2e/test_embeddings_live.py."""
    import torch
    from vllm.outputs import PoolingOutput, PoolingRequestOutput
    from vllm.outputs import RequestError as VllmRequestError

    error = VllmRequestError("internal_error", "the engine failed") if failed else None
    return PoolingRequestOutput(
        request_id, PoolingOutput(torch.tensor(values)), [1, 2], cached, True, error=error
    )


def _line(encoding: str = "float") -> PooledLine:
    body = EmbeddingBody(("first", "second"), encoding)
    rendered = RenderedEmbeddings(body, [[1, 2, 3], [4, 5]], pooling_params=None)
    return PooledLine(rendered, ["freight-7.0", "freight-7.1"])


def test_a_line_of_several_inputs_ends_with_its_last_and_keeps_input_order() -> None:
    line = _line()
    assert line.prompt_tokens == 5
    assert not line.collect(_pooled("freight-7.1", [0.0, 1.0], cached=0))  # finished first
    assert line.collect(_pooled("freight-7.0", [1.0, 0.0], cached=3))
    body, cached = line.response("embed")
    assert body == embeddings_body([[1.0, 0.0], [0.0, 1.0]], "float", "embed", prompt_tokens=5)
    assert cached == 3


def test_an_input_vllm_failed_fails_the_line() -> None:
    line = _line("base64")
    line.collect(_pooled("freight-7.0", [1.0, 0.0]))
    assert line.collect(_pooled("freight-7.1", [0.0, 1.0], failed=True))
    with pytest.raises(EmbeddingFailed, match="failed while embedding"):
        line.response("embed")
