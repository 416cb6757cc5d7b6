"""/v1/uploads against the live stack (gunicorn API, workers, vLLM) with the official ``openai``
client unchanged: ``upload_file_chunked`` of a JSONL file in parts, a batch on the completed file
that runs to the end; the raw calls' refusals; and 200 MB in 64 MB parts through the API with its
workers' memory held far below one part (a 2 GB upload is the same path, 32 parts: not run here)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.batch_client import chat_line
from tests.e2e.conftest import (
    CHAT,
    LiveStack,
    api_worker_pids,
    peak_rss_mb,
    peak_rss_reset,
    request_line,
    wait_final,
    write_jsonl,
)

MB = 1024 * 1024


def test_upload_file_chunked_makes_a_file_a_batch_runs_on(live: LiveStack, tmp_path: Path) -> None:
    client = live.client()
    path = write_jsonl(tmp_path / "questions.jsonl", [chat_line(f"q{i}", f"question {i}") for i in range(24)])
    data = path.read_bytes()
    upload = client.uploads.upload_file_chunked(
        file=path, mime_type="text/jsonl", purpose="batch", part_size=500, md5=hashlib.md5(data).hexdigest()
    )
    assert upload.status == "completed" and upload.file is not None
    assert upload.file.bytes == len(data) and upload.file.filename == "questions.jsonl"
    assert client.files.content(upload.file.id).content == data
    batch = client.batches.create(input_file_id=upload.file.id, endpoint=CHAT, completion_window="24h")
    done = wait_final(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.completed == 24
    out = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in out) == sorted(f"q{i}" for i in range(24))


def test_the_raw_calls_and_their_refusals(live: LiveStack) -> None:
    client, other = live.client("alpha"), live.client("beta")
    upload = client.uploads.create(
        bytes=12, filename="x.jsonl", purpose="batch", mime_type="application/jsonl"
    )
    second = client.uploads.parts.create(upload_id=upload.id, data=b"world\n")
    first = client.uploads.parts.create(upload_id=upload.id, data=b"hello\n")
    with pytest.raises(openai.NotFoundError):
        other.uploads.parts.create(upload_id=upload.id, data=b"x")
    with pytest.raises(openai.BadRequestError, match="md5"):
        client.uploads.complete(upload_id=upload.id, part_ids=[first.id, second.id], md5="0" * 32)
    with pytest.raises(openai.BadRequestError, match="bytes"):
        client.uploads.complete(upload_id=upload.id, part_ids=[first.id])
    done = client.uploads.complete(upload_id=upload.id, part_ids=[first.id, second.id])
    assert done.status == "completed" and client.files.content(done.file.id).content == b"hello\nworld\n"
    with pytest.raises(openai.BadRequestError, match="completed"):
        client.uploads.parts.create(upload_id=upload.id, data=b"late")
    cancelled = client.uploads.cancel(
        client.uploads.create(bytes=5, filename="y.jsonl", purpose="batch", mime_type="text/jsonl").id
    )
    assert cancelled.status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="cancelled"):
        client.uploads.parts.create(upload_id=cancelled.id, data=b"late")
    with pytest.raises(openai.BadRequestError):
        client.uploads.create(bytes=5, filename="y.png", purpose="batch", mime_type="image/png")


def test_200_mb_in_64_mb_parts_keeps_the_api_memory_bounded(live: LiveStack, tmp_path: Path) -> None:
    line = b'{"custom_id": "pad", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    path = tmp_path / "big.jsonl"
    md5 = hashlib.md5()
    with path.open("wb") as out:
        block = line * (MB // len(line) + 1)
        for _ in range(200):
            out.write(block[:MB])
            md5.update(block[:MB])
    client = live.client()
    # the same path at 10 MB first, on the same connection (so the same gunicorn worker): what a
    # worker does once (its first query, botocore's first multipart calls) is not the part's cost;
    # on a cold worker that was 30-43 MB against 8-9 MB warm (CI's 24.8 MB failed the bound)
    warm = block[:MB] * 10
    client.uploads.upload_file_chunked(
        file=warm,
        bytes=len(warm),
        filename="warm.jsonl",
        mime_type="text/jsonl",
        purpose="batch",
        part_size=9 * MB,
    )
    pids = api_worker_pids(live.stack)
    before = {pid: (peak_rss_reset(pid), peak_rss_mb(pid))[1] for pid in pids}
    started = time.monotonic()
    upload = client.with_options(timeout=600).uploads.upload_file_chunked(
        file=path, mime_type="text/jsonl", purpose="batch", md5=md5.hexdigest()
    )
    seconds = time.monotonic() - started
    growth = max(peak_rss_mb(pid) - before[pid] for pid in pids)
    print(f"200 MB upload in 4 parts: {seconds:.1f} s, API worker peak RSS growth {growth:.1f} MB")
    assert upload.status == "completed" and upload.file.bytes == 200 * MB
    # measured: under 16 MB on local disk; 17.6 MB on SeaweedFS (boto3's client and its send
    # buffers beside the part's one mapping: storage.objectstore.PartBuffer), load average 15
    bound = 24 if live.stack.settings.object_store_url.startswith("s3://") else 16
    assert growth < bound, f"an API worker grew {growth:.0f} MB for 64 MB parts"


def test_freight_submit_sends_a_file_of_more_than_one_part_through_uploads(
    live: LiveStack, tmp_path: Path, capsys
) -> None:
    from api.client_cli import upload

    lines = [request_line(f"c{i}", f"question {i}") for i in range(40)]
    path = write_jsonl(tmp_path / "questions.jsonl", lines)
    uploaded = upload(live.client(), path, "demo", part_bytes=1000)  # 64 MiB parts in `freight submit`
    assert f"sent questions.jsonl in {-(-uploaded.bytes // 1000)} parts as upload_" in capsys.readouterr().err
    stored = [json.loads(x) for x in live.client().files.content(uploaded.id).text.splitlines()]
    assert [x["custom_id"] for x in stored] == [f"c{i}" for i in range(40)]
    assert {x["body"]["model"] for x in stored} == {"demo"}  # the model filled in, as for /v1/files
