"""An embeddings batch end to end on the live stack: the demo embedding model registered with the CLI
(its task found from its architecture), its engine worker started from the registry entry on vLLM's
pooling runner, a /v1/embeddings batch run through the official client. The vectors have the
model's dimension, equal texts give equal vectors in any line or position, base64 decodes to the
same float32 values, `dimensions` shortens them, usage counts the tokenizer's tokens (input only),
and what the model cannot honour is that line's 400. A file sent to a model of the other task
fails at validation, naming the line."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from infra.processes import FREIGHT, REPO
from tests.e2e.conftest import LiveStack, engine_worker, wait_final
from tests.factories import chat_line, decode_base64_embedding, embedding_line, jsonl

pytestmark = pytest.mark.stack

MODEL = "embed-live"
DIMENSION = 256  # infra/build_embed_model.py: HIDDEN
SAME = "The same words, in several lines."


def _freight(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FREIGHT, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_an_embeddings_batch_runs_on_the_pooling_runner(live: LiveStack, embed_model: Path) -> None:
    env = live.worker_env  # it starts a second engine worker
    added = _freight(env, "models", "add", MODEL, "--path", str(embed_model))
    assert added.returncode == 0, added.stderr[-2000:]
    assert "an embedding model: it serves /v1/embeddings" in added.stdout
    try:
        listed = {
            m["name"]: m
            for m in map(json.loads, _freight(env, "models", "list", "--json").stdout.splitlines())
        }
        assert (listed[MODEL]["task"], listed[MODEL]["quantization"]) == ("embed", "none")
        assert listed["demo"]["task"] == "generate"
        served = {m.id: m.model_extra["x_freight"] for m in live.client("alpha").models.list().data}
        assert (served[MODEL]["task"], served["demo"]["task"]) == ("embed", "generate")
        _wrong_task_files_fail_at_validation(live)
        _run(live, env, embed_model)
    finally:
        removed = _freight(env, "models", "remove", MODEL)
        assert removed.returncode == 0, removed.stderr


def _wrong_task_files_fail_at_validation(live: LiveStack) -> None:
    client = live.client("alpha")
    for endpoint, line, reason in (
        ("/v1/chat/completions", chat_line("c-1", model=MODEL), "is an embedding model"),
        ("/v1/embeddings", embedding_line("e-1", model="demo"), "generates text"),
    ):
        upload = client.files.create(file=("wrong.jsonl", jsonl([line])), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
        final = wait_final(client, batch.id, timeout=120)
        assert final.status == "failed", final
        (error,) = final.errors.data
        assert (error.code, error.line, error.param) == ("invalid_model", 1, "body.model"), error
        assert reason in error.message


def _run(live: LiveStack, env: dict[str, str], embed_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(embed_model))
    client = live.client("alpha")
    lines = [
        embedding_line("same-1", SAME, model=MODEL),
        embedding_line("same-2", SAME, model=MODEL),
        embedding_line("several", ["alpha text", SAME, "beta"], model=MODEL),
        embedding_line("b64", SAME, model=MODEL, encoding_format="base64"),
        embedding_line("ids", [[1, 5, 9], [1, 7]], model=MODEL, user="user-7"),
        embedding_line("short", SAME, model=MODEL, dimensions=64),
        embedding_line("bad-dims", SAME, model=MODEL, dimensions=100),
        embedding_line("too-long", "word " * 3000, model=MODEL),
        embedding_line("vocab", [1, 99999], model=MODEL),
    ]
    upload = client.files.create(file=("embed.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")

    with engine_worker(live, MODEL, "engine-embed-live", env, "embedding engine worker"):
        final = wait_final(client, batch.id, timeout=300)
    assert final.status == "completed", final
    assert (final.request_counts.completed, final.request_counts.failed) == (6, 3), final.request_counts

    out = {
        r["custom_id"]: r
        for r in map(json.loads, client.files.content(final.output_file_id).text.splitlines())
    }
    assert set(out) == {"same-1", "same-2", "several", "b64", "ids", "short"}
    bodies = {k: r["response"]["body"] for k, r in out.items()}
    for key, r in out.items():
        assert r["error"] is None and r["response"]["status_code"] == 200 and r["response"]["request_id"]
        body = bodies[key]
        assert body["object"] == "list" and body["model"] == MODEL
        assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
        assert all(d["object"] == "embedding" for d in body["data"])

    vector = bodies["same-1"]["data"][0]["embedding"]
    assert len(vector) == DIMENSION and all(isinstance(x, float) for x in vector)
    assert math.isclose(math.fsum(x * x for x in vector), 1.0, rel_tol=1e-3)  # normalized
    # equal texts, equal vectors: another line, another position in a line, base64 (equal to
    # rounding: each sits in other batches, which in 16-bit floats round differently on some hosts)
    assert _same(bodies["same-2"]["data"][0]["embedding"], vector)
    several = [d["embedding"] for d in bodies["several"]["data"]]
    assert len(several) == 3 and _same(several[1], vector) and not _same(several[0], vector)
    encoded = bodies["b64"]["data"][0]["embedding"]
    assert isinstance(encoded, str) and _same(decode_base64_embedding(encoded), vector)
    assert [len(d["embedding"]) for d in bodies["ids"]["data"]] == [DIMENSION, DIMENSION]
    assert len(bodies["short"]["data"][0]["embedding"]) == 64

    # usage: the tokenizer's tokens (with the model's special tokens), input only
    def tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=True))

    expected = {
        "same-1": tokens(SAME),
        "same-2": tokens(SAME),
        "several": tokens("alpha text") + tokens(SAME) + tokens("beta"),
        "b64": tokens(SAME),
        "ids": 5,
        "short": tokens(SAME),
    }
    for key, count in expected.items():
        assert bodies[key]["usage"] == {"prompt_tokens": count, "total_tokens": count}, key
    assert final.usage.input_tokens == sum(expected.values()) and final.usage.output_tokens == 0
    cost = final.model_extra["x_freight"]["cost"]
    assert cost["engine_seconds"] > 0 and cost["per_1m_tokens"]["output"] is None

    errors = {
        r["custom_id"]: r["response"]
        for r in map(json.loads, client.files.content(final.error_file_id).text.splitlines())
    }
    assert set(errors) == {"bad-dims", "too-long", "vocab"}
    assert all(e["status_code"] == 400 for e in errors.values())
    assert errors["bad-dims"]["body"]["error"]["param"] == "dimensions"
    assert "must be one of 64, 128, 256" in errors["bad-dims"]["body"]["error"]["message"]
    assert errors["too-long"]["body"]["error"]["code"] == "context_length_exceeded"
    assert "out of vocabulary" in errors["vocab"]["body"]["error"]["message"]


def _same(a: list[float], b: list[float]) -> bool:
    """The same unit vector to 16-bit rounding: no element apart by more than 2e-3 (bfloat16 keeps
    8 bits: about 3e-4 on an element of a 256-wide unit vector; two different texts' vectors of
    the demo model are apart by tens of times that)."""
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 2e-3
