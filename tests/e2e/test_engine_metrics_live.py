"""vLLM's own metrics of an engine worker (workers/engine_metrics.py) on the live stack, whose one
engine worker serves them at FREIGHT_ENGINE_METRICS_BIND: after a request and then a batch sharing
its long prefix, the worker's port shows the prefix-cache hits, the KV-cache usage, time to first
token and preemptions, every sample labelled with the worker's stable name."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.e2e.batch_client import CHAT, chat_line, upload
from tests.e2e.conftest import LiveStack, wait_final

pytestmark = pytest.mark.stack

# 700 words: several whole 128-token KV blocks the later requests can take from the prefix cache
SHARED = " ".join(f"Clause {i}: the shipment is insured against loss at sea and on land." for i in range(50))


def scrape(live: LiveStack) -> dict[str, list[Sample]]:
    """The worker's metrics port, by sample name."""
    url = f"http://{live.stack.settings.engine_metrics_bind}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    samples: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def total(samples: dict[str, list[Sample]], name: str) -> float:
    return sum(s.value for s in samples.get(name, []) if s.labels.get("model_name") == "demo")


def run(live: LiveStack, lines: list[dict]) -> None:
    client = live.client()
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h")
    final = wait_final(client, batch.id, timeout=180)
    assert final.status == "completed" and final.request_counts.completed == len(lines), final


def test_the_engine_worker_serves_vllms_metrics_under_its_name(live: LiveStack) -> None:
    label = f"engine-demo@{socket.gethostname()}"  # infra.processes starts it as engine-demo@%h
    before = scrape(live)
    # one request caches the prefix; the batch after it (same tenant, so the same cache salt) hits it
    run(live, [chat_line("prefix-0", f"{SHARED} Question 0: who pays?", max_tokens=8)])
    run(
        live,
        [chat_line(f"prefix-{i}", f"{SHARED} Question {i}: who pays?", max_tokens=8) for i in range(1, 7)],
    )
    after = scrape(live)

    every = [s for samples in after.values() for s in samples]
    assert every and all(s.labels.get("worker") == label for s in every)
    hits = total(after, "vllm:prefix_cache_hits_total") - total(before, "vllm:prefix_cache_hits_total")
    queries = total(after, "vllm:prefix_cache_queries_total") - total(
        before, "vllm:prefix_cache_queries_total"
    )
    # in tokens: each of the six later requests took at least one whole 128-token block from the cache
    assert hits >= 6 * 128 and queries >= hits, (hits, queries)
    [usage] = after["vllm:kv_cache_usage_perc"]
    assert usage.labels["model_name"] == "demo" and 0 <= usage.value <= 1
    ttft = total(after, "vllm:time_to_first_token_seconds_count")
    assert ttft - total(before, "vllm:time_to_first_token_seconds_count") >= 7
    assert total(after, "vllm:time_to_first_token_seconds_sum") > 0
    assert "vllm:num_preemptions_total" in after
