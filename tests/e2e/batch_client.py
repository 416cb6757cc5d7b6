"""What the e2e tests do over the official ``openai`` client against a live stack: make the demo
model's chat lines, upload them, run a batch to its end, read its result files, and count lost and
duplicated lines. Shared by the e2e modules (they imported it from test_batches.py before)."""

from __future__ import annotations

import io
import json

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
