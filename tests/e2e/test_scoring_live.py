"""Score and rerank batches end to end on the live stack: the demo cross-encoder registered with the
CLI (its task, "score", found from its architecture), its engine worker started from the registry
entry on vLLM's pooling runner, a /v1/score and a /v1/rerank batch run through the official client
at once. Every line ends once in the output or the error file: the good ones in vLLM's
ScoreResponse and RerankResponse shapes with usage counting the pairs' tokens, what the engine
refuses (a pair past the context, a token limit past it, multimodal content) as that line's 400
while the rest runs. A file naming a text-generation model fails at validation, naming the line;
an audio batch is refused at create while no speech model is served."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path
from typing import Any

import openai
import pyarrow.parquet as pq
import pytest

from infra.processes import FREIGHT, REPO
from tests.e2e.batch_client import converted
from tests.e2e.conftest import LiveStack, engine_worker, wait_final
from tests.factories import jsonl

pytestmark = pytest.mark.stack

MODEL = "rank-live"
QUERY = "What does json.dumps do?"
DOCS = ["Serialize obj to a JSON formatted str.", "Return the absolute value of a number.", "Open a file."]


def _freight(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FREIGHT, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _line(custom_id: str, url: str, model: str = MODEL, **body: Any) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": model, **body}}


def test_score_and_rerank_batches_run_on_a_cross_encoder(live: LiveStack, score_model: Path) -> None:
    env = live.worker_env
    added = _freight(env, "models", "add", MODEL, "--path", str(score_model))
    assert added.returncode == 0, added.stderr[-2000:]
    assert "a cross-encoder: it serves /v1/score and /v1/rerank" in added.stdout
    try:
        served = {m.id: m.model_extra["x_freight"] for m in live.client("alpha").models.list().data}
        assert (served[MODEL]["task"], served[MODEL]["quantization"]) == ("score", "none")
        _refused_before_running(live)
        _run(live, env, score_model)
    finally:
        removed = _freight(env, "models", "remove", MODEL)
        assert removed.returncode == 0, removed.stderr


def _refused_before_running(live: LiveStack) -> None:
    client = live.client("alpha")
    wrong = _line("r-1", "/v1/rerank", model="demo", query="q", documents=["a"])
    upload = client.files.create(file=("wrong.jsonl", jsonl([wrong])), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/rerank", completion_window="24h")  # type: ignore[arg-type]
    final = wait_final(client, batch.id, timeout=120)
    assert final.status == "failed", final
    (error,) = final.errors.data
    assert (error.code, error.line, error.param) == ("invalid_model", 1, "body.model"), error
    assert "'demo' generates text; it does not serve /v1/rerank" in error.message
    for endpoint in ("/v1/audio/transcriptions", "/v1/audio/translations"):  # no speech model here
        with pytest.raises(openai.BadRequestError) as refused:
            client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
        assert refused.value.code == "endpoint_not_served" and "speech model" in refused.value.message


def _run(live: LiveStack, env: dict[str, str], score_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(score_model))
    client = live.client("alpha")
    score_lines = [
        _line("one-to-many", "/v1/score", queries=QUERY, documents=DOCS),
        _line("pairs", "/v1/score", text_1=[QUERY, QUERY], text_2=[DOCS[2], DOCS[0]]),
        _line("too-long", "/v1/score", queries=QUERY, documents=["word " * 3000]),
        _line("limit", "/v1/score", queries=QUERY, documents=DOCS, max_tokens_per_doc=100_000),
    ]
    rerank_lines = [
        _line("top-2", "/v1/rerank", query=QUERY, documents=DOCS, top_n=2),
        _line("all", "/v1/rerank", query=QUERY, documents=DOCS, user="u-7"),
        _line("image", "/v1/rerank", query=QUERY, documents=[{"content": [{"type": "text", "text": "a"}]}]),
        # a text-generation model's line: refused alone, the rest of its batch runs
        _line("for-generate", "/v1/rerank", model="demo", query=QUERY, documents=DOCS),
    ]
    batches = {}
    for endpoint, lines in (("/v1/score", score_lines), ("/v1/rerank", rerank_lines)):
        upload = client.files.create(file=("pairs.jsonl", jsonl(lines)), purpose="batch")
        batches[endpoint] = client.batches.create(
            input_file_id=upload.id,
            endpoint=endpoint,  # type: ignore[arg-type]
            completion_window="24h",
        )

    with engine_worker(live, MODEL, "engine-rank-live", env, "cross-encoder engine worker"):
        finals = {endpoint: wait_final(client, b.id, timeout=300) for endpoint, b in batches.items()}

    def files(final: Any) -> tuple[dict[str, dict], dict[str, dict]]:
        assert final.status == "completed", final
        out = [json.loads(x) for x in client.files.content(final.output_file_id).text.splitlines()]
        err = [json.loads(x) for x in client.files.content(final.error_file_id).text.splitlines()]
        ids = [r["custom_id"] for r in out + err]
        assert len(ids) == len(set(ids)), ids  # every line once
        return {r["custom_id"]: r for r in out}, {r["custom_id"]: r for r in err}

    def tokens(query: str, document: str) -> int:  # a pair as vLLM's cross-encoder renders it
        return len(tokenizer(text=query, text_pair=document)["input_ids"])

    pair_tokens = [tokens(QUERY, d) for d in DOCS]
    out, err = files(finals["/v1/score"])
    assert set(out) == {"one-to-many", "pairs"} and set(err) == {"too-long", "limit"}
    body = out["one-to-many"]["response"]["body"]
    assert out["one-to-many"]["response"]["status_code"] == 200 and body["model"] == MODEL
    assert body["object"] == "list" and [(d["index"], d["object"]) for d in body["data"]] == [
        (0, "score"), (1, "score"), (2, "score")
    ]  # fmt: skip
    scores = [d["score"] for d in body["data"]]
    pairs = [d["score"] for d in out["pairs"]["response"]["body"]["data"]]
    assert pairs == pytest.approx([scores[2], scores[0]], abs=2e-3)  # a pair scores alike anywhere
    assert body["usage"]["prompt_tokens"] == sum(pair_tokens) == body["usage"]["total_tokens"]
    assert err["too-long"]["response"]["status_code"] == 400
    assert err["limit"]["response"]["body"]["error"]["param"] == "max_tokens_per_doc"

    out, err = files(finals["/v1/rerank"])
    assert set(out) == {"top-2", "all"} and set(err) == {"image", "for-generate"}
    ranked = out["all"]["response"]["body"]["results"]
    assert [r["index"] for r in ranked] == sorted(range(3), key=lambda i: -scores[i])
    assert all(r["document"]["text"] == DOCS[r["index"]] for r in ranked)
    assert [r["index"] for r in out["top-2"]["response"]["body"]["results"]] == [
        r["index"] for r in ranked[:2]
    ]
    assert out["all"]["response"]["body"]["usage"] == {
        "prompt_tokens": sum(pair_tokens),
        "total_tokens": sum(pair_tokens),
    }
    image = err["image"]["response"]
    assert image["status_code"] == 400 and image["body"]["error"]["code"] == "unsupported_parameter"
    assert image["body"]["error"]["param"] == "documents.0"
    wrong = err["for-generate"]["response"]
    assert wrong["status_code"] == 400, wrong
    assert (wrong["body"]["error"]["code"], wrong["body"]["error"]["param"]) == ("invalid_model", "model")
    assert "'demo' generates text; it does not serve /v1/rerank" in wrong["body"]["error"]["message"]

    rerank = finals["/v1/rerank"]
    assert rerank.usage.input_tokens == 2 * sum(pair_tokens) and rerank.usage.output_tokens == 0
    assert (rerank.request_counts.completed, rerank.request_counts.failed) == (2, 2)
    cost = rerank.model_extra["x_freight"]["cost"]
    assert cost["engine_seconds"] > 0

    # Parquet out: a row per ranked document, with its rank, index, text and score
    raw = converted(
        lambda: client.files.with_raw_response.content(
            rerank.output_file_id, extra_query={"format": "parquet"}
        )
    )
    assert raw.headers["content-type"] == "application/vnd.apache.parquet"
    table = pq.read_table(io.BytesIO(raw.content)).to_pylist()
    by_line = {key: [r for r in table if r["custom_id"] == key] for key in ("all", "top-2")}
    assert [(r["rank"], r["score_index"], r["document"]) for r in by_line["all"]] == [
        (position, r["index"], DOCS[r["index"]]) for position, r in enumerate(ranked)
    ]
    assert [r["score"] for r in by_line["all"]] == [r["relevance_score"] for r in ranked]
    assert len(by_line["top-2"]) == 2 and sum(r["prompt_tokens"] or 0 for r in table) == 2 * sum(pair_tokens)
