"""Score and rerank lines on vLLM's engine: the demo cross-encoder (one pooling request per pair,
rendered by vLLM's own cross-encoder processor) and the demo embedding model (the cosine of query
and document vectors). A pair scores the same in any line, shape or position; usage counts the
pair's tokens as vLLM renders them; what the line is at fault for is its own 400."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from workers.engine import Engine, EngineConfig, EngineRequest, EngineResult

SCORE, RERANK = "/v1/score", "/v1/rerank"
QUERY = "what does json.dumps do?"
DOCS = ["Serialize obj to a JSON formatted str.", "Return the absolute value.", "Open a file."]


def _engine(path: Path, name: str, task: str) -> Engine:
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return Engine.start(
        EngineConfig(
            model_path=str(path),
            served_name=name,
            max_num_seqs=16,
            max_model_len=256,
            kv_cache_bytes=16 * 1024 * 1024,
            enforce_eager=True,
            task=task,
        )
    )


def test_an_embedding_model_scores_by_cosine(embed_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(embed_model))
    engine = _engine(embed_model, "embed", "embed")
    try:
        results = _run(
            engine,
            {
                "same": (SCORE, {"model": "embed", "queries": QUERY, "documents": [QUERY, DOCS[1]]}),
                "rerank": (RERANK, {"model": "embed", "query": QUERY, "documents": [DOCS[1], QUERY]}),
                "embeddings": ("/v1/embeddings", {"model": "embed", "input": QUERY}),
            },
        )
    finally:
        engine.shutdown()
    assert all(r.ok for r in results.values()), {k: r.error for k, r in results.items()}
    same, other = (d["score"] for d in results["same"].body["data"])
    assert same == pytest.approx(1.0, abs=1e-2) and other < same
    ranked = results["rerank"].body["results"]
    assert [r["index"] for r in ranked] == [1, 0] and ranked[0]["relevance_score"] == pytest.approx(
        1.0, abs=1e-2
    )
    # the query once, then each document (vLLM's bi-encoder counts the texts it embeds)
    query, doc = (len(tokenizer.encode(t, add_special_tokens=True)) for t in (QUERY, DOCS[1]))
    assert results["embeddings"].prompt_tokens == query
    assert results["same"].body["usage"]["prompt_tokens"] == results["same"].prompt_tokens == 2 * query + doc


@pytest.fixture(scope="module")
def cross_encoder(score_model: Path) -> Iterator[Engine]:
    engine = _engine(score_model, "rank", "score")
    yield engine
    engine.shutdown()


def _run(engine: Engine, lines: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, EngineResult]:
    requests = [EngineRequest(key, endpoint, body) for key, (endpoint, body) in lines.items()]
    results = {r.key: r for r in engine.run(requests)}
    assert set(results) == set(lines)
    return results


def test_a_cross_encoder_scores_pairs_and_reranks_documents(cross_encoder: Engine, score_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(score_model))
    results = _run(
        cross_encoder,
        {
            "one-to-many": (SCORE, {"model": "rank", "queries": QUERY, "documents": DOCS}),
            "pairs": (SCORE, {"model": "rank", "text_1": [QUERY, QUERY], "text_2": [DOCS[2], DOCS[0]]}),
            "rerank": (RERANK, {"model": "rank", "query": QUERY, "documents": DOCS, "top_n": 2}),
            "all": (RERANK, {"model": "rank", "query": QUERY, "documents": DOCS}),
            "too-long": (SCORE, {"model": "rank", "queries": QUERY, "documents": ["word " * 400]}),
            "truncated": (
                SCORE,
                {
                    "model": "rank",
                    "queries": QUERY,
                    "documents": ["word " * 400],
                    "truncate_prompt_tokens": -1,
                },
            ),
            "salted": (RERANK, {"model": "rank", "query": QUERY, "documents": DOCS, "cache_salt": "mine"}),
            "limit": (
                RERANK,
                {"model": "rank", "query": QUERY, "documents": DOCS, "max_tokens_per_doc": 256},
            ),
            "chat": (
                "/v1/chat/completions",
                {"model": "rank", "messages": [{"role": "user", "content": "hi"}]},
            ),
        },
    )
    ok = {k: r for k, r in results.items() if r.ok}
    assert set(ok) == {"one-to-many", "pairs", "rerank", "all", "truncated"}, {
        k: r.error for k, r in results.items()
    }
    assert ok["truncated"].prompt_tokens == 256  # cut to the model's context, as vLLM cuts it
    scores = [d["score"] for d in ok["one-to-many"].body["data"]]
    body = ok["one-to-many"].body
    assert body["object"] == "list" and body["model"] == "rank"
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "score"), (1, "score"), (2, "score")]
    assert all(0.0 <= s <= 1.0 for s in scores)  # one logit through vLLM's sigmoid
    # a pair scores the same in any line and position (to float rounding)
    pairs = [d["score"] for d in ok["pairs"].body["data"]]
    assert pairs == pytest.approx([scores[2], scores[0]], abs=1e-3)
    ranked = ok["all"].body["results"]
    assert [r["index"] for r in ranked] == sorted(range(3), key=lambda i: -scores[i])
    assert [r["relevance_score"] for r in ranked] == pytest.approx(sorted(scores, reverse=True), abs=1e-3)
    assert all(r["document"]["text"] == DOCS[r["index"]] for r in ranked)
    assert [r["index"] for r in ok["rerank"].body["results"]] == [r["index"] for r in ranked[:2]]
    # usage: each pair as the tokenizer encodes a text pair (vLLM's cross-encoder rendering)
    tokens = [len(tokenizer(text=QUERY, text_pair=d)["input_ids"]) for d in DOCS]
    assert body["usage"]["prompt_tokens"] == sum(tokens) == ok["one-to-many"].prompt_tokens
    assert ok["rerank"].body["usage"] == {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}
    assert ok["one-to-many"].completion_tokens == 0

    assert results["salted"].error["code"] == "unsupported_parameter"  # Freight salts per tenant itself
    for key in ("too-long", "limit", "chat", "salted"):
        assert results[key].status_code == 400, results[key]
    too_long = results["too-long"].error
    assert (too_long["code"], too_long["param"]) == ("context_length_exceeded", "documents"), too_long
    assert "maximum context length is 256 tokens" in too_long["message"]
    assert results["limit"].error["param"] == "max_tokens_per_doc"
    assert (
        results["chat"].error["code"] == "invalid_model"
        and "a cross-encoder" in results["chat"].error["message"]
    )
