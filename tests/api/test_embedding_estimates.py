"""A price before the run for an embeddings file (issue #22 s1, s5): priced by input tokens only,
as the metering counts them (every input of a line, with the model's special tokens), no output
tokens; the estimate's task run in-process, through Flask's test client on SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from api.app import create_app
from api.estimate_cli import table
from api.services.tenants import create_tenant
from storage.models import Batch, EngineSample, WorkUnit
from storage.status import UnitStatus
from tests.conftest import now
from tests.factories import embedding_line, http_create, http_upload
from workers import estimates, registration
from workers.registration import AddRequest

EMBEDDINGS = "/v1/embeddings"
DOC = "A long document about the shipping of freight by rail, road and sea, " * 4


@pytest.fixture
def settings(settings):
    """$3.60 an engine hour."""
    return dataclasses.replace(settings, instance_price_per_hour=3.6)


def add_history(runtime, tenant_id: str, file_id: str) -> None:
    """The embedding model embedded 10 of the tenant's inputs (no output tokens); its one engine
    computed 2,000 prompt tokens in 10 busy seconds: 200 tokens/s."""
    t = time.time()
    with runtime.db.write() as s:
        batch = Batch(id="batch_embed_history", tenant_id=tenant_id, endpoint=EMBEDDINGS, input_file_id=file_id,
                      completion_window="24h", status="completed", created_at=int(t) - 60, expires_at=int(t) + 86400)  # fmt: skip
        s.add(batch)
        s.flush()
        s.add(WorkUnit(batch_id=batch.id, seq=0, model="emb", shard_key="k", first_line=1, n_requests=10,
                       status=UnitStatus.DONE, finished_at=t - 5, completed=10, completion_tokens=0))  # fmt: skip
        s.add(EngineSample(worker="w1", model="emb", started_at=t - 15, seconds=10.0, steps=20, running_mean=4,
                           waiting_mean=0, max_num_seqs=8, prompt_tokens=2000, cached_tokens=0,
                           output_tokens=0, requests=10))  # fmt: skip


def test_embeddings_are_priced_by_their_input_tokens_only(runtime, embed_model: Path) -> None:
    from transformers import AutoTokenizer

    registration.add(runtime, AddRequest("emb", str(embed_model)), echo=lambda _: None)
    tenant, key = create_tenant(runtime.db, "alpha", now())
    headers = {"Authorization": f"Bearer {key}"}
    client = create_app(runtime=runtime).test_client()
    lines = [
        embedding_line("one", DOC + "one", model="emb"),
        embedding_line("several", [DOC + "two", "a short text", DOC + "three"], model="emb"),
        embedding_line("ids", [[1, 5, 9], [1, 7]], model="emb"),
        embedding_line("b64", DOC + "four", model="emb", encoding_format="base64", dimensions=64),
        embedding_line("typo", DOC + "five", model="emb-typo"),  # refused alone: runs as its error
    ]
    file_id = http_upload(client, headers, lines, "corpus.jsonl").get_json()["id"]
    add_history(runtime, tenant.id, file_id)
    made = http_create(client, headers, file_id, endpoint=EMBEDDINGS, dry_run=True)
    assert made.status_code == 200, made.get_data(as_text=True)
    estimates.run(runtime, made.get_json()["id"])
    answer = client.get(f"/v1/batches/{made.get_json()['id']}", headers=headers).get_json()
    assert answer["status"] == "completed" and answer["model"] == "emb", answer
    e = answer["estimate"]

    # every input counted, as the engine tokenizes it: a line of several inputs too (exactly)
    tokenizer = AutoTokenizer.from_pretrained(str(embed_model))

    def tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=True))

    expected = tokens(DOC + "one") + tokens(DOC + "two") + tokens("a short text") + tokens(DOC + "three")
    expected += 5 + tokens(DOC + "four")
    # the line naming a model not served here is a request that costs nothing
    assert (e["requests"], e["input_tokens"], e["input_tokens_lower_bound_requests"]) == (5, expected, 0)
    # no output: every budget is 0, and the model's history (its units wrote none) agrees
    assert e["output_tokens"] == {"max": 0, "typical": 0, "typical_per_request": 0.0}
    # engine seconds are the uncached input tokens at the model's rate: one figure, no range
    uncached = e["input_tokens"] - e["cached_input_tokens"]
    assert e["engine_seconds"] == {"low": round(uncached / 200, 3), "high": round(uncached / 200, 3)}
    assert e["cost"]["total"]["low"] == e["cost"]["total"]["high"] > 0
    assert e["cost"]["total"]["low"] == pytest.approx(uncached / 200 * 3.6 / 3600, abs=2e-6)

    printed = table(answer)
    assert f"requests       5 for emb ({EMBEDDINGS})" in printed
    assert "output tokens  none (an embedding writes no tokens" in printed and "max_tokens" not in printed


def test_a_model_that_caches_nothing_is_priced_with_no_cache_hits(runtime, embed_model: Path) -> None:
    """The same file estimated for the demo embedding model as it is (LAST pooling: vLLM caches
    the shared prefix, so hits are predicted and cost less) and registered with MEAN pooling
    (vLLM caches nothing: every input token predicted computed)."""
    quiet = lambda _: None  # noqa: E731
    registration.add(runtime, AddRequest("emb", str(embed_model)), echo=quiet)
    mean = AddRequest(
        "emb-mean", str(embed_model), engine_args=('pooler_config={"seq_pooling_type": "MEAN"}',)
    )
    registration.add(runtime, mean, echo=quiet)
    _, key = create_tenant(runtime.db, "alpha", now())
    headers = {"Authorization": f"Bearer {key}"}
    client = create_app(runtime=runtime).test_client()
    estimated = {}
    for model in ("emb", "emb-mean"):
        lines = [embedding_line(f"{i}", DOC * 4 + f"item {i}", model=model) for i in range(6)]
        file_id = http_upload(client, headers, lines, f"{model}.jsonl").get_json()["id"]
        made = http_create(client, headers, file_id, endpoint=EMBEDDINGS, dry_run=True)
        assert made.status_code == 200, made.get_data(as_text=True)
        estimates.run(runtime, made.get_json()["id"])
        estimated[model] = client.get(f"/v1/batches/{made.get_json()['id']}", headers=headers).get_json()[
            "estimate"
        ]
    assert estimated["emb"]["input_tokens"] == estimated["emb-mean"]["input_tokens"]
    assert estimated["emb"]["cached_input_tokens"] >= 5 * 128
    assert estimated["emb-mean"]["cached_input_tokens"] == 0
