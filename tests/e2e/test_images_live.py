"""Images in chat lines end to end on the live stack: the demo vision-language model (models/vlm,
infra/build_vlm_model.py) registered with the CLI, its engine worker started from the registry, a
batch of image lines sent with the official client. Images come as data: URLs and as links the
control worker fetches from a server on 127.0.0.1; the same image in several lines is stored once
and counted in every line's prompt tokens as vLLM counts it. Each bad image (undecodable, past the
pixel limit, a link that answers 404) ends its own line with an error naming the part, and a line
with an image for the text-only demo model gets the same kind of error while its file's other
lines run. An image may be a file the tenant uploaded with purpose vision (chat's URL, a Responses
input_image's file_id, a Parquet file's image column); another tenant's file id is that line's
404."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from infra.processes import FREIGHT, REPO
from tests.e2e.conftest import LiveStack, engine_worker, wait_final
from tests.factories import chat_line, data_url, image_bytes, image_line, jsonl, parquet_bytes
from tests.workers.test_images import png_claiming

pytestmark = pytest.mark.stack

MODEL = "vlm-live"
RED = image_bytes(64, 64, (200, 30, 30))
BLUE = image_bytes(40, 80, (20, 30, 200), "JPEG")


def _freight(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FREIGHT, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def image_host() -> Iterator[str]:
    class Images(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = {"/blue.jpg": BLUE}.get(self.path)
            self.send_response(200 if data else 404)
            self.send_header("content-length", str(len(data or b"")))
            self.end_headers()
            with contextlib.suppress(OSError):
                self.wfile.write(data or b"")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _files(client: Any, final: Any) -> tuple[dict[str, dict], dict[str, dict]]:
    assert final.status == "completed", final
    out = [json.loads(x) for x in client.files.content(final.output_file_id).text.splitlines()]
    err = []
    if final.error_file_id:
        err = [json.loads(x) for x in client.files.content(final.error_file_id).text.splitlines()]
    ids = [r["custom_id"] for r in out + err]
    assert len(ids) == len(set(ids)), ids  # every line once
    return {r["custom_id"]: r for r in out}, {r["custom_id"]: r for r in err}


def test_a_batch_of_image_lines_runs_on_a_vision_model(
    live: LiveStack, image_host: str, vlm_model: Path
) -> None:
    env = live.worker_env
    added = _freight(env, "models", "add", MODEL, "--path", str(vlm_model))
    assert added.returncode == 0, added.stderr[-2000:]
    client = live.client("alpha")
    blue_file = client.files.create(file=("blue.jpg", BLUE), purpose="vision")
    red_file = client.files.create(file=("red.png", RED), purpose="user_data")
    betas = live.client("beta").files.create(file=("red.png", RED), purpose="vision")
    try:
        lines = [
            image_line("red-colour", data_url(RED), "What colour is it?", model=MODEL, max_tokens=4),
            image_line("red-shape", data_url(RED), "What shape is it?", model=MODEL, max_tokens=4),
            image_line(
                "blue-link", f"{image_host}/blue.jpg", "What colour is it?", model=MODEL, max_tokens=4
            ),
            chat_line("text-only", "What colour is the sky?", model=MODEL, max_tokens=4),
            image_line("blue-file", blue_file.id, "What colour is it?", model=MODEL, max_tokens=4),
            image_line("beta-file", betas.id, model=MODEL),
            image_line("broken", "data:image/png;base64,iVBORw0KGgo=", model=MODEL),
            image_line("too-big", data_url(png_claiming(5_000, 5_000)), model=MODEL),
            image_line("gone", f"{image_host}/missing.png", model=MODEL),
            # the model's image token typed as text: an image the line does not have, refused alone
            image_line("token-as-text", data_url(RED), "Is <image> red?", model=MODEL, max_tokens=4),
        ]
        upload = client.files.create(file=("images.jsonl", jsonl(lines)), purpose="batch")
        vision = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        # the text-only demo model: its image line is refused alone, its text line runs
        mixed = [
            image_line("demo-image", data_url(RED), model="demo"),
            chat_line("demo-text", "hello"),
            chat_line("demo-says-image", "Spell <image>."),
        ]  # a text model has no image token
        upload = client.files.create(file=("mixed.jsonl", jsonl(mixed)), purpose="batch")
        text_only = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        # a /v1/responses line with an input_image part runs on the same engine
        given = [{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(RED)}, {"type": "input_text", "text": "Colour?"}]}]  # fmt: skip
        line = {"custom_id": "resp", "method": "POST", "url": "/v1/responses",
                "body": {"model": MODEL, "input": given, "max_output_tokens": 4, "store": False}}  # fmt: skip
        by_file = [{"role": "user", "content": [
            {"type": "input_image", "file_id": red_file.id}, {"type": "input_text", "text": "Colour?"}]}]  # fmt: skip
        by_id = {"custom_id": "resp-file", "method": "POST", "url": "/v1/responses",
                 "body": {"model": MODEL, "input": by_file, "max_output_tokens": 4, "store": False}}  # fmt: skip
        upload = client.files.create(file=("responses.jsonl", jsonl([line, by_id])), purpose="batch")
        responses = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/responses", completion_window="24h"
        )

        # a Parquet file whose image columns name uploaded files (strings), not bytes
        upload = client.files.create(
            file=("images.parquet", _parquet_by_file_id(blue_file.id, red_file.id, betas.id)), purpose="batch"
        )
        tabled = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        with engine_worker(live, MODEL, "engine-vlm-live", env, "vision-language engine worker"):
            final = wait_final(client, vision.id, timeout=300)
            answered, _ = _files(client, wait_final(client, responses.id, timeout=300))
            table_out, table_err = _files(client, wait_final(client, tabled.id, timeout=300))
        out, err = _files(client, final)
    finally:
        removed = _freight(env, "models", "remove", MODEL)
        assert removed.returncode == 0, removed.stderr

    assert set(out) == {"red-colour", "red-shape", "blue-link", "text-only", "blue-file"}, err
    usage = {key: line["response"]["body"]["usage"] for key, line in out.items()}
    assert all(line["response"]["status_code"] == 200 for line in out.values())
    # an image costs its tokens in the prompt as vLLM counts them (the demo Idefics3: 94 for a
    # square image, 80 image tokens and 14 markers; 57 for a 1:2 one)
    text_tokens = usage["text-only"]["prompt_tokens"]
    assert usage["red-colour"]["prompt_tokens"] >= text_tokens + 80, usage
    assert usage["red-shape"]["prompt_tokens"] >= text_tokens + 80, usage
    assert usage["blue-link"]["prompt_tokens"] >= text_tokens + 50, usage
    assert usage["blue-file"]["prompt_tokens"] == usage["blue-link"]["prompt_tokens"]  # the same image
    assert final.usage.input_tokens == sum(u["prompt_tokens"] for u in usage.values())
    assert final.request_counts.completed == 5 and final.request_counts.failed == 5
    for key in ("resp", "resp-file"):
        response = answered[key]["response"]
        assert response["status_code"] == 200 and response["body"]["object"] == "response"
        assert response["body"]["usage"]["input_tokens"] >= 80  # the image's tokens
    assert (
        answered["resp"]["response"]["body"]["usage"]["input_tokens"]
        == answered["resp-file"]["response"]["body"]["usage"]["input_tokens"]
    )

    def error(key: str) -> dict:
        assert err[key]["response"]["status_code"] == 400, err[key]
        return err[key]["response"]["body"]["error"]

    assert (error("broken")["code"], error("broken")["param"]) == ("invalid_image", "messages.0.content.0")
    assert error("too-big")["code"] == "image_too_large" and "5000x5000" in error("too-big")["message"]
    assert error("gone")["code"] == "image_fetch_failed" and "HTTP 404" in error("gone")["message"]
    injected = error("token-as-text")
    assert (injected["code"], injected["param"]) == ("image_token_in_text", "messages.0.content.1.text")
    assert injected["message"].startswith(
        "`messages.0.content.1.text` holds '<image>', an image token of model"
    )
    # another tenant's file: as an unknown one, a 404 naming the part
    theirs = err["beta-file"]["response"]
    assert theirs["status_code"] == 404, theirs
    assert (theirs["body"]["error"]["code"], theirs["body"]["error"]["param"]) == (
        "file_not_found",
        "messages.0.content.0",
    )

    # the Parquet rows: each file id read as the JSONL line's is (the same image, the same tokens)
    assert set(table_out) == {"pq-blue", "pq-both"} and set(table_err) == {"pq-theirs"}, table_err
    table_usage = {key: line["response"]["body"]["usage"] for key, line in table_out.items()}
    assert table_usage["pq-blue"]["prompt_tokens"] == usage["blue-file"]["prompt_tokens"], table_usage
    both = table_usage["pq-both"]["prompt_tokens"]
    assert both >= usage["blue-file"]["prompt_tokens"] + 80, table_usage  # and the red square's
    theirs = table_err["pq-theirs"]["response"]
    assert theirs["status_code"] == 404, theirs
    assert (theirs["body"]["error"]["code"], theirs["body"]["error"]["param"]) == (
        "file_not_found",
        "messages.0.content.0",
    )

    out, err = _files(client, wait_final(client, text_only.id, timeout=300))
    assert set(out) == {"demo-text", "demo-says-image"} and set(err) == {"demo-image"}
    refused = err["demo-image"]["response"]["body"]["error"]
    assert refused["code"] == "image_input_not_supported" and "does not take images" in refused["message"]
    assert refused["param"] == "messages.0.content.0"


def _parquet_by_file_id(blue: str, red: str, betas: str) -> bytes:
    """Chat rows in Parquet's simple shape whose ``image`` and ``images`` columns hold file ids."""
    import pyarrow as pa

    messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    question = [{"role": "user", "content": "What colour is it?"}]
    table = pa.table(
        {
            "custom_id": ["pq-blue", "pq-both", "pq-theirs"],
            "model": [MODEL] * 3,
            "max_tokens": [4] * 3,
            "messages": pa.array([question] * 3, messages),
            "image": pa.array([blue, None, betas], pa.string()),
            "images": pa.array([None, [red, blue], None], pa.list_(pa.string())),
        }
    )
    return parquet_bytes(table)
