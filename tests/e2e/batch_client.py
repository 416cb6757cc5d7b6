"""What the e2e tests do over the official ``openai`` client against a live stack: make the demo
model's chat lines, upload them, run a batch to its end, read its result files, and count lost and
duplicated lines. Shared by the e2e modules (they imported it from test_batches.py before)."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from typing import Any

import openai

from tests import factories
from tests.e2e.conftest import wait_final

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_line(custom_id: str, content: str, **body: object) -> dict:
    """A chat line for the demo model, 8 tokens unless ``max_tokens`` says otherwise."""
    return factories.chat_line(custom_id, content, **{"max_tokens": 8, **body})


def long_lines(prefix: str, n: int, tokens: int = 48) -> list[dict]:
    """``n`` lines that each write exactly ``tokens`` tokens: work that lasts long enough to be
    interrupted."""
    return [
        chat_line(f"{prefix}-{i}", f"Row {i} of {prefix}", max_tokens=tokens, min_tokens=tokens)
        for i in range(n)
    ]


def upload(client: openai.OpenAI, lines: list[dict] | bytes, name: str = "requests.jsonl") -> str:
    data = lines if isinstance(lines, bytes) else factories.jsonl(lines)
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch").id


def read_jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


def converted(get: Callable[[], Any], timeout: float = 180) -> Any:
    """A download of a file in the other format (``format=`` of ``/v1/files/{id}/content``), asked
    again while it answers 202 (the control worker converting it), after its ``Retry-After``.
    ``get``: one request, returning a response with ``status_code`` and ``headers`` (an httpx or
    requests response, or the official client's ``with_raw_response`` one). The last answer."""
    deadline = time.monotonic() + timeout
    while True:
        answer = get()
        if answer.status_code != 202:
            return answer
        assert time.monotonic() < deadline, f"still being converted after {timeout:.0f} s"
        time.sleep(float(answer.headers["Retry-After"]))


def run_batch(client, lines, endpoint=CHAT, window="24h", **kw):
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=endpoint, completion_window=window, **kw
    )
    return wait_final(client, batch.id)


def tally(output: list[dict], errors: list[dict], expected: list[str]) -> dict[str, int]:
    """lost/duplicated over the output and error files together."""
    ids = [x["custom_id"] for x in output + errors]
    seen = set(ids)
    return {"lost": len(set(expected) - seen), "duplicated": len(ids) - len(seen)}
