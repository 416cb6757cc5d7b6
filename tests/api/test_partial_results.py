"""Results while a batch runs (GET /v1/batches/{id}/results) and downloads in input order
(?order=input), on batches whose units are claimed and recorded as an engine worker records them
(workers.unit_claims, workers.unit_recorder; no engine): a line read early is the final file's
line, a lost attempt is never read, the cursor returns only what is new, and the input order
comes out of a bounded memory."""

from __future__ import annotations

import io
import json
import time
import tracemalloc
from collections.abc import Iterable
from dataclasses import replace

import pyarrow.parquet as pq
import pytest
from flask.testing import FlaskClient
from sqlalchemy import select

from api.app import create_app
from api.services.results import Cursor
from api.services.tenants import create_tenant
from storage import result_order
from storage.errors import ServiceError
from storage.models import Batch, StoredFile, WorkUnit
from storage.runtime import Runtime
from storage.settings import Settings
from storage.shards import read_rows
from storage.status import BatchStatus
from tests.conftest import now, on_s3
from tests.factories import batch_units, chat_line, converted_download, validated_batch
from tests.workers.test_unit_recorder import record
from workers import conversions, dispatcher
from workers.finalize import finalize_batch
from workers.results import encode, request_error_line, success_line
from workers.runner_state import ActiveUnit, new_spool
from workers.unit_claims import claim_unit

HOLDER = "results-test:1"


def batch(rt: Runtime, n: int) -> tuple[str, dict[str, str]]:
    """A validated batch of ``n`` chat lines r-0 … (prompt-sorted into units), and its tenant's headers."""
    tenant, key = create_tenant(rt.db, f"t{time.monotonic_ns()}", now())
    lines = [chat_line(f"r-{i}", f"Question {(i * 7919) % n} of {n}", max_tokens=4) for i in range(n)]
    return validated_batch(rt, tenant.id, lines), {"Authorization": f"Bearer {key}"}


def run_units(rt: Runtime, batch_id: str, seqs: Iterable[int], tag: str = "a", pad: int = 0) -> None:
    """Claim the units ``seqs`` and record them through the recorder, in the order given: each
    request a success line, or a 400 error line when its custom id ends in 7."""
    by_seq = {u.seq: u for u in batch_units(rt, batch_id)}
    active = []
    for seq in seqs:
        row = by_seq[seq]
        claim = claim_unit(rt, row.id, time.time(), HOLDER)
        assert claim is not None
        unit = ActiveUnit(claim, new_spool(), new_spool(), claim.n_requests)
        for r in reversed(list(read_rows(rt.store, row.shard_key, row.row_start, row.n_requests))):
            if r.custom_id.endswith("7"):
                unit.err.write(encode(request_error_line(r.custom_id, 400, {"message": "no"})))
                unit.tally.failed += 1
            else:
                unit.out.write(
                    encode(success_line(r.custom_id, {"text": f"{tag}-{r.custom_id}" + "x" * pad}))
                )
                unit.tally.completed += 1
        unit.results = claim.n_requests
        active.append(unit)
    record(rt, active)


def final_bytes(rt: Runtime, batch_id: str, attr: str) -> bytes:
    with rt.db.read() as s:
        file_id = getattr(s.get(Batch, batch_id), attr)
        if file_id is None:
            return b""
        key = s.get(StoredFile, file_id).object_key
    with rt.store.open(key) as f:
        return f.read()


def file_id_of(rt: Runtime, batch_id: str, attr: str) -> str:
    with rt.db.read() as s:
        return getattr(s.get(Batch, batch_id), attr)


def get(client: FlaskClient, batch_id: str, headers: dict, **query: str):
    response = client.get(f"/v1/batches/{batch_id}/results", headers=headers, query_string=query)
    assert response.status_code == 200, response.get_data(as_text=True)
    return response


