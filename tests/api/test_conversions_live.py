"""A big-row output file converted to Parquet through the real API process (``freight api``:
gunicorn, one worker of four threads, in a subprocess whose resident memory is read from /proc),
on SQLite and PostgreSQL with the real Redis broker (issue #49 part 1).

400 result lines of 800 KiB of logprobs each: converting them in the API used to buffer 4,096 rows
whatever their size (+926 MiB and 27 s in the API process). Now the API answers 202 with
Retry-After and sends the conversion task to the broker; the task makes the Parquet file in row
groups bounded by bytes, and the API streams the converted object, its memory within 100 MB of
its idle size throughout.

The task runs here, in the test's process, by its function (``workers.conversions.convert`` is the
whole body of ``freight.convert_file``): so its own peak growth is read from this process's
VmHWM, which a Celery pool process would hide; the worker's path of the task runs in the live e2e
tests (tests/e2e/test_parquet_live.py)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyarrow.parquet as pq

from api.services.tenants import create_tenant
from storage.models import StoredFile, new_id
from storage.parquet_records import WRITE_BYTES
from tests.api_process import api_env, api_process
from tests.conftest import now
from tests.factories import conversions_sent
from tests.storage.test_parquet_limits import peak_rss_mb
from workers import conversions
from workers.results import encode, success_line

ROWS = 400
ROW_BYTES = 800 * 1024  # a result line's size, nearly all of it its logprobs
API_BOUND_MB = 100  # the API's RSS over its idle size while it answers and streams the download
TASK_BOUND_MB = 200  # the task's peak growth (this process's VmHWM); measured 69-80 MB


def logprobs_body(target: int) -> dict:
    """A chat completion whose first choice carries logprobs: about ``target`` bytes as JSON, of
    random tokens and figures (a Parquet page of it compresses about as a real one does)."""
    draw = random.Random(49)

    def token() -> dict:
        text = f"{draw.getrandbits(32):08x}"
        return {"token": text, "logprob": -draw.random() * 8, "bytes": list(text.encode())}

    entries = []
    while len(entries) * 545 < target:  # an entry with its five alternatives: about 545 bytes
        entries.append({**token(), "top_logprobs": [token() for _ in range(5)]})
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "demo",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "word " * 64},
                "logprobs": {"content": entries},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": len(entries), "prompt_tokens_details": {"cached_tokens": 0}},
    }  # fmt: skip


def big_output(rt, tenant_id: str) -> str:
    """A batch_output file of ROWS lines of about ROW_BYTES, streamed into the store; its id.
    Each line's logprobs are the same tokens rotated: no two rows alike (a column's dictionary
    would keep one copy of equal bodies)."""
    body = logprobs_body(ROW_BYTES)
    tokens = body["choices"][0]["logprobs"]["content"]

    def lines() -> Iterator[bytes]:
        for i in range(ROWS):
            body["choices"][0]["logprobs"]["content"] = tokens[i:] + tokens[:i]
            yield encode(success_line(f"row-{i:05d}", body))

    assert ROW_BYTES * 0.95 < len(next(lines())) < ROW_BYTES * 1.05
    file_id = new_id("file-")
    key = f"batches/x/{file_id}.jsonl"
    size = rt.store.put_chunks(key, lines())
    with rt.db.write() as s:
        s.add(StoredFile(id=file_id, tenant_id=tenant_id, purpose="batch_output", filename="out.jsonl",
                         bytes=size, object_key=key, created_at=now()))  # fmt: skip
    return file_id


def _tree(pid: int) -> list[int]:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [pid, *(p for child in children for p in _tree(int(child)))]


def rss_mb(root: int) -> float:
    """The summed VmRSS of ``root`` and its descendants (gunicorn's master and worker)."""
    total = 0
    for pid in _tree(root):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += next((int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS:")), 0)
    return total / 1024


class Sampler(threading.Thread):
    """The API's summed RSS every 50 ms, until stopped; its peak."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.peak, self.halt = root, 0.0, threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.peak = max(self.peak, rss_mb(self.root))
            self.halt.wait(0.05)

    def stop(self) -> float:
        self.halt.set()
        self.join(5)
        return self.peak


def test_a_big_row_output_converts_in_the_task_and_streams_from_the_api_in_bounded_memory(
    settings, runtime, tmp_path
) -> None:
    tenant, key = create_tenant(runtime.db, "alpha", now())
    file_id = big_output(runtime, tenant.id)
    url = f"/v1/files/{file_id}/content"
    with (
        api_process(api_env(settings), tmp_path) as (base, proc),
        httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=120) as client,
    ):
        assert client.get(f"/v1/files/{file_id}").status_code == 200  # the worker has served once
        time.sleep(1)
        idle = rss_mb(proc.pid)
        sampler = Sampler(proc.pid)
        sampler.start()
        try:
            asked = client.get(url, params={"format": "parquet"})
            assert asked.status_code == 202 and asked.headers["Retry-After"] == "2", asked.text[:300]
            assert asked.json() == {"object": "file.content", "id": file_id, "format": "parquet",
                                    "status": "preparing", "message": asked.json()["message"]}  # fmt: skip
            assert conversions_sent(runtime, file_id, "parquet") == 1  # in the real broker

            before = peak_rss_mb(reset=True)
            started = time.monotonic()
            assert conversions.convert(runtime, file_id, "parquet") == conversions.READY
            took = time.monotonic() - started
            task_growth = peak_rss_mb() - before

            got = 0
            with client.stream("GET", url, params={"format": "parquet"}) as answer:
                assert answer.status_code == 200
                assert answer.headers["content-type"] == "application/vnd.apache.parquet"
                local = tmp_path / "got.parquet"
                with local.open("wb") as out:
                    for chunk in answer.iter_bytes(1 << 20):
                        got += out.write(chunk)
                assert got == int(answer.headers["content-length"])
            # the plain JSONL download needs no conversion: as stored, streamed
            with client.stream("GET", url) as plain:
                assert (
                    plain.status_code == 200
                    and sum(len(c) for c in plain.iter_bytes(1 << 20)) > ROWS * ROW_BYTES * 0.95
                )
        finally:
            api_peak = sampler.stop()
    print(f"task: {took:.1f} s, +{task_growth:.0f} MB; API idle {idle:.0f} MB, peak {api_peak:.0f} MB; "
          f"Parquet {got / 1e6:.1f} MB")  # fmt: skip
    assert api_peak - idle < API_BOUND_MB, f"the API grew by {api_peak - idle:.0f} MB over {idle:.0f} MB idle"
    assert task_growth < TASK_BOUND_MB, f"the conversion grew by {task_growth:.0f} MB"

    meta = pq.ParquetFile(local).metadata
    assert meta.num_rows == ROWS
    # row groups bounded by bytes: each holds about WRITE_BYTES of text, never 4,096 rows of any size
    sizes = [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)]
    assert meta.num_row_groups >= ROWS * ROW_BYTES // (2 * WRITE_BYTES), sizes
    assert max(sizes) < 2 * WRITE_BYTES + 2 * ROW_BYTES, sizes
    first = pq.ParquetFile(local).read_row_group(0, columns=["custom_id", "completion_tokens"]).to_pylist()[0]
    assert first["custom_id"] == "row-00000" and first["completion_tokens"] > 1000
