"""Test factories for batch input: request lines of the OpenAI batch format, the JSONL and Parquet
bytes of a file, and "upload a file, then create a batch on it", either in-process (``workers.intake``,
as the API's services do) or over HTTP through a Flask test client."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from scheduler.estimate import EngineModel
from workers import intake
from workers.validation import validate_batch

if TYPE_CHECKING:
    import pyarrow as pa

    from storage.models import Batch, StoredFile, WorkUnit
    from storage.runtime import Runtime
    from workers.engine import Engine, EngineRequest, EngineResult
    from workers.execution import PackRunner

CHAT = "/v1/chat/completions"


class _Omit:
    def __repr__(self) -> str:
        return "OMIT"


OMIT: Any = _Omit()  # a field given as OMIT is left out of the line (None is sent as JSON null)


def chat_line(
    custom_id: str = "r1",
    content: str = "hi",
    *,
    model: str = "demo",
    max_tokens: int | None = 4,
    **body: Any,
) -> dict:
    """One chat-completions line: a single user message, ``model`` and ``max_tokens`` (either left
    out when given as ``OMIT``), then any other ``body`` fields (which may also replace ``messages``)."""
    fields = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    merged = {k: v for k, v in {**fields, **body}.items() if v is not OMIT}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": merged}


def image_bytes(
    width: int = 32, height: int = 32, color: tuple[int, int, int] = (200, 30, 30), fmt: str = "PNG"
) -> bytes:
    """An image of one colour, encoded (PNG, JPEG, WEBP, GIF...)."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    import base64

    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_line(
    custom_id: str, url: str, text: str = "What is in this image?", *, model: str = "vlm", **body: Any
) -> dict:
    """A chat line whose user message is an image (``url``: a data: URL or a link) then a text."""
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return chat_line(custom_id, model=model, messages=[{"role": "user", "content": parts}], **body)


def embedding_line(custom_id: str = "e1", text: Any = "hello", *, model: str = "embed", **body: Any) -> dict:
    """One /v1/embeddings line: ``input`` (a text, or any value given) for ``model``, then any other
    ``body`` fields (encoding_format, dimensions...)."""
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": model, "input": text, **body},
    }


def responses_line(custom_id: str = "p1", given: Any = "hi", *, model: str = "demo", **body: Any) -> dict:
    """One /v1/responses line: ``input`` (``given``: a text, or any value: message items...) for
    ``model`` (left out when given as ``OMIT``), then any other ``body`` fields (instructions,
    max_output_tokens, text, tools...)."""
    merged = {k: v for k, v in {"model": model, "input": given, **body}.items() if v is not OMIT}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": merged}


def jsonl(lines: Iterable[dict]) -> bytes:
    """The JSONL file of ``lines``: one JSON object a line, each ending in a newline."""
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def parquet_bytes(table: pa.Table) -> bytes:
    """``table`` written as one Parquet file."""
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def _data(data: bytes | Iterable[dict]) -> bytes:
    return data if isinstance(data, bytes) else jsonl(data)


# -- in-process: workers.intake, as the API's services call it ------------------------------------


def upload(rt: Runtime, tenant_id: str, data: bytes | Iterable[dict], name: str = "in.jsonl") -> StoredFile:
    """A tenant's uploaded batch input file: ``data`` as bytes, or lines made into JSONL."""
    return intake.upload(rt, tenant_id, "batch", name, io.BytesIO(_data(data)))


def create(rt: Runtime, tenant_id: str, file_id: str, endpoint: str = CHAT, **fields: Any) -> Batch:
    """The Batch API's create on an uploaded file; ``fields`` add to or replace the payload's."""
    return intake.create(rt, tenant_id, {"input_file_id": file_id, "endpoint": endpoint, **fields})


def upload_and_create(
    rt: Runtime,
    tenant_id: str,
    data: bytes | Iterable[dict],
    *,
    name: str = "in.jsonl",
    endpoint: str = CHAT,
    **create_fields: Any,
) -> Batch:
    """Upload ``data`` then create a batch on it (it stays ``validating``: nothing validates it)."""
    return create(rt, tenant_id, upload(rt, tenant_id, data, name).id, endpoint, **create_fields)


def validated_batch(rt: Runtime, tenant_id: str, data: bytes | Iterable[dict], **kw: Any) -> str:
    """:func:`upload_and_create`, then the validating step run in-process; the batch's id."""
    batch_id = upload_and_create(rt, tenant_id, data, **kw).id
    validate_batch(rt, batch_id)
    return batch_id


# -- over HTTP: /v1 through a Flask test client ----------------------------------------------------


def http_upload(
    client: Any, headers: dict, data: bytes | Iterable[dict] | None = None, name: str = "in.jsonl"
) -> Any:
    """POST /v1/files (purpose ``batch``) of ``data``, one default :func:`chat_line` if None; the
    test client's response."""
    data = jsonl([chat_line()]) if data is None else data
    return client.post(
        "/v1/files", headers=headers, data={"purpose": "batch", "file": (io.BytesIO(_data(data)), name)},
        content_type="multipart/form-data",
    )  # fmt: skip


def http_create(client: Any, headers: dict, file_id: str, **fields: Any) -> Any:
    """POST /v1/batches for the chat endpoint and a 24h window; ``fields`` add to or replace those."""
    payload = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h", **fields}
    return client.post("/v1/batches", headers=headers, json=payload)


# -- the `freight` command, as an operator runs it -------------------------------------------------