@pytest.fixture(params=["local", "s3"])
def rt(settings: Settings, request: pytest.FixtureRequest):
    """Each test on both databases and both object stores (a bucket of its own on SeaweedFS)."""
    runtime = Runtime(replace(settings, unit_size=4))
    if request.param == "s3":
        on_s3(request, runtime)
    yield runtime
    runtime.db.dispose()


@pytest.fixture
def client(rt: Runtime) -> FlaskClient:
    return create_app(runtime=rt).test_client()


def test_polled_results_are_the_final_files_lines_each_once(rt: Runtime, client: FlaskClient):
    batch_id, headers = batch(rt, 40)  # 10 units
    seen: list[bytes] = []
    cursor = ""
    for seqs in ([3, 0, 5], [], [9, 1, 2], [4, 6, 7, 8]):  # recorded out of order, then the rest
        run_units(rt, batch_id, seqs)
        response = get(client, batch_id, headers, after=cursor)
        lines = response.data.splitlines(keepends=True)
        recorded = {u.seq: u for u in batch_units(rt, batch_id)}
        expected = b""
        for seq in sorted(seqs):  # only the units recorded since the cursor, in seq order
            with rt.store.open(recorded[seq].output_key) as f:
                expected += f.read()
        assert response.data == expected
        assert response.headers["x-freight-results-complete"] == (
            "true" if len(seen) + len(lines) == 36 else "false"
        )
        seen += lines
        cursor = response.headers["x-freight-next-cursor"]
    assert Cursor.decode(cursor) == Cursor(9)  # every unit read: the watermark alone
    with rt.db.read() as s:
        assert s.get(Batch, batch_id).status == BatchStatus.FINALIZING
    assert get(client, batch_id, headers, after=cursor).data == b""
    assert finalize_batch(rt, batch_id) == BatchStatus.COMPLETED
    final = final_bytes(rt, batch_id, "output_file_id")
    assert sorted(seen) == sorted(final.splitlines(keepends=True)) and len(set(seen)) == len(seen) == 36
    # read again from the start: the final files, byte for byte
    assert get(client, batch_id, headers).data == final
    errors = get(client, batch_id, headers, kind="errors")
    assert errors.data == final_bytes(rt, batch_id, "error_file_id") and errors.data.count(b"\n") == 4
    assert errors.headers["x-freight-results-complete"] == "true"
    both = get(client, batch_id, headers, kind="all").data.splitlines(keepends=True)
    assert sorted(both) == sorted(final.splitlines(keepends=True) + errors.data.splitlines(keepends=True))


def test_a_lost_attempts_results_are_never_read(rt: Runtime, client: FlaskClient):
    """A worker that uploaded a unit's results and died before recording it (SIGKILL between the
    two) leaves objects under its attempt's keys: they are not read, before or after the unit
    runs again, and what is read is what the final file holds."""
    batch_id, headers = batch(rt, 8)  # 2 units
    first = batch_units(rt, batch_id)[0]
    t0 = time.time()
    claim = claim_unit(rt, first.id, t0, HOLDER)
    assert claim is not None and claim.attempt == 1
    rows = list(read_rows(rt.store, first.shard_key, first.row_start, first.n_requests))
    lost = b"".join(encode(success_line(r.custom_id, {"text": "lost"})) for r in rows)
    base = f"batches/{batch_id}/units/{first.seq:06d}.{claim.attempt}"
    rt.store.put_chunks(f"{base}.output.jsonl", [lost])
    rt.store.put_chunks(f"{base}.errors.jsonl", [b""])
    assert get(client, batch_id, headers).data == b""
    dispatcher.redeliver_stale(rt, t0 + rt.settings.lease_seconds + 1, dispatcher.TickReport())
    assert get(client, batch_id, headers).data == b""
    run_units(rt, batch_id, [first.seq], tag="second")
    read = get(client, batch_id, headers).data
    assert read and b"lost" not in read and b"second-" in read
    with rt.db.read() as s:
        assert s.get(WorkUnit, first.id).attempts == 2
    run_units(rt, batch_id, [1])
    finalize_batch(rt, batch_id)
    final = final_bytes(rt, batch_id, "output_file_id")
    assert b"lost" not in final and read in final


