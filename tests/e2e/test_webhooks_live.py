"""Webhooks on the live stack: the control worker's webhook role delivers, signed, the events of a
batch the engine ran to completion and of one that failed validation, to a real receiver on
127.0.0.1; the batch's delivery log says so. Nothing is called directly: the finalize and validate
tasks send the deliveries after their commits."""

from __future__ import annotations

import io
import json

import httpx
import pytest

from tests import factories, webhook_receiver
from tests.e2e.conftest import wait_final
from tests.webhook_receiver import verify

pytestmark = pytest.mark.stack


def test_the_live_stack_delivers_signed_events(live):
    receiver = webhook_receiver.start()
    try:
        api = httpx.Client(base_url=live.base_url, headers={"Authorization": f"Bearer {live.keys['beta']}"})
        hook = api.post(
            "/webhooks", json={"url": receiver.url("/beta"), "events": ["batch.completed", "batch.failed"]}
        )
        assert hook.status_code == 200, hook.text
        secret = hook.json()["secret"]
        client = live.client("beta")
        lines = [factories.chat_line(f"r{i}", f"hello {i}", max_tokens=4) for i in range(3)]
        good = client.files.create(file=("w.jsonl", io.BytesIO(factories.jsonl(lines))), purpose="batch").id
        bad = client.files.create(file=("bad.jsonl", io.BytesIO(b'{"custom_id": 1}\n')), purpose="batch").id
        done = client.batches.create(
            input_file_id=good, endpoint="/v1/chat/completions", completion_window="24h"
        )
        failed = client.batches.create(
            input_file_id=bad, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert wait_final(client, done.id).status == "completed"
        assert wait_final(client, failed.id).status == "failed"
        receiver.wait_for(lambda: len(receiver.at("/beta")) == 2, timeout=30)
        events = {}
        for request in receiver.at("/beta"):
            assert verify(secret, request.headers, request.body)
            event = json.loads(request.body)
            events[event["data"]["id"]] = event["type"]
        assert events == {done.id: "batch.completed", failed.id: "batch.failed"}
        # the receiver has the event before the worker records its answer
        log = f"/batches/{done.id}/webhook_deliveries"
        receiver.wait_for(lambda: api.get(log).json()["data"][0]["status"] == "delivered", timeout=30)
        [entry] = api.get(log).json()["data"]
        assert (entry["status"], entry["attempts"], entry["last_status_code"]) == ("delivered", 1, 200)
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()
