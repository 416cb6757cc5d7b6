"""A price before the run (issue #22 s5): ``POST /v1/batches`` with ``dry_run: true`` and
``freight estimate``, through Flask's test client on SQLite and PostgreSQL with a real Redis.

No control worker runs here: the estimate's task body (``workers.estimates.run``) is called
in-process where the worker would run it, on the real tokenizer and vLLM request models.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import pytest
from click.testing import CliRunner
from sqlalchemy import select
from werkzeug.serving import make_server

from api.cli import main as freight_cli
from api.services.tenants import create_tenant
from scheduler.ordering import common_prefix_tokens, prompt_key
from scheduler.unit_plan import predicted_cached_tokens
from storage.models import Batch, EngineSample, Estimate, StoredFile, WorkUnit
from storage.status import EstimateStatus, UnitStatus
from tests.conftest import DEMO_MODEL, now
from tests.factories import (
    TRUE_ENGINE,
    chat_line,
    http_create,
    http_upload,
    jsonl,
    mixed_engine_samples,
    responses_line,
    validated_batch,
)
from workers import estimates


@pytest.fixture
def settings(settings):
    """A priced deployment: $3.60 an engine hour, and a 1h tier at twice the 24h price."""
    return dataclasses.replace(settings, instance_price_per_hour=3.6, completion_windows=("24h", "1h:2"))


@pytest.fixture
def tenants(runtime) -> dict[str, tuple[str, dict]]:
    out = {}
    for name in ("alpha", "beta"):
        tenant, key = create_tenant(runtime.db, name, now())
        out[name] = (tenant.id, {"Authorization": f"Bearer {key}"})
    return out


def document_lines(max_tokens: int = 50) -> list[dict]:
    """Two long documents, three questions on each, interleaved in the file (sorting groups them)."""
    docs = {
        d: " ".join(f"{d} sentence {i} of the shared document." for i in range(60)) for d in ("alpha", "beta")
    }
    return [
        chat_line(
            f"{d}-{q}",
            max_tokens=max_tokens,
            messages=[
                {"role": "system", "content": docs[d]},
                {"role": "user", "content": f"question {q} on {d}?"},
            ],
        )
        for q in range(3)
        for d in docs
    ]


def dry_run(client, headers, file_id: str, **fields) -> dict:
    response = http_create(client, headers, file_id, dry_run=True, **fields)
    assert response.status_code == 200, response.get_data(as_text=True)
    return response.get_json()


def estimated(client, runtime, headers, file_id: str, **fields) -> dict:
    """A dry run, its task run in-process, then the estimate as GET /v1/batches/{id} answers it."""
    made = dry_run(client, headers, file_id, **fields)
    estimates.run(runtime, made["id"])
    return client.get(f"/v1/batches/{made['id']}", headers=headers).get_json()


def test_dry_run_validates_and_estimates_without_making_a_batch(client, runtime, tenants):
    tenant_id, alpha = tenants["alpha"]
    lines = document_lines()
    file_id = http_upload(client, alpha, lines).get_json()["id"]
    made = dry_run(client, alpha, file_id)
    assert made["object"] == "batch.estimate" and made["id"].startswith("estimate_")
    assert made["status"] == "validating" and made["estimate"] is None
    assert client.get("/v1/batches", headers=alpha).get_json()["data"] == []  # no batch was made
    estimates.run(runtime, made["id"])
    answer = client.get(f"/v1/batches/{made['id']}", headers=alpha).get_json()
    assert answer["status"] == "completed" and answer["errors"] is None and answer["model"] == "demo"
    assert answer["completed_at"] is not None and answer["failed_at"] is None
    e = answer["estimate"]

    # exact input tokens: the model's own tokenizer and chat template, line by line
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_MODEL))
    ids = []
    for line in lines:
        rendered = tokenizer.apply_chat_template(
            line["body"]["messages"], add_generation_prompt=True, tokenize=True
        )
        ids.append(list(rendered if isinstance(rendered, list) else rendered["input_ids"]))
    assert e["requests"] == 6 and e["input_tokens_lower_bound_requests"] == 0
    assert e["input_tokens"] == sum(len(i) for i in ids)
    # the cache hits of the prefix-sorted order, block by block
    keys = sorted((prompt_key(i, runtime.settings.sort_key_tokens), len(i)) for i in ids)
    expected = sum(
        predicted_cached_tokens(common_prefix_tokens(keys[n - 1][0], key), length, 128)
        for n, (key, length) in enumerate(keys)
        if n
    )
    assert e["cached_input_tokens"] == expected > 0 and e["kv_block_size"] == 128
    assert e["cache_hit_rate"] == round(expected / e["input_tokens"], 4)
    assert e["output_tokens"] == {"max": 300, "typical": None, "typical_per_request": None}
    # no history of the model yet: time and cost are unknown, and say so
    assert e["eta_seconds"] == "unknown" and e["engine_seconds"] == "unknown"
    assert e["cost"]["total"] == "unknown" and e["cost"]["price_multiplier"] == 1.0

    # the same file validated as a real batch plans exactly these tokens and cache hits
    batch_id = validated_batch(runtime, tenant_id, lines)
    with runtime.db.read() as s:
        batch = s.get(Batch, batch_id)
        assert (batch.planned_prompt_tokens, batch.planned_cached_tokens) == (e["input_tokens"], expected)


def test_responses_lines_are_priced_as_their_chat_translation(client, runtime, tenants):
    """The same documents and questions as /v1/responses lines (instructions, input,
    max_output_tokens): the same exact input tokens, cache hits and output bound as chat's."""
    _, alpha = tenants["alpha"]
    chat_file = http_upload(client, alpha, document_lines()).get_json()["id"]
    responses = [
        responses_line(
            f"est-resp-{line['custom_id']}",
            line["body"]["messages"][1]["content"],
            instructions=line["body"]["messages"][0]["content"],
            max_output_tokens=line["body"]["max_tokens"],
        )
        for line in document_lines()
    ]
    responses_file = http_upload(client, alpha, responses, "est-responses.jsonl").get_json()["id"]
    chat = estimated(client, runtime, alpha, chat_file)
    answer = estimated(client, runtime, alpha, responses_file, endpoint="/v1/responses")
    assert answer["status"] == "completed" and answer["endpoint"] == "/v1/responses", answer
    assert answer["estimate"] == chat["estimate"]
    assert answer["estimate"]["input_tokens_lower_bound_requests"] == 0  # tokenized exactly
    assert answer["estimate"]["cached_input_tokens"] > 0


