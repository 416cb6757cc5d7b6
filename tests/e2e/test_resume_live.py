"""Resuming a batch against the live stack with the official ``openai`` client (issue #48 part 3):
a batch cancelled at about a third is resumed with ``extra_body={"resume_from": ...}``, the
resume cancelled in turn and resumed by ``freight resume``; the last merged output holds every
line once. A running batch is refused with the reason, another tenant's batch is a 404."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

from tests.e2e.batch_client import CHAT, long_lines, read_jsonl, upload
from tests.e2e.conftest import wait_final
from tests.e2e.test_client_cli import freight

pytestmark = pytest.mark.stack

N = 360
TOKENS = 64  # per line: long enough that a cancel lands mid-run


def cancel_after(client: openai.OpenAI, batch_id: str, done: int) -> object:
    """Cancel the batch once ``done`` of its lines have completed; the cancelled batch."""
    deadline = time.monotonic() + 240
    while client.batches.retrieve(batch_id).request_counts.completed < done:
        assert time.monotonic() < deadline, f"{batch_id}: fewer than {done} lines completed"
        time.sleep(0.2)
    client.batches.cancel(batch_id)
    return wait_final(client, batch_id, timeout=120)


def test_a_batch_cancelled_at_a_third_and_resumed_ends_with_every_line_once(live, tmp_path: Path) -> None:
    client = live.client()
    lines = long_lines("resume", N, tokens=TOKENS)
    expected = sorted(x["custom_id"] for x in lines)
    first = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h")

    with pytest.raises(openai.BadRequestError) as refused:  # still running: refused, with the reason
        client.batches.create(
            input_file_id=first.input_file_id, endpoint=CHAT, completion_window="24h",
            extra_body={"resume_from": first.id},
        )  # fmt: skip
    assert refused.value.code == "batch_not_resumable" and "resumed" in refused.value.message
    with pytest.raises(openai.NotFoundError):  # another tenant's batch
        live.client("beta").batches.create(
            input_file_id=first.input_file_id, endpoint=CHAT, completion_window="24h",
            extra_body={"resume_from": first.id},
        )  # fmt: skip

    first = cancel_after(client, first.id, N // 3)
    assert first.status == "cancelled"
    ran = read_jsonl(client, first.output_file_id)
    assert N // 3 <= len(ran) < N

    second = client.batches.create(
        input_file_id=first.input_file_id, endpoint=CHAT, completion_window="1h",
        extra_body={"resume_from": first.id},
    )  # fmt: skip
    assert second.model_extra["x_freight"]["resumed_from"] == first.id
    second = cancel_after(client, second.id, 1)  # a resume cancelled in turn
    assert second.status == "cancelled"
    assert second.request_counts.total == N - len(ran)
    output, errors = read_jsonl(client, second.output_file_id), read_jsonl(client, second.error_file_id)
    assert sorted(x["custom_id"] for x in output + errors) == expected

    done = freight(live, "resume", second.id, "--wait", "-o", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    third_id = done.stdout.splitlines()[0]  # then the paths of the files it saved
    third = client.batches.retrieve(third_id)
    assert third.status == "completed" and third.model_extra["x_freight"]["resumed_from"] == second.id
    output, errors = read_jsonl(client, third.output_file_id), read_jsonl(client, third.error_file_id)
    assert not errors and third.error_file_id is None
    assert sorted(x["custom_id"] for x in output) == expected  # every line once
    assert all(x["response"]["status_code"] == 200 for x in output)
    by_id = {x["custom_id"]: x for x in output}
    assert all(by_id[x["custom_id"]] == x for x in ran)  # the first batch's results, kept
    saved = (tmp_path / f"{third.id}.output.jsonl").read_text().splitlines()
    assert len(saved) == N and str(tmp_path / f"{third.id}.output.jsonl") in done.stdout

    chain = third.model_extra["x_freight"]["chain_usage"]
    batches = [client.batches.retrieve(b) for b in (first.id, second.id, third.id)]
    assert chain["batches"] == 3
    assert chain["request_completed"] == sum(b.request_counts.completed for b in batches) == N
    assert chain["output_tokens"] == sum(b.usage.output_tokens for b in batches) == TOKENS * N
    assert third.usage.output_tokens == TOKENS * third.request_counts.completed  # its own only

    with pytest.raises(openai.BadRequestError) as refused:  # every line has its result now
        client.batches.create(
            input_file_id=first.input_file_id, endpoint=CHAT, completion_window="24h",
            extra_body={"resume_from": third.id},
        )  # fmt: skip
    assert refused.value.code == "nothing_to_resume"