def test_another_tenants_batch_and_bad_parameters(rt: Runtime, client: FlaskClient):
    batch_id, headers = batch(rt, 8)
    _, key = create_tenant(rt.db, "other", now())
    other = {"Authorization": f"Bearer {key}"}
    for path in (f"/v1/batches/{batch_id}/results", "/v1/batches/batch_nope/results"):
        response = client.get(path, headers=other)
        assert response.status_code == 404 and response.json["error"]["param"] == "batch_id"
    for query, param in (
        ({"after": "nonsense"}, "after"),
        ({"after": "r1.AAAA"}, "after"),
        ({"kind": "everything"}, "kind"),
        ({"format": "csv"}, "format"),
        ({"order": "output"}, "order"),
    ):
        response = client.get(f"/v1/batches/{batch_id}/results", headers=headers, query_string=query)
        assert response.status_code == 400 and response.json["error"]["param"] == param, query


def test_cursor_round_trips_and_its_watermark_moves_over_what_was_read():
    read = Cursor().plus([0, 1, 2, 5, 9, 700], range(1000))
    assert read == Cursor(2, frozenset({5, 9, 700}))
    assert Cursor.decode(read.encode()) == read and len(read.encode()) < 80
    assert read.plus([3, 4], range(1000)) == Cursor(5, frozenset({9, 700}))
    assert Cursor.decode("") == Cursor() and Cursor.decode(Cursor().encode()) == Cursor()
    with pytest.raises(ServiceError):
        Cursor.decode("r1." + "A" * 10)


def test_results_as_parquet_and_in_input_order(rt: Runtime, client: FlaskClient):
    batch_id, headers = batch(rt, 24)
    run_units(rt, batch_id, [4, 1])
    jsonl = get(client, batch_id, headers).data.splitlines()
    table = pq.read_table(io.BytesIO(get(client, batch_id, headers, format="parquet").data))
    assert table.column("custom_id").to_pylist() == [json.loads(x)["custom_id"] for x in jsonl]
    ordered = get(client, batch_id, headers, order="input").data.splitlines()
    assert sorted(ordered) == sorted(jsonl)
    assert [int(json.loads(x)["custom_id"][2:]) for x in ordered] == sorted(
        int(json.loads(x)["custom_id"][2:]) for x in jsonl
    )


def test_a_large_batch_downloads_in_input_order_in_bounded_memory(settings: Settings, monkeypatch):
    """3,000 lines of ~8 kB (22 MB of output) through a sort allowed 1 MB: the download's Python
    allocations (the sort's buffer, a read chunk, the spilled runs' read buffers) stay under a
    third of the file, and every line comes once, in input order."""
    rt = Runtime(replace(settings, unit_size=64, max_file_bytes=16 * 1024 * 1024))
    try:
        _large_batch_in_input_order(rt, create_app(runtime=rt).test_client(), monkeypatch)
    finally:
        rt.db.dispose()