def add_history(runtime, tenant_id: str, file_id: str) -> None:
    """The model ran 10 of the tenant's requests, 20 output tokens each; its one engine computed 2,000 tokens
    (1,000 uncached prompt and 1,000 output) in 10 busy seconds: 200 tokens/s."""
    t = time.time()
    with runtime.db.write() as s:
        batch = Batch(id="batch_history", tenant_id=tenant_id, endpoint="/v1/chat/completions", input_file_id=file_id,
                      completion_window="24h", status="completed", created_at=int(t) - 60, expires_at=int(t) + 86400)  # fmt: skip
        s.add(batch)
        s.flush()
        s.add(WorkUnit(batch_id=batch.id, seq=0, model="demo", shard_key="k", first_line=1, n_requests=10,
                       status=UnitStatus.DONE, finished_at=t - 5, completed=10, completion_tokens=200))  # fmt: skip
        s.add(EngineSample(worker="w1", model="demo", started_at=t - 15, seconds=10.0, steps=20, running_mean=4,
                           waiting_mean=0, max_num_seqs=8, prompt_tokens=1500, cached_tokens=500,
                           output_tokens=1000, requests=10))  # fmt: skip


def test_enough_engine_samples_of_mixed_work_price_by_the_fitted_engine_model(client, runtime, tenants):
    """Samples timed at 150 s per million uncached prompt tokens, 300 per million output tokens and
    0.4 per million KV entries read: the database's sums, fitted, give those back, and the file is
    priced with them rather than at the one rate."""
    _, alpha = tenants["alpha"]
    file_id = http_upload(client, alpha, document_lines(max_tokens=50)).get_json()["id"]
    t = time.time()
    with runtime.db.write() as s:
        for i, (uncached, output, kv, seconds) in enumerate(mixed_engine_samples(20)):
            s.add(EngineSample(worker="w1", model="demo", started_at=t - 300 + 10 * i, seconds=seconds, steps=9,
                               running_mean=4, waiting_mean=0, max_num_seqs=8, prompt_tokens=round(uncached) + 100,
                               cached_tokens=100, output_tokens=round(output), requests=10,
                               kv_tokens_read=round(kv)))  # fmt: skip
    e = estimated(client, runtime, alpha, file_id)["estimate"]
    assert e["history"]["seconds_per_million"] == pytest.approx(
        {"uncached_input_tokens": 150.0, "output_tokens": 300.0, "kv_entries_read": 0.4}, rel=1e-3
    )
    uncached = e["input_tokens"] - e["cached_input_tokens"]
    one_rate = (uncached + e["output_tokens"]["max"]) / e["history"]["tokens_per_second"]
    at_model = TRUE_ENGINE.seconds(uncached, e["output_tokens"]["max"], 0)  # the KV term comes on top
    assert e["engine_seconds"]["high"] > at_model and e["engine_seconds"]["high"] != round(one_rate, 3)


