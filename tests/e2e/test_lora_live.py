"""LoRA adapters end to end on the live stack: a base model registered with the CLI and two demo
adapters of it (infra/build_lora_adapters.py: ``alpha`` answers "alpha", ``beta`` "beta"), one
restricted to tenant alpha; its engine worker started from the registry with LoRA on; one batch
whose lines name the base and both adapters, run through the official client, each line answered
by its own adapter (its answer and its response's model say which). ``/v1/models`` lists each
tenant's adapters with their base. A line naming an unknown adapter, or the restricted adapter
named by another tenant, ends alone in the error file with an unknown model's 400, the same message
but for the name, while the rest of its batch completes; a file of nothing else fails at
validation, each line listed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from infra.build_lora_adapters import PROMPT
from infra.processes import FREIGHT, REPO
from tests.e2e.conftest import LiveStack, engine_worker, wait_final
from tests.factories import chat_line, jsonl

pytestmark = pytest.mark.stack

BASE = "demo-lora"
ALPHA, BETA = "lora-alpha", "lora-beta"  # BETA: tenant alpha's only
OTHER_BASE, OTHER = "demo-lora-2", "lora-other"  # an adapter of another base: no worker needed


@pytest.fixture(scope="module")
def adapters_dir(demo_model: Path) -> Path:
    from infra.build_lora_adapters import build

    out = REPO / "models" / "adapters"
    build(demo_model, out)
    return out


def _freight(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FREIGHT, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _line(custom_id: str, model: str) -> dict:
    return chat_line(custom_id, PROMPT, model=model, max_tokens=6, temperature=0)


def test_lines_of_two_adapters_and_their_base_run_in_one_batch(live: LiveStack, adapters_dir: Path) -> None:
    env = live.worker_env  # it starts a second engine worker
    bases = []
    for base in (BASE, OTHER_BASE):
        added = _freight(env, "models", "add", base, "--path", str(live.model_dir), "--quantization", "none")
        assert added.returncode == 0, added.stderr[-2000:]
        bases.append(base)
    registered = []
    try:
        adapters = ((BASE, ALPHA, "alpha", ()), (BASE, BETA, "beta", ("--tenants", "alpha")),
                    (OTHER_BASE, OTHER, "alpha", ()))  # fmt: skip
        for base, name, word, tenants in adapters:
            out = _freight(
                env, "models", "add-adapter", base, name, "--path", str(adapters_dir / word), *tenants
            )
            assert out.returncode == 0, out.stderr[-2000:]
            registered.append(name)
        listed = {
            m["name"]: m
            for m in map(json.loads, _freight(env, "models", "list", "--json").stdout.splitlines())
        }
        assert (listed[ALPHA]["base"], listed[ALPHA]["tenants"], listed[ALPHA]["rank"]) == (BASE, None, 8)
        assert listed[BETA]["tenants"] == ["alpha"]
        assert listed[ALPHA]["lora_int_id"] != listed[BETA]["lora_int_id"]
        for tenant, expected in (("alpha", {ALPHA, BETA}), ("beta", {ALPHA})):
            served = {m.id: m for m in live.client(tenant).models.list().data}
            assert {k for k in served if k.startswith("lora-")} == {*expected, OTHER}
            assert served[ALPHA].model_extra["parent"] == BASE
        _only_unknown_fails_at_validation(live)
        _run(live, env)
    finally:
        for name in registered:
            removed = _freight(env, "models", "remove-adapter", name)
            assert removed.returncode == 0, removed.stderr
        for base in bases:
            removed = _freight(env, "models", "remove", base)
            assert removed.returncode == 0, removed.stderr


def _submit(client: OpenAI, lines: list[dict]) -> str:
    upload = client.files.create(file=("lora.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    ).id


def _only_unknown_fails_at_validation(live: LiveStack) -> None:
    """A file none of whose lines names a model served here (an adapter no one registered, tenant
    alpha's adapter named by tenant beta, a model no one serves) fails at validation, each line
    listed with an unknown model's error: nothing tells a restricted adapter from no adapter."""
    client = live.client("beta")
    models = ("lora-gamma", BETA, "no-such-model")
    final = wait_final(client, _submit(client, [_line(f"n{i}", m) for i, m in enumerate(models)]), 120)
    assert final.status == "failed", final
    errors = final.errors.data
    assert [(e.code, e.line, e.param) for e in errors] == [
        ("model_not_found", i, "body.model") for i in (1, 2, 3)
    ]
    assert len({e.message.replace(m, "X") for e, m in zip(errors, models, strict=True)}) == 1, errors


def _refused_lines(client: OpenAI, final: Any) -> dict[str, dict]:
    """The error file's lines, by custom_id: each a 400 whose body is the error."""
    lines = map(json.loads, client.files.content(final.error_file_id).text.splitlines())
    out = {}
    for line in lines:
        assert line["response"]["status_code"] == 400, line
        out[line["custom_id"]] = line["response"]["body"]["error"]
    return out


def _run(live: LiveStack, env: dict[str, str]) -> None:
    client = live.client("alpha")
    models = [BASE, ALPHA, BETA]
    lines = [_line(f"{model}-{i}", model) for i in range(4) for model in models]
    # an unknown adapter's line and an adapter of another base, each refused alone: the rest runs
    batch_id = _submit(
        client, [*lines[:5], _line("typo", "lora-gamma"), _line("other-base", OTHER), *lines[5:]]
    )
    # tenant beta names alpha's restricted adapter and an unknown one beside a line of the base
    beta = live.client("beta")
    theirs = _submit(beta, [_line("base", BASE), _line("restricted", BETA), _line("unknown", "lora-gamma")])

    with engine_worker(live, BASE, "engine-lora-live", env, "LoRA engine worker"):
        final = wait_final(client, batch_id, timeout=300)
        beta_final = wait_final(beta, theirs, timeout=300)
    assert final.status == "completed", final
    assert (final.request_counts.completed, final.request_counts.failed) == (12, 2), final.request_counts
    refused = _refused_lines(client, final)
    assert refused == {
        "typo": {
            "code": "model_not_found",
            "message": "model 'lora-gamma' is not served here",  # validation's words
            "param": "model",
            "type": "invalid_request_error",
        },
        "other-base": {
            "code": "adapter_base_mismatch",
            "message": f"model {OTHER!r} is a LoRA adapter of {OTHER_BASE!r}, not of {BASE!r}, this file's "
            "model (its first line naming a served model): a file's lines name one base model or its adapters",
            "param": "model",
            "type": "invalid_request_error",
        },
    }, refused
    assert beta_final.status == "completed", beta_final
    counts = beta_final.request_counts
    assert (counts.completed, counts.failed) == (1, 2), counts
    hidden, unknown = (_refused_lines(beta, beta_final)[k] for k in ("restricted", "unknown"))
    assert hidden == {**unknown, "message": unknown["message"].replace("lora-gamma", BETA)}
    out = {
        r["custom_id"]: r["response"]["body"]
        for r in map(json.loads, client.files.content(final.output_file_id).text.splitlines())
    }
    assert "typo" not in out and "other-base" not in out and len(out) == 12
    for custom_id, body in out.items():
        model = custom_id.rsplit("-", 1)[0]
        answer = body["choices"][0]["message"]["content"].strip()
        assert body["model"] == model, (custom_id, body["model"])
        if model == ALPHA:
            assert answer.startswith("alpha"), (custom_id, answer)
        elif model == BETA:
            assert answer.startswith("beta"), (custom_id, answer)
        else:
            assert not answer.startswith(("alpha", "beta")), (custom_id, answer)
    # usage per adapter: each adapter's four lines, their tokens, a share of the charge
    report = _freight(env, "report", "--by-adapter", "--tenant", "alpha", "--format", "json")
    assert report.returncode == 0, report.stderr[-2000:]
    rows = {r["adapter"]: r for r in json.loads(report.stdout)}
    assert set(rows) == {ALPHA, BETA} and all(r["base"] == BASE for r in rows.values())
    for name, row in rows.items():
        lines = [b for c, b in out.items() if c.rsplit("-", 1)[0] == name]
        assert row["requests"] == 4
        assert row["prompt_tokens"] == sum(b["usage"]["prompt_tokens"] for b in lines)
        assert row["output_tokens"] == sum(b["usage"]["completion_tokens"] for b in lines)
        assert row["cost"] > 0
