"""A base's first LoRA adapter, registered while the base's engine worker runs without LoRA, is
served without restarting the worker by hand (issue #47): the batch naming it is packed for that
worker, which restarts its own engine with the registry's LoRA limits before it claims the pack
(workers/lora_refit.py) and then runs it: every line completes, the adapter's answering as the
adapter (infra/build_lora_adapters.py: ``alpha`` answers "alpha"), the base's as the base. The
worker's log says why it restarted and how long it took. About 40 s: the worker's start and one
engine restart on the demo model."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from infra.build_lora_adapters import PROMPT
from infra.processes import FREIGHT, REPO
from tests.e2e.conftest import LiveStack, engine_worker, wait_final
from tests.factories import chat_line, jsonl

pytestmark = pytest.mark.stack

BASE = "demo-lora-first"
ADAPTER = "first-alpha"
WORKER = "engine-lora-first"


def _freight(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FREIGHT, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_a_first_adapter_added_while_its_base_runs_is_served_after_the_worker_restarts_its_engine(
    live: LiveStack, demo_model: Path
) -> None:
    from infra.build_lora_adapters import build

    alpha, _ = build(demo_model, REPO / "models" / "adapters")
    env = live.worker_env  # a second engine worker beside the stack's
    added = _freight(env, "models", "add", BASE, "--path", str(live.model_dir), "--quantization", "none")
    assert added.returncode == 0, added.stderr[-2000:]
    registered = False
    try:
        with engine_worker(live, BASE, WORKER, env, "engine worker without LoRA"):
            log = live.stack.log(WORKER)
            out = _freight(env, "models", "add-adapter", BASE, ADAPTER, "--path", str(alpha))
            assert out.returncode == 0, out.stderr[-2000:]
            registered = True
            assert "restart their engines with LoRA on before their next pack" in out.stdout
            client = live.client("beta")  # test_lora_live reports tenant alpha's adapter usage
            lines = [
                chat_line(f"{model}-{i}", PROMPT, model=model, max_tokens=6, temperature=0)
                for i in range(3)
                for model in (ADAPTER, BASE)
            ]
            upload = client.files.create(file=("first.jsonl", jsonl(lines)), purpose="batch")
            batch = client.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            final = wait_final(client, batch.id, timeout=300)
            text = log.read_text(errors="replace")
        assert final.status == "completed", final
        assert (final.request_counts.completed, final.request_counts.failed) == (6, 0), final.request_counts
        out_lines = map(json.loads, client.files.content(final.output_file_id).text.splitlines())
        answers = {r["custom_id"]: r["response"]["body"] for r in out_lines}
        assert len(answers) == 6
        for custom_id, body in answers.items():
            model = custom_id.rsplit("-", 1)[0]
            answer = body["choices"][0]["message"]["content"].strip()
            assert body["model"] == model, (custom_id, body["model"])
            assert answer.startswith("alpha") == (model == ADAPTER), (custom_id, answer)
        # why and how long, in the worker's log: it started without LoRA and restarted once
        assert f"{ADAPTER}: LoRA is off in it" in text, text[-3000:]
        restarted = re.findall(r"engine restarted in ([0-9.]+) s after ([0-9.]+) s waiting", text)
        assert len(restarted) == 1, text[-3000:]
        print(*(line for line in text.splitlines() if "restart" in line), sep="\n")
    finally:
        if registered:
            removed = _freight(env, "models", "remove-adapter", ADAPTER)
            assert removed.returncode == 0, removed.stderr
        removed = _freight(env, "models", "remove", BASE)
        assert removed.returncode == 0, removed.stderr