def test_history_gives_the_typical_output_eta_and_cost_at_the_tier_price(client, runtime, tenants):
    tenant_id, alpha = tenants["alpha"]
    file_id = http_upload(client, alpha, document_lines(max_tokens=50)).get_json()["id"]
    add_history(runtime, tenant_id, file_id)
    answer = estimated(client, runtime, alpha, file_id, completion_window="1h")
    e = answer["estimate"]
    assert e["output_tokens"] == {"max": 300, "typical": 120, "typical_per_request": 20.0}
    assert e["history"]["tokens_per_second"] == 200.0 and e["history"]["engines"] == 1
    uncached = e["input_tokens"] - e["cached_input_tokens"]
    low, high = (uncached + 120) / 200, (uncached + 300) / 200
    assert e["engine_seconds"] == {"low": round(low, 3), "high": round(high, 3)}
    assert e["eta_seconds"] == {"low": round(low, 1), "high": round(high, 1), "engines": 1}
    cost = e["cost"]
    assert (cost["price_multiplier"], cost["instance_price_per_hour"]) == (2.0, 3.6)
    # engine seconds x $3.60/h x 2 for the 1h tier
    assert cost["total"]["low"] == pytest.approx(low * 3.6 / 3600 * 2, abs=2e-6)
    assert cost["total"]["high"] == pytest.approx(high * 3.6 / 3600 * 2, abs=2e-6)
    # another tenant gets the fleet's speed, but not what alpha's requests wrote
    _, beta = tenants["beta"]
    theirs = estimated(
        client, runtime, beta, http_upload(client, beta, document_lines(max_tokens=50)).get_json()["id"]
    )
    assert theirs["estimate"]["output_tokens"]["typical"] is None
    assert theirs["estimate"]["history"]["tokens_per_second"] == 200.0


def test_invalid_lines_are_reported_as_validation_reports_them(client, runtime, tenants):
    _, alpha = tenants["alpha"]
    junk = (
        b"not json at all\n" + jsonl([chat_line("ok")]) + b'{"custom_id": "x"}\n' + jsonl([chat_line("ok")])
    )
    answer = estimated(client, runtime, alpha, http_upload(client, alpha, junk).get_json()["id"])
    assert answer["status"] == "failed" and answer["estimate"] is None and answer["failed_at"] is not None
    found = [(e["line"], e["code"]) for e in answer["errors"]["data"]]
    assert found == [(1, "invalid_json_line"), (3, "invalid_method"), (4, "duplicate_custom_id")]
    assert all(e["message"] for e in answer["errors"]["data"])


def test_a_line_naming_an_unknown_model_costs_nothing(client, runtime, tenants):
    """A line naming a model not served here runs as its error (refused alone at validation): a
    request of the estimate with no input and no output tokens; a file of nothing else fails as
    its batch would, each line listed."""
    _, alpha = tenants["alpha"]
    lines = document_lines()
    base = estimated(client, runtime, alpha, http_upload(client, alpha, lines).get_json()["id"])["estimate"]
    typos = [chat_line("typo-1", "x" * 400, model="gpt-9"), chat_line("typo-2", "y", model="demo-lora-x")]
    answer = estimated(
        client, runtime, alpha, http_upload(client, alpha, [typos[0], *lines, typos[1]]).get_json()["id"]
    )
    assert answer["status"] == "completed" and answer["model"] == "demo", answer
    e = answer["estimate"]
    assert e["requests"] == base["requests"] + 2 == 8
    assert (e["input_tokens"], e["cached_input_tokens"]) == (
        base["input_tokens"],
        base["cached_input_tokens"],
    )
    assert (
        e["output_tokens"]
        == base["output_tokens"]
        == {"max": 300, "typical": None, "typical_per_request": None}
    )
    only = estimated(client, runtime, alpha, http_upload(client, alpha, typos).get_json()["id"])
    assert only["status"] == "failed" and only["estimate"] is None
    assert [(x["line"], x["code"]) for x in only["errors"]["data"]] == [
        (1, "model_not_found"),
        (2, "model_not_found"),
    ]


