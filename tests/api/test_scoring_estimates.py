"""A price before the run for score and rerank files: priced by input tokens only, every pair (or
text) counted as the engine counts it: on the demo cross-encoder each pair as the tokenizer encodes
a text pair, on the demo embedding model each query and document once. No output tokens. The
estimate's task runs in-process, through Flask's test client on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

from api.app import create_app
from api.estimate_cli import table
from api.services.tenants import create_tenant
from tests.conftest import now
from tests.factories import http_create, http_upload
from workers import estimates, registration
from workers.registration import AddRequest

QUERY = "How is freight shipped across the sea?"
DOCS = ["By container ship, in standard boxes.", "By rail across the continent.", "In the hold of a plane."]


def _line(custom_id: str, url: str, model: str, **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": model, **body}}


def _estimate(runtime, client, headers: dict, endpoint: str, lines: list[dict]) -> dict:
    file_id = http_upload(client, headers, lines, "pairs.jsonl").get_json()["id"]
    made = http_create(client, headers, file_id, endpoint=endpoint, dry_run=True)
    assert made.status_code == 200, made.get_data(as_text=True)
    estimates.run(runtime, made.get_json()["id"])
    answer = client.get(f"/v1/batches/{made.get_json()['id']}", headers=headers).get_json()
    assert answer["status"] == "completed", answer
    return answer


def test_scores_are_priced_by_the_tokens_the_engine_will_count(
    runtime, score_model: Path, embed_model: Path
) -> None:
    from transformers import AutoTokenizer

    registration.add(runtime, AddRequest("rank", str(score_model)), echo=lambda _: None)
    registration.add(runtime, AddRequest("emb", str(embed_model)), echo=lambda _: None)
    _, key = create_tenant(runtime.db, "alpha", now())
    headers = {"Authorization": f"Bearer {key}"}
    client = create_app(runtime=runtime).test_client()

    cross = AutoTokenizer.from_pretrained(str(score_model))
    answer = _estimate(runtime, client, headers, "/v1/rerank", [
        _line("r1", "/v1/rerank", "rank", query=QUERY, documents=DOCS, top_n=1),
        _line("r2", "/v1/rerank", "rank", query=QUERY, documents=DOCS[0]),
    ])  # fmt: skip
    pairs = sum(len(cross(text=QUERY, text_pair=d)["input_ids"]) for d in DOCS)
    pairs += len(cross(text=QUERY, text_pair=DOCS[0])["input_ids"])
    e = answer["estimate"]
    assert (e["requests"], e["input_tokens"], e["input_tokens_lower_bound_requests"]) == (2, pairs, 0)
    assert e["output_tokens"]["max"] == 0  # every budget is 0
    assert "output tokens  none (a score writes no tokens" in table(answer)

    bi = AutoTokenizer.from_pretrained(str(embed_model))
    answer = _estimate(runtime, client, headers, "/v1/score", [
        _line("s1", "/v1/score", "emb", queries=QUERY, documents=DOCS),
        _line("s2", "/v1/score", "emb", text_1=[QUERY, DOCS[1]], text_2=[DOCS[2], DOCS[0]]),
    ])  # fmt: skip
    texts = [QUERY, *DOCS, QUERY, DOCS[1], DOCS[2], DOCS[0]]
    expected = sum(len(bi.encode(t, add_special_tokens=True)) for t in texts)
    assert answer["estimate"]["input_tokens"] == expected and answer["model"] == "emb"
