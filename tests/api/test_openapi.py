"""``/openapi.json`` is a valid OpenAPI 3.1 document that names exactly the /v1 routes Flask serves,
and the serializers' objects (in every state a test can make cheaply) match its schemas."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate

from api.app import create_app
from api.serializers import batch_object, estimate_object, file_object, model_object
from scheduler.budgets import BudgetState, fit, month_named
from scheduler.cost import ListPrice
from scheduler.estimate import History, PlanTotals, summary
from storage.models import Batch, Estimate, StoredFile
from storage.registry import ModelEntry
from storage.settings import Settings

IGNORED_METHODS = {"HEAD", "OPTIONS"}
HTTP_METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}


@pytest.fixture
def app(tmp_path: Path):
    settings = Settings.from_env({}, data_dir=tmp_path, completion_windows=("24h", "1h:2"))
    return create_app(settings)


@pytest.fixture
def document(app) -> dict:
    response = app.test_client().get("/openapi.json")  # no Authorization header: public
    assert response.status_code == 200 and response.mimetype == "application/json"
    return response.get_json()


def flask_routes(app) -> dict[str, set[str]]:
    """Every /v1 route as an OpenAPI path template ('<path:model>' -> '{model}') and its methods."""
    routes: dict[str, set[str]] = {}
    for rule in app.url_map.iter_rules():
        if not rule.rule.startswith("/v1"):
            continue
        template = re.sub(r"<(?:[a-z_]+:)?([a-z_]+)>", r"{\1}", rule.rule)
        routes.setdefault(template, set()).update(m.lower() for m in rule.methods - IGNORED_METHODS)
    return routes


def test_document_validates_as_openapi(document):
    validate(document)  # raises on any violation of the OpenAPI 3.1 schema
    assert document["openapi"].startswith("3.1")
    assert document["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": "A tenant's API key.",
    }  # fmt: skip


def test_every_flask_route_is_documented_and_every_documented_path_exists(app, document):
    routes = flask_routes(app)
    assert len(routes) >= 7, routes  # files, file, content, batches, batch, cancel, models, model
    documented = {
        path: {m for m in item if m in HTTP_METHODS}
        for path, item in document["paths"].items()
        if path.startswith("/v1")
    }
    assert documented == routes
    for path, item in document["paths"].items():
        for method, op in item.items():
            if method not in HTTP_METHODS:
                continue
            declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert declared == set(re.findall(r"{([a-z_]+)}", path)), (method, path)
    assert set(document["paths"]) - set(documented) == {"/healthz"}
    assert not any(p.startswith(("/console", "/metrics")) for p in document["paths"])


def test_every_api_operation_documents_auth_and_error_bodies(document):
    error_ref = {"$ref": "#/components/schemas/Error"}
    for path, item in document["paths"].items():
        for method, op in item.items():
            if not path.startswith("/v1"):
                assert op["security"] == []
                continue
            assert "security" not in op  # the document-wide bearer requirement applies
            statuses = set(op["responses"])
            assert {"200", "401", "413", "429"} <= statuses, (method, path)
            for status, response in op["responses"].items():
                if status.startswith("4"):
                    assert response["content"]["application/json"]["schema"] == error_ref
            assert op["responses"]["429"]["headers"]["Retry-After"]["required"] is True
    assert set(document["paths"]["/v1/batches/{batch_id}/cancel"]["post"]["responses"]) >= {"404", "409"}
    windows = document["paths"]["/v1/batches"]["post"]["requestBody"]["content"]["application/json"]
    assert windows["schema"]["properties"]["completion_window"]["enum"] == ["24h", "1h"]
    assert windows["schema"]["properties"]["endpoint"]["enum"] == [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/score",
        "/v1/rerank",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
    ]


def schema_validator(document: dict, name: str) -> Draft202012Validator:
    return Draft202012Validator({**document, "$ref": f"#/components/schemas/{name}"})


def batch(**fields: object) -> Batch:
    base = dict(
        id="batch_1", tenant_id="t", endpoint="/v1/chat/completions", model=None, input_file_id="file-1",
        completion_window="24h", status="validating", errors=None, metadata_=None, priority=0,
        created_at=100, expires_at=86500, output_file_id=None, error_file_id=None, in_progress_at=None,
        finalizing_at=None, completed_at=None, failed_at=None, expired_at=None, cancelling_at=None,
        cancelled_at=None, request_total=0, request_completed=0, request_failed=0, prompt_tokens=0,
        cached_tokens=0, completion_tokens=0, engine_seconds=0.0, cost_micros=0, cost_input_micros=0,
        cost_cached_micros=0, cost_output_micros=0, price_multiplier=1.0, list_price_micros=None,
        eta_at=None, sla_met=None, warnings=None, at_risk_since=None,
    )  # fmt: skip
    return Batch(**{**base, **fields})


def test_serialized_objects_match_their_schemas(document):
    failed = batch(
        status="failed", failed_at=101,
        errors={"object": "list", "data": [
            {"code": "invalid_json_line", "message": "bad", "param": None, "line": 3},
            {"code": "too_many_errors", "message": "more", "param": None, "line": None},
        ]},
    )  # fmt: skip
    completed = batch(
        status="completed", model="demo", completed_at=200, output_file_id="file-2", error_file_id="file-3",
        metadata_={"k": "v"}, request_total=3, request_completed=2, request_failed=1, prompt_tokens=30,
        cached_tokens=10, completion_tokens=12, engine_seconds=1.25, cost_micros=1234, cost_input_micros=600,
        cost_cached_micros=100, cost_output_micros=534, price_multiplier=2.0, list_price_micros=9000,
        sla_met=True, warnings=["late"], priority=-100, at_risk_since=150,
    )  # fmt: skip
    running = batch(status="in_progress", eta_at=300, in_progress_at=101, priority=100)
    check = schema_validator(document, "Batch")
    for b in (batch(), failed, completed, running):
        check.validate(batch_object(b))
    file = StoredFile(id="file-1", tenant_id="t", purpose="batch", filename="a.jsonl", bytes=5, created_at=1)
    schema_validator(document, "File").validate(file_object(file))
    entry = ModelEntry("demo", "/m", "/m", "auto", "none", max_model_len=2048, parameters=7, weight_bytes=9)
    schema_validator(document, "Model").validate(model_object(entry))
    # the schemas are closed: a field the serializers would add without the document fails here
    assert not schema_validator(document, "Batch").is_valid({**batch_object(batch()), "surprise": 1})
    assert not schema_validator(document, "File").is_valid({**file_object(file), "bytes": "5"})


def test_estimate_objects_match_their_schema(document):
    """A dry run's answer in each of its states (issue #22 s5), with and without history."""
    totals = PlanTotals(128, typical_output=7.5)
    for n in range(3):
        totals.add(bytes(4 * 200) + bytes([n]), 201, 16, exact=n != 2)
    known = summary(totals, History(86400, 7.5, 250.0, 2), 2.0, 3.6, ListPrice(1.0, 0.5, 2.0))
    unknown = summary(PlanTotals(128), History(86400, None, None, 0), 1.0, 0.0, None)
    base = dict(id="estimate_1", tenant_id="t", input_file_id="file-1", endpoint="/v1/chat/completions",
                completion_window="24h", price_multiplier=1.0, metadata_=None, model=None, errors=None,
                result=None, created_at=100, finished_at=None)  # fmt: skip
    errors = {
        "object": "list",
        "data": [{"code": "invalid_json_line", "message": "x", "param": None, "line": 2}],
    }
    month = BudgetState(10_000_000, 4_000_000, False, month_named("2026-11"))
    within, unsure = fit(month, 1.0, 2.0), fit(month, None, None)
    assert (within["fits"], unsure["fits"]) == (True, None)
    check = schema_validator(document, "Estimate")
    for fields in (
        {"status": "validating"},
        {
            "status": "completed",
            "model": "demo",
            "finished_at": 120,
            "result": known,
            "metadata_": {"k": "v"},
        },
        {"status": "completed", "model": "demo", "finished_at": 120, "result": unknown},
        {"status": "failed", "finished_at": 120, "errors": errors},
        # a tenant with a monthly budget: what is left and whether the batch fits (issue #52 part 3)
        {"status": "completed", "model": "demo", "finished_at": 120, "result": {**known, "budget": within}},
        {"status": "completed", "model": "demo", "finished_at": 120, "result": {**unknown, "budget": unsure}},
    ):
        check.validate(estimate_object(Estimate(**{**base, **fields})))
    assert not check.is_valid({**estimate_object(Estimate(**base, status="validating")), "surprise": 1})