def without_freight_settings() -> dict[str, str]:
    """This process's environment without the test run's FREIGHT_* settings (a fresh shell's)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("FREIGHT_")}


def run_freight(*argv: str, env: dict[str, str], cwd: Any, umask: int = -1) -> subprocess.CompletedProcess:
    """``python -m api.cli ARGV`` in a subprocess (its own settings, umask and exit status)."""
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
        umask=umask,
    )


def cli_on(runtime: Any, *argv: str) -> Any:
    """``freight ARGV`` in-process (click's CliRunner) on the test's own database."""
    from click.testing import CliRunner

    from api.cli import main

    env = {
        "FREIGHT_DATA_DIR": str(runtime.settings.data_dir),
        "FREIGHT_DATABASE_URL": runtime.settings.database_url,
    }
    return CliRunner().invoke(main, list(argv), env=env)


def batch_units(rt: Runtime, batch_id: str) -> list[WorkUnit]:
    """The batch's work units as the database holds them now, in id order."""
    from sqlalchemy import select

    from storage.models import WorkUnit

    with rt.db.read() as s:
        return list(s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch_id).order_by(WorkUnit.id)))


def wait_units_done(rt: Runtime, runner: PackRunner, batch_id: str, timeout: float = 120) -> list[WorkUnit]:
    """Poll until every unit of the batch is recorded DONE by an engine worker's pack path; a
    failure of the runner's own threads, or the timeout, fails the test with what it saw."""
    from storage.models import UnitStatus

    deadline = time.monotonic() + timeout
    while True:
        assert runner.failure is None, runner.failure
        units = batch_units(rt, batch_id)
        if all(u.status == UnitStatus.DONE for u in units):
            return units
        assert time.monotonic() < deadline, [u.status for u in units]
        time.sleep(0.1)


def run_alone(engine: Engine, requests: Iterable[EngineRequest]) -> dict[str, EngineResult]:
    """One engine run of ``requests`` under a cache salt no other run uses, by key. Nothing an
    earlier run (or test) cached is hit, so two such runs of the same requests in the same order
    compute the same batches: their greedy outputs are equal, and so are their logprobs, bit for
    bit when the engine core runs inline (with a core process, its step threads may split a
    reduction differently run to run: equal to about 1e-3 there). Two requests of one run are
    not: they share batches with different neighbours (and the second may hit the first's cached
    blocks), and in bfloat16 on an Intel AMX host that rounding flipped a greedy token (#45)."""
    import dataclasses
    import uuid

    salt = uuid.uuid4().hex
    return {r.key: r for r in engine.run(dataclasses.replace(q, cache_salt=salt) for q in requests)}


# an engine timed by a known model, for the estimate's fit (scheduler.estimate.fit_engine_model)
TRUE_ENGINE = EngineModel(prefill=1.5e-4, decode=3e-4, kv_read=4e-7)


def mixed_engine_samples(n: int, model: EngineModel = TRUE_ENGINE) -> list[tuple[float, float, float, float]]:
    """n samples of three workloads' mixes (long prefills; short prompts and long outputs; long
    cached contexts and long outputs), timed exactly by ``model``."""
    mixes = [(24_000, 1_500, 1_700_000), (12_000, 7_000, 1_000_000), (8_000, 6_400, 3_100_000)]
    out = []
    for i in range(n):
        u, o, k = mixes[i % 3]
        u, o, k = u * (1 + i / 50), o * (1 - i / 90), k * (1 + i / 70)  # no two samples alike
        out.append((u, o, k, model.seconds(u, o, k)))
    return out


def decode_base64_embedding(text: str) -> list[float]:
    """The float32 values of a base64 embedding: what a client does with OpenAI's base64."""
    import base64
    from array import array

    floats = array("f")
    floats.frombytes(base64.b64decode(text, validate=True))
    if sys.byteorder != "little":
        floats.byteswap()
    return floats.tolist()


def converted_download(
    client: Any, rt: Runtime, headers: dict, file_id: str, fmt: str, kind: str | None = None
) -> Any:
    """``GET /v1/files/{id}/content?format=fmt`` of a file stored in the other format: a 202 with
    Retry-After while the control worker converts it, the task's message sent to the real broker
    (read back from Redis), then the task run here, in this process (``workers.conversions.convert``
    is the whole body of ``freight.convert_file``; the worker's own path runs in the live tests),
    then the download's answer: the converted file, or the refusal it remembered. ``kind``
    ``input.parquet``: the file as Parquet in its input's line order (``order=input``)."""
    from workers import conversions

    order = "&order=input" if kind == conversions.INPUT_ORDER_PARQUET else ""
    url = f"/v1/files/{file_id}/content?format={fmt}{order}"
    kind = kind or fmt
    sent_before = conversions_sent(rt, file_id, kind)
    first = client.get(url, headers=headers)
    assert first.status_code == 202, first.get_data(as_text=True)[:300]
    assert first.headers["Retry-After"] == str(conversions.RETRY_AFTER_SECONDS)
    assert first.json["status"] == "preparing" and first.json["format"] == fmt
    assert conversions_sent(rt, file_id, kind) == sent_before + 1  # the task's message, in the broker
    assert client.get(url, headers=headers).status_code == 202  # still preparing: not sent again
    assert conversions_sent(rt, file_id, kind) == sent_before + 1
    conversions.convert(rt, file_id, kind)
    return client.get(url, headers=headers)


def conversions_sent(rt: Runtime, file_id: str, fmt: str) -> int:
    """The ``freight.convert_file`` messages for ``file_id`` and ``fmt`` waiting in the real
    broker's validation queue (read from its Redis list; none is consumed in these tests)."""
    from storage.broker import VALIDATE_QUEUE

    with rt.queue.celery.pool.acquire(block=True) as conn:
        waiting = conn.default_channel.client.lrange(VALIDATE_QUEUE, 0, -1)
    return sum(
        1
        for raw in waiting
        if (message := json.loads(raw))["headers"]["task"] == "freight.convert_file"
        and message["headers"]["argsrepr"] == repr([file_id, fmt])
    )
