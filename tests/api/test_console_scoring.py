"""The console with score and rerank batches, through Flask's test client on SQLite and PostgreSQL:
the upload form makes a rerank batch for the demo cross-encoder and refuses it for a text model; a
job page shows input tokens and no output (a score writes none); the models page names a
cross-encoder's task. No worker runs: what a worker would record is written to the database."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from api.app import create_app
from api.services.tenants import create_tenant
from storage.models import Batch
from tests.api.test_console import html, sign_in
from tests.api.test_console_embeddings import upload
from tests.conftest import now
from workers import registration
from workers.registration import AddRequest

RERANK = "/v1/rerank"


@pytest.fixture
def alpha(runtime, score_model: Path):
    registration.add(runtime, AddRequest("rank", str(score_model)), echo=lambda _: None)
    _, key = create_tenant(runtime.db, "alpha", now())
    client = create_app(runtime=runtime).test_client()
    sign_in(client, key)
    return client


def _line(custom_id: str) -> dict:
    body = {"query": "what is json?", "documents": ["a format", "a fruit"]}
    return {"custom_id": custom_id, "method": "POST", "url": RERANK, "body": body}


def test_a_rerank_job_shows_input_tokens_and_no_output(alpha, runtime) -> None:
    refused = upload(alpha, RERANK, "demo", [_line("r0")])
    assert 400 <= refused.status_code < 500 and "&#39;demo&#39; generates text" in html(refused)
    made = upload(alpha, RERANK, "rank", [_line(f"r{i}") for i in range(4)])
    assert made.status_code == 302, made.get_data(as_text=True)
    batch_id = made.location.rsplit("/", 1)[-1]
    with runtime.db.write() as s:  # what its engine worker records: input tokens, none written
        row = s.get(Batch, batch_id)
        row.status, row.model, row.in_progress_at = "in_progress", "rank", int(now() - 10)
        row.request_total, row.request_completed, row.prompt_tokens = 4, 4, 120
    page = html(alpha.get(f"/console/jobs/{batch_id}"))
    assert f"rank · {RERANK}" in page
    assert re.search(r"<th>input \(uncached\)</th><td class=\"num\">120</td>", page)
    assert re.search(r'id="output-tokens"[^>]*>none \(scores\)</td>', page)


def test_the_models_page_names_a_cross_encoders_task(alpha) -> None:
    page = html(alpha.get("/console/models"))
    rank = re.search(r'<tr id="model-rank">(.*?)</tr>', page, re.S).group(1)
    assert '<td class="task">scores</td>' in rank