def test_bad_dry_runs_get_clear_4xx(client, runtime, tenants):
    _, alpha = tenants["alpha"]
    _, beta = tenants["beta"]
    file_id = http_upload(client, alpha).get_json()["id"]
    for value in ("yes", 1, None, {"x": True}):
        error = http_create(client, alpha, file_id, dry_run=value)
        assert error.status_code == 400 and error.get_json()["error"]["param"] == "dry_run", value
    for headers, missing in ((beta, file_id), (alpha, "file-nope")):  # another tenant's file, no file
        error = http_create(client, headers, missing, dry_run=True)
        assert error.status_code == 404 and error.get_json()["error"]["param"] == "input_file_id"
    assert http_create(client, alpha, file_id, dry_run=True, completion_window="2h").status_code == 400
    made = dry_run(client, alpha, file_id)
    assert client.get(f"/v1/batches/{made['id']}", headers=beta).status_code == 404  # not beta's estimate
    assert client.get("/v1/batches/estimate_nope", headers=alpha).status_code == 404
    dry_run(client, alpha, file_id)
    crowded = http_create(client, alpha, file_id, dry_run=True)  # two are being made already
    assert crowded.status_code == 429 and crowded.get_json()["error"]["code"] == "too_many_estimates"
    assert crowded.headers["Retry-After"] == "5"
    # dry_run false is an ordinary batch
    assert http_create(client, alpha, file_id, dry_run=False).get_json()["object"] == "batch"
    with runtime.db.read() as s:
        assert len(s.scalars(select(Estimate)).all()) == 2


@pytest.fixture
def served(app, runtime) -> Iterator[str]:
    """The API on a loopback port, and a thread doing the control worker's part: every estimate
    left validating is run (the task body, in-process)."""
    server = make_server("127.0.0.1", 0, app, threaded=True)
    # polled every 0.05 s: shutdown() waits up to one poll (0.5 s by default, at each teardown)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    stop = threading.Event()

    def control() -> None:
        while not stop.wait(0.1):
            with runtime.db.read() as s:
                waiting = s.scalars(
                    select(Estimate.id).where(Estimate.status == EstimateStatus.VALIDATING)
                ).all()
            for estimate_id in waiting:
                estimates.run(runtime, estimate_id)

    worker = threading.Thread(target=control, daemon=True)
    worker.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1"
    finally:
        stop.set()
        worker.join(timeout=30)
        server.shutdown()


def test_freight_estimate_prints_the_estimate_and_the_errors(served, runtime, tenants, tmp_path):
    _, alpha = tenants["alpha"]
    key = alpha["Authorization"].removeprefix("Bearer ")
    good = tmp_path / "questions.jsonl"
    lines = document_lines()
    for line in lines:
        del line["body"]["model"]  # --model fills it in
    good.write_bytes(jsonl(lines))
    args = ["estimate", "--api-url", served, "--api-key", key, "--model", "demo", "--poll", "0.2"]
    result = CliRunner().invoke(freight_cli, [*args, str(good)])
    assert result.exit_code == 0, result.output
    assert "requests       6 for demo" in result.output and "tokens predicted cached" in result.output
    assert "ETA            unknown" in result.output and "cost           unknown" in result.output
    as_json = CliRunner().invoke(freight_cli, [*args, "--json", str(good)])
    assert as_json.exit_code == 0, as_json.output
    assert '"object": "batch.estimate"' in as_json.output and '"requests": 6' in as_json.output
    junk = tmp_path / "junk.jsonl"
    junk.write_bytes(b'{"custom_id": "a", "method": "GET", "url": "/v1/chat/completions", "body": {}}\n')
    failed = CliRunner().invoke(freight_cli, [*args, str(junk)])
    assert failed.exit_code == 1 and "line 1: invalid_method" in failed.output
    assert "would not make a batch" in failed.output
    # every run uploaded its own copy, set to expire within the hour and deleted once answered
    with runtime.db.read() as s:
        copies = s.scalars(select(StoredFile).where(StoredFile.tenant_id == tenants["alpha"][0])).all()
    assert len(copies) == 3
    assert all(c.deleted_at is not None and c.expires_at - c.created_at == 3600 for c in copies)
