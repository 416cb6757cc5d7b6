"""A price before the run on the live stack: the official ``openai`` client asks for a dry run
(``extra_body={"dry_run": True}``), the control worker's validation role makes the estimate
through Celery, and the client polls it as it would a batch. Nothing is created or run."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest

from tests import factories

pytestmark = pytest.mark.stack


def test_a_dry_run_through_the_openai_client_is_estimated_by_the_control_worker(live):
    alpha, beta = live.client("alpha"), live.client("beta")
    lines = [factories.chat_line(f"q{i}", f"What is {i} plus {i}?", max_tokens=5) for i in range(12)]
    body = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = alpha.files.create(file=("priced.jsonl", io.BytesIO(body)), purpose="batch")
    before = {b.id for b in alpha.batches.list(limit=100)}

    made = alpha.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                completion_window="24h", extra_body={"dry_run": True})  # fmt: skip
    assert made.id.startswith("estimate_") and made.status == "validating"
    deadline = time.monotonic() + 60
    while (answer := alpha.batches.retrieve(made.id)).status == "validating":
        assert time.monotonic() < deadline, "the control worker did not make the estimate"
        time.sleep(0.2)
    assert answer.status == "completed", answer
    estimate = answer.model_extra["estimate"]
    assert estimate["requests"] == 12 and estimate["input_tokens"] > 12
    assert estimate["output_tokens"]["max"] == 12 * 5
    assert 0 <= estimate["cache_hit_rate"] < 1

    # no batch was made, and another tenant can see neither the estimate nor ask one of the file
    assert {b.id for b in alpha.batches.list(limit=100)} == before
    with pytest.raises(openai.NotFoundError):
        beta.batches.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        beta.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                            completion_window="24h", extra_body={"dry_run": True})  # fmt: skip
