"""The console with embeddings batches (issue #22 s1), through Flask's test client on SQLite and
PostgreSQL: the upload form makes one and refuses a model of the other task, and a job page shows
its input tokens, no output, and a chart of input tokens per second. No worker runs: the states a
worker would reach are written to the database as the workers write them (tests/api/test_console.py)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from sqlalchemy import func, select

from api.app import create_app
from api.services import console
from api.services.console import embedding_dimensions
from api.services.tenants import create_tenant
from storage.models import Batch, UnitStatus, WorkUnit
from tests.api.test_console import csrf, html, sign_in
from tests.conftest import now
from tests.factories import OMIT, chat_line, embedding_line, jsonl
from workers import registration
from workers.registration import AddRequest

EMBEDDINGS = "/v1/embeddings"


@pytest.fixture
def app(runtime, embed_model: Path):
    registration.add(runtime, AddRequest("emb", str(embed_model)), echo=lambda _: None)
    return create_app(runtime=runtime)


@pytest.fixture
def alpha(app, runtime):
    _, key = create_tenant(runtime.db, "alpha", now())
    client = app.test_client()
    sign_in(client, key)
    return client


def unnamed(line: dict) -> dict:
    """The line without a model of its own: the form's model fills it in."""
    del line["body"]["model"]
    return line


def upload(client, endpoint: str, model: str, lines: list[dict]):
    form = {
        "csrf_token": csrf(client, "/console/upload"), "endpoint": endpoint, "model": model, "window": "24h",
        "file": (io.BytesIO(jsonl(lines)), "corpus.jsonl"),
    }  # fmt: skip
    return client.post("/console/upload", data=form, content_type="multipart/form-data")


def test_an_embeddings_job_shows_input_tokens_no_output_and_input_throughput(alpha, runtime) -> None:
    made = upload(
        alpha, EMBEDDINGS, "emb", [unnamed(embedding_line(f"doc-{i}", f"text {i}")) for i in range(8)]
    )
    assert made.status_code == 302, made.get_data(as_text=True)
    batch_id = made.location.rsplit("/", 1)[-1]
    start = float(now() - 100)
    with runtime.db.write() as s:  # what its engine worker records: input tokens, none written
        row = s.get(Batch, batch_id)
        row.status, row.model, row.in_progress_at = "in_progress", "emb", int(start)
        row.request_total, row.request_completed, row.prompt_tokens = 8, 8, 900
        for seq, (a, b, tokens) in enumerate([(0, 40, 500), (20, 60, 400)]):
            s.add(WorkUnit(
                batch_id=row.id, seq=seq, model="emb", shard_key=f"k{seq}", first_line=seq * 4, n_requests=4,
                status=UnitStatus.DONE, started_at=start + a, finished_at=start + b, completed=4,
                prompt_tokens=tokens, completion_tokens=0,
            ))  # fmt: skip
        # a third unit still running: its heartbeats carry its input tokens so far
        s.add(WorkUnit(
            batch_id=row.id, seq=2, model="emb", shard_key="k2", first_line=8, n_requests=4,
            status=UnitStatus.RUNNING, started_at=start + 60, heartbeat_at=start + 90, completed=2,
            prompt_tokens=300, completion_tokens=0,
        ))  # fmt: skip
        row.request_total = 12
    page = html(alpha.get(f"/console/jobs/{batch_id}"))
    assert f"emb · {EMBEDDINGS}" in page
    assert re.search(r"<th>input \(uncached\)</th><td class=\"num\">900</td>", page)
    assert re.search(r'id="output-tokens"[^>]*>none \(embeddings\)</td>', page)
    # the chart: input tokens per second (an embeddings batch writes none), spread over the runs
    assert "bars: input tok/s" in page and page.count('<rect class="bar"') > 1
    peak = re.search(r"peak ([0-9.]+) input tok/s", page)
    assert peak and float(peak.group(1)) > 0
    # the running unit's input tokens are in the chart before it ends, over [start, last heartbeat]
    with runtime.db.read() as s:
        tenant_id = s.get(Batch, batch_id).tenant_id
    detail = console.job(runtime, tenant_id, batch_id, start + 100)
    assert sum(b.output_tokens for b in detail.throughput.buckets) == pytest.approx(900 + 300)
    assert sum(b.output_tokens for b in detail.throughput.buckets if b.start >= start + 60) >= 300 - 1e-6


def test_the_upload_form_refuses_a_model_of_the_other_task(alpha, runtime) -> None:
    for endpoint, model, line, message in (
        (EMBEDDINGS, "demo", unnamed(embedding_line("e")), "&#39;demo&#39; generates text"),
        (
            "/v1/chat/completions",
            "emb",
            chat_line("c", model=OMIT),
            "&#39;emb&#39; is an embedding model",
        ),
    ):
        refused = upload(alpha, endpoint, model, [line])
        assert 400 <= refused.status_code < 500, refused.status_code
        assert message in html(refused) and 'id="error-message"' in html(refused)
    with runtime.db.read() as s:
        assert s.scalar(select(func.count()).select_from(Batch)) == 0


def test_the_models_page_shows_each_models_task_and_an_embedding_models_dimensions(alpha) -> None:
    """The demo embedding model gives 256-value vectors and, trained for shorter ones, 64 or 128 on
    request (its config.json); a text model shows none."""
    page = html(alpha.get("/console/models"))
    emb = re.search(r'<tr id="model-emb">(.*?)</tr>', page, re.S).group(1)
    assert '<td class="task">embeddings</td>' in emb
    assert '<td class="dimensions">256 (on request: 64, 128, 256)</td>' in emb
    demo = re.search(r'<tr id="model-demo">(.*?)</tr>', page, re.S).group(1)
    assert '<td class="task">text</td>' in demo and '<td class="dimensions">-</td>' in demo


@pytest.mark.parametrize(
    ("config", "shown"),
    [
        ({"hidden_size": 768}, "768"),
        ({"hidden_size": 768, "is_matryoshka": True}, "768 (on request: 1 to 768)"),
        ({"d_model": 512, "matryoshka_dimensions": [128, 512]}, "512 (on request: 128, 512)"),
        ({}, None),
        ({"hidden_size": "768"}, None),  # a config.json is the checkpoint owner's: shown only when sane
        ({"hidden_size": True}, None),
    ],
)
def test_dimensions_read_from_a_config(config: dict, shown: str | None) -> None:
    assert embedding_dimensions(config) == shown
