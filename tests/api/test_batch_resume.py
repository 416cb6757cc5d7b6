"""Resuming a batch (POST /v1/batches with ``resume_from``, issue #48 part 3) on both databases:
batches whose units are claimed and recorded as an engine worker records them (no engine), cancelled
a third of the way, resumed, and the resume resumed; the merged files hold every line once, the
error file only what still failed; what cannot be resumed is refused with the reason. The resumes
themselves run on the local store and on S3 (SeaweedFS): the live stack of
tests/e2e/test_resume_live.py is on the local store only."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import replace

import pytest
from flask.testing import FlaskClient
from sqlalchemy import select

from api.app import create_app
from api.services.tenants import create_tenant
from storage.models import Batch, StoredFile
from storage.runtime import Runtime
from storage.settings import Settings
from storage.shards import read_rows
from storage.status import BatchStatus
from tests.conftest import now, on_s3
from tests.factories import batch_units, chat_line, validated_batch
from tests.workers.test_unit_recorder import record
from workers import estimates as estimate_task
from workers.finalize import finalize_batch
from workers.results import encode, request_error_line, success_line
from workers.runner_state import ActiveUnit, new_spool
from workers.unit_claims import claim_unit
from workers.validation import validate_batch

HOLDER = "resume-test:1"
N = 30  # lines; units of 4: 8 units


def status_of(custom_id: str, attempt: int) -> int:
    """How a line ends in an attempt: ids ending in 7 are refused (400) every time, ids ending in
    3 meet an engine error (500) in the first two attempts; the rest succeed."""
    if custom_id.endswith("7"):
        return 400
    if custom_id.endswith("3") and attempt < 2:
        return 500
    return 200


def run_units(rt: Runtime, batch_id: str, attempt: int, seqs: Iterable[int] | None = None) -> None:
    """Claim and record the units ``seqs`` (all by default), each line as ``status_of`` says."""
    units = sorted(batch_units(rt, batch_id), key=lambda u: u.seq)
    active = []
    for row in units if seqs is None else [u for u in units if u.seq in set(seqs)]:
        claim = claim_unit(rt, row.id, time.time(), HOLDER)
        assert claim is not None
        unit = ActiveUnit(claim, new_spool(), new_spool(), claim.n_requests)
        for r in read_rows(rt.store, row.shard_key, row.row_start, row.n_requests):
            status = status_of(r.custom_id, attempt)
            if status == 200:
                unit.out.write(encode(success_line(r.custom_id, {"attempt": attempt})))
                unit.tally.completed += 1
                unit.tally.prompt_tokens += 10
                unit.tally.completion_tokens += 3
            else:
                unit.err.write(encode(request_error_line(r.custom_id, status, {"message": "no"})))
                unit.tally.failed += 1
        unit.results = claim.n_requests
        active.append(unit)
    record(rt, active)


def lines_of(rt: Runtime, batch: Batch, attr: str) -> list[dict]:
    file_id = getattr(batch, attr)
    if file_id is None:
        return []
    with rt.db.read() as s:
        key = s.get(StoredFile, file_id).object_key
    with rt.store.open(key) as f:
        return [json.loads(line) for line in f.read().splitlines()]


def read(rt: Runtime, batch_id: str) -> Batch:
    with rt.db.read() as s:
        return s.get(Batch, batch_id)


@pytest.fixture
def rt(request: pytest.FixtureRequest, settings: Settings):
    """The test's runtime, on the store its parameter names (``local`` unless given: ``s3``)."""
    runtime = Runtime(replace(settings, unit_size=4))
    if getattr(request, "param", "local") == "s3":
        on_s3(request, runtime)
    yield runtime
    runtime.db.dispose()


on_each_store = pytest.mark.parametrize("rt", ["local", "s3"], indirect=True)


@pytest.fixture
def client(rt: Runtime) -> FlaskClient:
    return create_app(runtime=rt).test_client()


def tenant(rt: Runtime) -> tuple[str, dict[str, str]]:
    row, key = create_tenant(rt.db, f"t{time.monotonic_ns()}", now())
    return row.id, {"Authorization": f"Bearer {key}"}


