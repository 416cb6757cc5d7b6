"""`freight download` names files after the batch id, so the id is checked before it is used
(issue #19, section 9): one given on the command line, and one a hostile or broken server sends
back, that is not a plain id is refused and no file is written anywhere."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from api.cli import main

HOSTILE_ID = "../../escaped"


class HostileServer(BaseHTTPRequestHandler):
    """A server answering any batch id with a batch whose own id climbs out of the folder."""

    def do_GET(self) -> None:
        if self.path.startswith("/v1/batches/"):
            body = json.dumps({
                "id": HOSTILE_ID, "object": "batch", "endpoint": "/v1/chat/completions",
                "input_file_id": "file-in", "completion_window": "24h", "status": "completed",
                "created_at": 1, "output_file_id": "file-out", "error_file_id": None,
                "request_counts": {"total": 1, "completed": 1, "failed": 0},
            }).encode()  # fmt: skip
        elif self.path.startswith("/v1/files/file-out/content"):
            body = b'{"custom_id": "r"}\n'
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hostile_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), HostileServer)
    # polled every 0.05 s: shutdown() waits up to one poll (0.5 s by default, at each teardown)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def download(url: str, batch_id: str, out: Path):
    return CliRunner().invoke(
        main, ["download", batch_id, "-o", str(out), "--api-url", url, "--api-key", "fk-test"]
    )


@pytest.mark.parametrize(
    "batch_id", ["../../etc/cron.d/x", "/etc/passwd", ".hidden", "batch;id", "batch_1/..", "a b"]
)
def test_an_id_that_is_not_plain_is_refused_before_any_request(batch_id: str, tmp_path: Path) -> None:
    out = tmp_path / "deep" / "results"
    result = download("http://127.0.0.1:9/v1", batch_id, out)  # nothing listens there
    assert result.exit_code == 1
    assert "not a batch id" in result.output, result.output
    assert not out.exists()


def test_an_id_the_server_sends_back_is_checked_before_it_names_a_file(
    hostile_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "deep" / "results"
    result = download(hostile_url, "batch_abc123", out)
    assert result.exit_code == 1
    assert f"not a batch id: {HOSTILE_ID!r}" in result.output, result.output
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # nothing written, inside or out