def _large_batch_in_input_order(rt: Runtime, client: FlaskClient, monkeypatch) -> None:
    n = 3_000
    batch_id, headers = batch(rt, n)
    run_units(rt, batch_id, range(len(batch_units(rt, batch_id))), pad=8_000)
    assert finalize_batch(rt, batch_id) == BatchStatus.COMPLETED
    final = final_bytes(rt, batch_id, "output_file_id")
    assert len(final) > 20_000_000
    monkeypatch.setattr(result_order, "INPUT_ORDER_MEMORY_BYTES", 1024 * 1024)
    file_id = file_id_of(rt, batch_id, "output_file_id")
    tracemalloc.start()
    try:
        response = client.get(
            f"/v1/files/{file_id}/content", headers=headers, query_string={"order": "input"}
        )
        size, lines = 0, []
        for chunk in response.response:
            size += len(chunk)
            lines += [int(cid) for cid in _ids(chunk)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert response.status_code == 200 and size == len(final)
    assert lines == [i for i in range(n) if not str(i).endswith("7")]
    assert peak < len(final) / 3, peak
    # the error file too, and the results route says the same once the batch has ended
    errors = client.get(f"/v1/files/{file_id_of(rt, batch_id, 'error_file_id')}/content", headers=headers,
                        query_string={"order": "input"})  # fmt: skip
    assert [int(c) for c in _ids(errors.data)] == [i for i in range(n) if str(i).endswith("7")]
    assert get(client, batch_id, headers, order="input").data == b"".join(
        sorted(final.splitlines(keepends=True), key=lambda x: int(json.loads(x)["custom_id"][2:]))
    )
    # as Parquet: converted once by the control worker's task (202 until then), in input order
    parquet = converted_download(client, rt, headers, file_id, "parquet", conversions.INPUT_ORDER_PARQUET)
    assert parquet.status_code == 200
    assert parquet.headers["Content-Disposition"] == f'attachment; filename="{file_id}.input-order.parquet"'
    ids = pq.read_table(io.BytesIO(parquet.data)).column("custom_id").to_pylist()
    assert ids == [f"r-{i}" for i in range(n) if not str(i).endswith("7")]


def _ids(chunk: bytes) -> list[str]:
    """custom ids r-N in a chunk of whole lines (the sorted stream yields a line at a time)."""
    return [json.loads(line)["custom_id"][2:] for line in chunk.splitlines()]


def test_input_order_is_for_a_batchs_result_files(rt: Runtime, client: FlaskClient):
    batch_id, headers = batch(rt, 4)
    with rt.db.read() as s:
        input_file = s.get(Batch, batch_id).input_file_id
    response = client.get(f"/v1/files/{input_file}/content", headers=headers, query_string={"order": "input"})
    assert response.status_code == 400 and response.json["error"]["code"] == "input_order_unavailable"


def test_freight_download_partial_then_in_input_order(rt: Runtime, tmp_path):
    """``freight download ID --partial`` saves the lines recorded so far while the batch runs;
    ``--input-order`` once it has ended saves its files in input order."""
    import threading

    from click.testing import CliRunner
    from werkzeug.serving import make_server

    from api.cli import main

    batch_id, headers = batch(rt, 16)
    key = headers["Authorization"].removeprefix("Bearer ")
    server = make_server("127.0.0.1", 0, create_app(runtime=rt), threaded=True)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:

        def download(*flags: str):
            result = CliRunner().invoke(
                main, ["download", batch_id, "-o", str(tmp_path), "--api-url", url, "--api-key", key, *flags]
            )
            assert result.exit_code == 0, result.output
            return result

        run_units(rt, batch_id, [2])
        early = download("--partial")
        assert "still running" in early.output
        partial = (tmp_path / f"{batch_id}.output.partial.jsonl").read_bytes()
        with rt.db.read() as s:
            unit = s.scalar(select(WorkUnit).where(WorkUnit.batch_id == batch_id, WorkUnit.seq == 2))
        with rt.store.open(unit.output_key) as f:
            assert partial == f.read()
        run_units(rt, batch_id, [0, 1, 3])
        finalize_batch(rt, batch_id)
        download("--input-order")
        ordered = (tmp_path / f"{batch_id}.output.jsonl").read_bytes().splitlines(keepends=True)
        final = final_bytes(rt, batch_id, "output_file_id").splitlines(keepends=True)
        assert ordered == sorted(final, key=lambda x: int(json.loads(x)["custom_id"][2:]))
        assert set(partial.splitlines(keepends=True)) <= set(final)
    finally:
        server.shutdown()
        server.server_close()