def cancelled_at_a_third(rt: Runtime, client: FlaskClient, tenant_id: str, headers: dict) -> str:
    lines = [chat_line(f"r-{i}", f"Question {(i * 7919) % N} of {N}", max_tokens=4) for i in range(N)]
    batch_id = validated_batch(rt, tenant_id, lines)
    run_units(rt, batch_id, attempt=0, seqs=[0, 3, 5])  # 3 units of 8 ran
    response = client.post(f"/v1/batches/{batch_id}/cancel", headers=headers)
    assert response.status_code == 200, response.get_json()
    assert finalize_batch(rt, batch_id) == BatchStatus.CANCELLED
    return batch_id


def resume(client: FlaskClient, headers: dict, earlier: str, **fields: object):
    return client.post(
        "/v1/batches", headers=headers, json={"resume_from": earlier, "completion_window": "24h", **fields}
    )


def settled_count(rt: Runtime, batch: Batch) -> int:
    """Lines of its files a resume would not run: the output's, and the 4xx errors."""
    errors = lines_of(rt, batch, "error_file_id")
    kept = [e for e in errors if e["response"] is not None and e["response"]["status_code"] == 400]
    return len(lines_of(rt, batch, "output_file_id")) + len(kept)


def every_line_once(rt: Runtime, batch: Batch) -> tuple[list[dict], list[dict]]:
    output, errors = lines_of(rt, batch, "output_file_id"), lines_of(rt, batch, "error_file_id")
    ids = [x["custom_id"] for x in output + errors]
    assert sorted(ids) == sorted(f"r-{i}" for i in range(N)) and len(set(ids)) == N
    return output, errors


@on_each_store
def test_a_cancelled_batch_resumed_twice_ends_with_every_line_once(rt: Runtime, client: FlaskClient):
    tenant_id, headers = tenant(rt)
    first_id = cancelled_at_a_third(rt, client, tenant_id, headers)
    first = read(rt, first_id)
    first_output, _ = every_line_once(rt, first)
    assert 0 < len(first_output) < N // 2

    # the dry run of the resume prices only the lines left
    response = resume(client, headers, first_id, dry_run=True)
    assert response.status_code == 200, response.get_json()
    estimate_task.run(rt, response.get_json()["id"])
    estimate = client.get(f"/v1/batches/{response.get_json()['id']}", headers=headers).get_json()
    assert estimate["status"] == "completed", estimate
    left = N - settled_count(rt, first)
    assert estimate["estimate"]["requests"] == left

    response = resume(client, headers, first_id)  # input_file_id and endpoint omitted
    assert response.status_code == 200, response.get_json()
    second_id = response.get_json()["id"]
    assert response.get_json()["input_file_id"] == first.input_file_id
    assert response.get_json()["x_freight"]["resumed_from"] == first_id
    validate_batch(rt, second_id)
    second = read(rt, second_id)
    assert second.status == BatchStatus.IN_PROGRESS and second.request_total == left
    run_units(rt, second_id, attempt=1)  # the 3s fail again (500)
    assert finalize_batch(rt, second_id) == BatchStatus.COMPLETED
    second = read(rt, second_id)
    output, errors = every_line_once(rt, second)
    by_id = {x["custom_id"]: x for x in output}
    for line in first_output:  # the earlier result, byte for byte the same line
        assert by_id[line["custom_id"]] == line
    assert {e["response"]["status_code"] for e in errors} == {400, 500}
    assert all(e["custom_id"][-1] in "37" for e in errors)
    assert second.request_completed + second.request_failed == second.request_total == left

    # a resume of the resume: only the engine errors run again
    response = resume(client, headers, second_id)
    assert response.status_code == 200, response.get_json()
    third_id = response.get_json()["id"]
    validate_batch(rt, third_id)
    third = read(rt, third_id)
    assert third.request_total == len([e for e in errors if e["response"]["status_code"] == 500])
    run_units(rt, third_id, attempt=2)
    assert finalize_batch(rt, third_id) == BatchStatus.COMPLETED
    third = read(rt, third_id)
    output, errors = every_line_once(rt, third)
    assert sorted(e["custom_id"] for e in errors) == sorted(f"r-{i}" for i in range(N) if i % 10 == 7)
    assert {e["response"]["status_code"] for e in errors} == {400}

    # cost and usage: each batch its own, the chain's summed in the last one's x_freight
    chain = client.get(f"/v1/batches/{third_id}", headers=headers).get_json()["x_freight"]["chain_usage"]
    batches = [read(rt, b) for b in (first_id, second_id, third_id)]
    assert chain["batches"] == 3
    assert chain["request_completed"] == sum(b.request_completed for b in batches) == len(output)
    assert chain["input_tokens"] == sum(b.prompt_tokens for b in batches) == 10 * len(output)
    assert chain["output_tokens"] == sum(b.completion_tokens for b in batches)
    assert third.prompt_tokens == 10 * third.request_completed  # its own only

    # nothing is left worth running: the 400s would fail the same way
    response = resume(client, headers, third_id)
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "nothing_to_resume"


