"""/v1/score and /v1/rerank bodies: what `parse_body` accepts (vLLM's run-batch shapes, checked by
vLLM's own request classes) and how it refuses the rest, naming the field; a line reaches only a
model that scores (a cross-encoder or an embedding model); and the response bodies, in the shapes
`vllm serve` returns, built from finished pooling outputs. No engine."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.factories import chat_line
from workers.request_bodies import (
    RERANK,
    SCORE,
    UNSUPPORTED_ENDPOINTS,
    RequestError,
    endpoint_mismatch,
    parse_body,
    serves,
)
from workers.scoring import MAX_DOCUMENTS, ScoredLine, ScoringBody, ScoringFailed
from workers.validation import FileRules, LineError, ValidLine, check_line

SERVED = frozenset({"demo", "embed", "rank"})


def _rules(endpoint: str) -> FileRules:
    return FileRules(
        endpoint,
        SERVED,
        max_requests=10,
        max_line_bytes=1 << 16,
        embed_models=frozenset({"embed"}),
        score_models=frozenset({"rank"}),
    )


def score_line(custom_id: str = "s1", *, model: str = "rank", **body: Any) -> dict:
    body = body or {"queries": "what is a cat?", "documents": ["a cat is an animal", "a car"]}
    return {"custom_id": custom_id, "method": "POST", "url": SCORE, "body": {"model": model, **body}}


def rerank_line(custom_id: str = "r1", *, model: str = "rank", **body: Any) -> dict:
    body = body or {"query": "what is a cat?", "documents": ["a car", "a cat is an animal"]}
    return {"custom_id": custom_id, "method": "POST", "url": RERANK, "body": {"model": model, **body}}


def _parse(endpoint: str, **body: Any) -> ScoringBody:
    parsed = parse_body(endpoint, {"model": "rank", **body})
    assert parsed.endpoint == endpoint and parsed.max_tokens == 0 and parsed.model == "rank"
    assert isinstance(parsed.request, ScoringBody)
    return parsed.request


def _refused(endpoint: str, body: dict) -> RequestError:
    with pytest.raises(RequestError) as caught:
        parse_body(endpoint, {"model": "rank", **body})
    assert caught.value.status_code == 400
    return caught.value


def test_every_score_shape_vllm_run_batch_takes() -> None:
    one = _parse(SCORE, queries="q", documents=["a", "b", "c"])
    assert (one.queries, one.documents, one.pairs, one.n) == (
        ("q",),
        ("a", "b", "c"),
        [(0, 0), (0, 1), (0, 2)],
        3,
    )
    many = _parse(SCORE, queries=["q1", "q2"], documents=["a", "b"])
    assert many.pairs == [(0, 0), (1, 1)]
    for first, second in (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "items")):
        body = _parse(SCORE, **{first: "q", second: "d"})
        assert (body.queries, body.documents, body.query_param, body.document_param) == (
            ("q",),
            ("d",),
            first,
            second,
        )
    options = _parse(
        SCORE,
        queries="q",
        documents="d",
        truncate_prompt_tokens=20,
        truncation_side="left",
        max_tokens_per_query=5,
        max_tokens_per_doc=7,
        use_activation=False,
        user="u-1",
    )
    assert options.request.truncate_prompt_tokens == 20 and options.request.max_tokens_per_doc == 7
    assert options.request.to_pooling_params("classify").use_activation is False


def test_every_rerank_shape_vllm_run_batch_takes() -> None:
    body = _parse(RERANK, query="q", documents=["a", "b"], top_n=1)
    assert (body.queries, body.documents, body.top_n, body.pairs) == (("q",), ("a", "b"), 1, [(0, 0), (0, 1)])
    assert _parse(RERANK, query="q", documents="only one").documents == ("only one",)
    assert _parse(RERANK, query="q", documents=["a"]).top_n == 0


@pytest.mark.parametrize(
    ("endpoint", "body", "param", "message"),
    [
        (SCORE, {}, "queries", "`queries` and `documents` are required"),
        (SCORE, {"queries": "q"}, "documents", "`documents` is required"),
        (SCORE, {"queries": "q", "documents": []}, "documents", "`documents` is required"),
        (SCORE, {"queries": "", "documents": "d"}, "queries", "must not be empty"),
        (SCORE, {"queries": "q", "documents": ["a", ""]}, "documents.1", "non-empty string"),
        (SCORE, {"queries": "q", "documents": ["a", 5]}, "documents.1", "non-empty string"),
        (SCORE, {"queries": "q", "documents": 7}, "documents", "`documents` is required"),
        (SCORE, {"queries": ["a", "b", "c"], "documents": ["x", "y"]}, "queries", "1:N or N:N"),
        (
            SCORE,
            {"queries": "q", "documents": ["d"] * (MAX_DOCUMENTS + 1)},
            "documents",
            f"at most {MAX_DOCUMENTS}",
        ),
        (SCORE, {"queries": "q", "documents": "d", "text_2": "x"}, "text_2", "Unrecognized request argument"),
        (SCORE, {"queries": "q", "documents": "d", "top_n": 1}, "top_n", "Unrecognized request argument"),
        (SCORE, {"queries": "q", "documents": "d", "model": ""}, "model", "non-empty string"),
        (
            SCORE,
            {"queries": "q", "documents": "d", "max_tokens_per_doc": -1},
            "max_tokens_per_doc",
            "non-negative",
        ),
        (
            SCORE,
            {"queries": "q", "documents": "d", "truncation_side": "middle"},
            "truncation_side",
            "Invalid request",
        ),
        (
            SCORE,
            {"queries": "q", "documents": "d", "use_activation": "maybe"},
            "use_activation",
            "Invalid request",
        ),
        (RERANK, {"documents": ["a"]}, "query", "`query` is required: a non-empty string"),
        (RERANK, {"query": ["a", "b"], "documents": ["a"]}, "query", "`query` is required"),
        (RERANK, {"query": "q", "documents": []}, "documents", "`documents` is required"),
        (RERANK, {"query": "q", "documents": ["a"], "top_n": -1}, "top_n", "Invalid request"),
        (RERANK, {"query": "q", "documents": ["a"], "top_n": "two"}, "top_n", "Invalid request"),
        (
            RERANK,
            {"query": "q", "documents": ["a"], "queries": "x"},
            "queries",
            "Unrecognized request argument",
        ),
    ],
)
def test_each_malformed_body_is_refused_naming_the_field(
    endpoint: str, body: dict, param: str, message: str
) -> None:
    error = _refused(endpoint, body)
    assert (error.code, error.param) == ("invalid_request", param), error.message
    assert message in error.message


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        (RERANK, {"query": "q", "documents": [{"content": [{"type": "text", "text": "a"}]}]}, "documents.0"),
        (RERANK, {"query": {"content": []}, "documents": ["a"]}, "query"),
        (SCORE, {"queries": "q", "documents": "d", "cache_salt": "s"}, "cache_salt"),
        (SCORE, {"queries": "q", "documents": "d", "instruction": "judge"}, "instruction"),
        (SCORE, {"queries": "q", "documents": "d", "chat_template_kwargs": {}}, "chat_template_kwargs"),
        (RERANK, {"query": "q", "documents": "d", "priority": 3}, "priority"),
    ],
)
def test_what_a_batch_cannot_honour_is_unsupported(endpoint: str, body: dict, param: str) -> None:
    error = _refused(endpoint, body)
    assert (error.code, error.param) == ("unsupported_parameter", param), error.message


def test_which_task_serves_which_endpoint() -> None:
    assert serves("score", SCORE) and serves("score", RERANK) and not serves("score", "/v1/embeddings")
    assert serves("embed", SCORE) and serves("embed", RERANK) and serves("embed", "/v1/embeddings")
    assert not serves("generate", SCORE) and not serves("generate", RERANK)
    assert not serves("score", "/v1/chat/completions")
    assert "generates text; it does not serve /v1/rerank" in endpoint_mismatch("demo", RERANK, "generate")
    assert "is a cross-encoder" in endpoint_mismatch("rank", "/v1/chat/completions", "score")
    assert UNSUPPORTED_ENDPOINTS == {}  # the audio endpoints run on speech models (workers/transcription.py)


def test_score_and_rerank_lines_pass_validation_with_no_output_budget() -> None:
    for endpoint, line in ((SCORE, score_line()), (RERANK, rerank_line())):
        for model in ("rank", "embed"):  # a cross-encoder, or an embedding model scoring by cosine
            result = check_line(
                json.dumps({**line, "body": {**line["body"], "model": model}}).encode(), 1, _rules(endpoint)
            )
            assert isinstance(result, ValidLine), result
            assert result.model == model and result.row.max_tokens == 0


def test_a_line_for_a_model_that_does_not_score_is_refused_naming_the_model() -> None:
    to_generate = check_line(json.dumps(rerank_line(model="demo")).encode(), 2, _rules(RERANK))
    assert isinstance(to_generate, LineError)
    assert (to_generate.line, to_generate.code, to_generate.param) == (2, "invalid_model", "body.model")
    assert "'demo' generates text; it does not serve /v1/rerank" in to_generate.message
    to_scorer = check_line(
        json.dumps(chat_line("c", model="rank")).encode(), 3, _rules("/v1/chat/completions")
    )
    assert isinstance(to_scorer, LineError) and to_scorer.code == "invalid_model"
    assert (
        "'rank' is a cross-encoder (a scoring model); it serves /v1/score and /v1/rerank only"
        in to_scorer.message
    )


def test_a_malformed_line_is_its_lines_error_naming_the_body_field() -> None:
    bad = score_line(queries="q", documents=[])
    result = check_line(json.dumps(bad).encode(), 4, _rules(SCORE))
    assert isinstance(result, LineError)
    assert (result.line, result.code, result.param) == (4, "invalid_request", "body.documents")


@dataclass
class _Pooled:
    data: torch.Tensor


@dataclass
class _Output:
    request_id: str
    outputs: Any
    num_cached_tokens: int = 0
    error: Any = None


def test_a_cross_encoders_pairs_become_a_score_response_in_request_order() -> None:
    body = _parse(SCORE, queries="q", documents=["a", "b"])
    line = ScoredLine(body, ["x.0", "x.1"], prompt_tokens=12, bi_encoder=False)
    assert not line.collect(_Output("x.1", _Pooled(torch.tensor([0.25])), 4))
    assert line.collect(_Output("x.0", _Pooled(torch.tensor([0.75]))))
    response, cached = line.response("rank")
    assert cached == 4
    assert (
        response["object"] == "list" and response["model"] == "rank" and response["id"].startswith("score-")
    )
    assert [(d["index"], d["object"], d["score"]) for d in response["data"]] == [
        (0, "score", 0.75),
        (1, "score", 0.25),
    ]
    assert response["usage"]["prompt_tokens"] == 12 and response["usage"]["total_tokens"] == 12


def test_a_rerank_response_orders_documents_by_relevance_and_keeps_the_top_n() -> None:
    body = _parse(RERANK, query="q", documents=["low", "high", "mid"], top_n=2)
    line = ScoredLine(body, ["r.0", "r.1", "r.2"], prompt_tokens=9, bi_encoder=False)
    for request_id, score in (("r.0", 0.1), ("r.1", 0.9), ("r.2", 0.5)):
        line.collect(_Output(request_id, _Pooled(torch.tensor([score]))))
    response, _ = line.response("rank")
    assert [(r["index"], r["document"]["text"]) for r in response["results"]] == [(1, "high"), (2, "mid")]
    assert response["results"][0]["relevance_score"] == pytest.approx(0.9)
    assert response["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    assert response["id"].startswith("rerank-") and response["model"] == "rank"


def test_an_embedding_models_score_is_the_cosine_of_query_and_document() -> None:
    body = _parse(SCORE, queries="q", documents=["same", "opposite"])
    line = ScoredLine(body, ["e.0", "e.1", "e.2"], prompt_tokens=6, bi_encoder=True)
    vectors = {"e.0": [1.0, 0.0], "e.1": [2.0, 0.0], "e.2": [-1.0, 0.0]}
    for request_id, vector in vectors.items():
        line.collect(_Output(request_id, _Pooled(torch.tensor(vector))))
    response, _ = line.response("embed")
    assert [d["score"] for d in response["data"]] == pytest.approx([1.0, -1.0])


def test_a_failed_sequence_fails_the_line() -> None:
    body = _parse(SCORE, queries="q", documents=["a"])
    line = ScoredLine(body, ["f.0"], prompt_tokens=3, bi_encoder=False)
    line.collect(_Output("f.0", None, error="boom"))
    with pytest.raises(ScoringFailed):
        line.response("rank")


def test_lines_are_keyed_by_their_query_so_one_querys_pairs_sort_together(score_model) -> None:
    from scheduler.ordering import prompt_key
    from workers.prompt_tokens import PromptRenderer

    renderer = PromptRenderer.load(score_model, 64)
    query = "How is freight shipped across the sea?"
    expected = prompt_key(renderer.tokenizer.encode(query, add_special_tokens=True), 64)
    bodies = [
        (RERANK, {"model": "rank", "query": query, "documents": ["by ship", "by rail"]}),
        (RERANK, {"model": "rank", "query": query, "documents": ["by plane"], "top_n": 1}),
        (SCORE, {"model": "rank", "queries": [query, "other"], "documents": ["a", "b"]}),
        (SCORE, {"model": "rank", "text_1": query, "text_2": "a"}),
    ]
    keys = [renderer.render(endpoint, body) for endpoint, body in bodies]
    assert all(k.key == expected and not k.exact for k in keys)
    other = renderer.render(RERANK, {"model": "rank", "query": "Another question", "documents": ["a"]})
    assert other.key != expected
