"""Schemathesis against Freight's own OpenAPI document, on the real Flask app (WSGI), SQLite and
PostgreSQL, with a real tenant key: no 5xx, and every response's status code, content type, headers
and body match the document. Positive and negative cases for every operation; the seed is fixed
(derandomized) so a CI failure replays exactly.
"""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.app import create_app
from api.services import batches, uploads
from api.services import webhooks as webhook_service
from api.services.tenants import create_tenant
from tests.conftest import now
from tests.factories import chat_line, create, upload

EXAMPLES = 25  # per operation and generation mode
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
TOTALS: Counter[str] = Counter()  # over both databases: the figures recorded are the sum
DATABASES: list[str] = []


def fuzz(operation, mode, real_ids, headers, counts, statuses, failures) -> None:
    """EXAMPLES cases of one operation in one generation mode; check failures are collected."""

    @hypothesis_settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # failures are collected, not shrunk
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode), pick=st.integers(0, 3))
    def run(case, pick: int) -> None:
        # most positive cases address a real object, the rest a random id
        for name in case.path_parameters or {}:
            if mode is schemathesis.GenerationMode.POSITIVE and pick < len(real_ids[name]) + 1:
                case.path_parameters[name] = real_ids[name][pick % len(real_ids[name])]
        response = case.call(headers=headers)
        counts["cases"] += 1
        statuses[response.status_code] += 1
        if response.status_code >= 500:
            counts["server_errors"] += 1
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        except (Exception, FailureGroup) as exc:  # a check failed: collect it, go on
            counts["schema_failures"] += response.status_code < 500
            failures.append(f"{operation.label} [{mode.value}] {response.status_code}: {exc}"[:2000])

    run()


@pytest.mark.reliability
def test_schemathesis_finds_no_server_error_and_no_schema_mismatch(runtime, database_url, reliability):
    app = create_app(runtime=runtime)
    tenant, key = create_tenant(runtime.db, "fuzzed", now())
    # real objects for the by-id routes: a file, a batch reading it, and a second file
    seeded = upload(runtime, tenant.id, [chat_line("a")])
    spare = upload(runtime, tenant.id, [chat_line("b")], "spare.jsonl")
    batch = create(runtime, tenant.id, seeded.id)
    hook = webhook_service.add(runtime, tenant.id, "https://hooks.example.com/f", ["batch.failed"], now())
    pending = uploads.create(runtime, tenant.id, {"bytes": 10, "filename": "u.jsonl", "purpose": "batch", "mime_type": "text/jsonl"})  # fmt: skip
    real_ids = {
        "file_id": [seeded.id, spare.id],
        "batch_id": [batch.id],
        "model": ["demo"],
        "endpoint_id": [hook.id],
        "upload_id": [pending.id],
    }
    headers = {"Authorization": f"Bearer {key}"}

    schema = schemathesis.openapi.from_wsgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    failures: list[str] = []
    counts: Counter[str] = Counter()
    statuses: Counter[int] = Counter()

    for operation in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            try:
                fuzz(operation, mode, real_ids, headers, counts, statuses, failures)
            except Unsatisfiable:  # nothing to make invalid (no parameters, no body)
                assert mode is schemathesis.GenerationMode.NEGATIVE, operation.label
                counts["no_negative_cases"] += 1

    DATABASES.append(database_url.split(":")[0])
    TOTALS.update(counts)
    TOTALS["operations"] = len(operations)
    entry = reliability.record(
        "schemathesis",
        lost=0,
        duplicated=0,
        server_errors=TOTALS["server_errors"],
        cases=TOTALS["cases"],
        operations=TOTALS["operations"],
        schema_failures=TOTALS["schema_failures"],
        databases=DATABASES,
    )
    assert not failures, "\n\n".join(failures[:10])
    assert entry["server_errors"] == 0 and entry["schema_failures"] == 0
    assert (
        len(operations) == 26 and counts["cases"] >= len(operations) * EXAMPLES
    )  # 26: with POST /v1/webhooks/{id}/rotate_secret, the four of /v1/uploads and GET /v1/batches/{id}/results
    # the fuzzing reached the interesting answers, not only 400s
    assert statuses[200] and statuses[404] and statuses[400], statuses


HOSTILE_BODIES = [
    b'{"input_file_id": "file-\\u0000", "endpoint": "/v1/chat/completions"}',  # PostgreSQL refuses NUL
    b'{"input_file_id": "\\ud800", "endpoint": "/v1/chat/completions"}',  # valid JSON, not UTF-8
    b'{"input_file_id": "SEEDED", "endpoint": "/v1/chat/completions", "metadata": {"k": "\\u0000"}}',
    b'{"input_file_id": "SEEDED", "endpoint": "/v1/chat/completions", "metadata": {"\\udc00": "v"}}',
    b"[" * 5000,  # deeper than the JSON decoder recurses
]


@pytest.mark.parametrize(
    "body", HOSTILE_BODIES, ids=["nul-id", "surrogate-id", "nul-meta", "surrogate-meta", "deep"]
)
def test_hostile_json_strings_answer_4xx_not_500(runtime, body):
    """Regressions of what fuzzing the API found: strings JSON allows but no database stores."""
    app = create_app(runtime=runtime)
    tenant, key = create_tenant(runtime.db, "hostile", now())
    seeded = upload(runtime, tenant.id, [chat_line("a")])
    response = app.test_client().post(
        "/v1/batches",
        data=body.replace(b"SEEDED", seeded.id.encode()),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    assert response.status_code in (400, 404), response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert batches.list_batches(runtime, tenant.id, None, 10)[0].rows == []