@on_each_store
def test_a_resume_validated_in_chunks_skips_the_same_lines(rt: Runtime, client: FlaskClient):
    from tests.workers.test_validation_chunks import validate_chunked

    tenant_id, headers = tenant(rt)
    first_id = cancelled_at_a_third(rt, client, tenant_id, headers)
    one = resume(client, headers, first_id).get_json()["id"]
    many = resume(client, headers, first_id).get_json()["id"]
    validate_batch(rt, one)
    chunked = Runtime(replace(rt.settings, validation_chunk_bytes=512))
    chunked.store = rt.store
    try:
        assert validate_chunked(chunked, many) > 1
    finally:
        chunked.db.dispose()
    ids = {}
    for batch_id in (one, many):
        ids[batch_id] = sorted(
            r.custom_id
            for u in batch_units(rt, batch_id)
            for r in read_rows(rt.store, u.shard_key, u.row_start, u.n_requests)
        )
    assert (
        ids[one] == ids[many] and len(ids[one]) == read(rt, many).request_total == read(rt, one).request_total
    )
    assert len(ids[one]) == N - settled_count(rt, read(rt, first_id))


def test_what_cannot_be_resumed_is_refused_with_the_reason(rt: Runtime, client: FlaskClient):
    tenant_id, headers = tenant(rt)
    _, other = tenant(rt)
    lines = [chat_line(f"r-{i}", f"Question {i}", max_tokens=4) for i in range(8)]
    running = validated_batch(rt, tenant_id, lines)

    def refused(earlier: object, status: int, code: str | None, **fields: object) -> dict:
        response = resume(client, headers, earlier, **fields)  # type: ignore[arg-type]
        assert response.status_code == status, response.get_json()
        error = response.get_json()["error"]
        assert error["code"] == code, error
        return error

    error = refused(running, 400, "batch_not_resumable")
    assert "in_progress" in error["message"] and error["param"] == "resume_from"
    assert resume(client, other, running).status_code == 404  # another tenant's: not found
    refused("batch_nope", 404, None)
    refused("a\x00b", 404, None)
    refused(7, 400, None)
    refused(running, 400, "batch_not_resumable", dry_run=True)  # the dry run checks it too

    run_units(rt, running, attempt=2)  # every line succeeds but the 7s (400)
    assert finalize_batch(rt, running) == BatchStatus.COMPLETED
    error = refused(running, 400, "nothing_to_resume")
    assert "4xx" in error["message"]
    with rt.db.write() as s:  # as if every line had succeeded: no error file
        s.scalars(select(Batch).where(Batch.id == running)).one().error_file_id = None
    error = refused(running, 400, "nothing_to_resume")
    assert "every line" in error["message"]
    invalid = validated_batch(rt, tenant_id, b"not json\n")  # failed at validation: nothing ran
    assert read(rt, invalid).status == BatchStatus.FAILED
    error = refused(invalid, 400, "nothing_to_resume")
    assert "before any line ran" in error["message"]


def test_a_resume_runs_the_earlier_file_and_endpoint(rt: Runtime, client: FlaskClient):
    tenant_id, headers = tenant(rt)
    first_id = cancelled_at_a_third(rt, client, tenant_id, headers)
    response = resume(client, headers, first_id, input_file_id="file-other")
    assert response.status_code == 400 and response.get_json()["error"]["param"] == "input_file_id"
    response = resume(client, headers, first_id, endpoint="/v1/completions")
    assert response.status_code == 400 and response.get_json()["error"]["param"] == "endpoint"
    first = read(rt, first_id)
    response = resume(client, headers, first_id, input_file_id=first.input_file_id, endpoint=first.endpoint)
    assert response.status_code == 200, response.get_json()
