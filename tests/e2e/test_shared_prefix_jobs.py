"""Jobs of several tenants on the same long prompts meet in the prefix cache (issue #24), on the real
stack: the engine worker's feed merges a job that arrives while another runs into the running
sweep (scheduler/feed_order.py), so its prompts are not computed once more per job.

The KV cache holds about 3,000 tokens and the 16 few-shot prompts about 5,000, so a pass over all
of them never stays cached: a job that ran after another, as a first-in-first-out feed runs it,
computes every prompt again."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import LiveStack, keep_logs, start_live, wait_final
from tests.e2e.test_batches import CHAT, upload

pytestmark = pytest.mark.stack

TENANTS = ("alpha", "beta", "gamma")
PROMPTS = 16
ITEMS = 4  # per prompt, per tenant
KV_TOKENS = 3072
KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4  # K and V, 4 layers, 2 KV heads of 64, float32 (pinned below)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[LiveStack]:
    overrides = {
        "FREIGHT_ENGINE_DTYPE": "float32",  # the cache's size in tokens is the same on every CPU
        "FREIGHT_ENGINE_KV_CACHE_GIB": str(KV_TOKENS * KV_BYTES_PER_TOKEN / 2**30),
        "FREIGHT_ENGINE_BLOCK_SIZE": "32",
        "FREIGHT_ENGINE_MAX_MODEL_LEN": "1024",
        "FREIGHT_HEARTBEAT_SECONDS": "1",
        "FREIGHT_PREFIX_CACHE_SHARING": "global",  # the tenants' jobs are to meet in one cache
    }
    live_stack, stack = start_live(tmp_path_factory.mktemp("shared"), demo_model, overrides, TENANTS)
    try:
        yield live_stack
    finally:
        keep_logs(stack, "shared-prefix")


def few_shot(prompt: int) -> str:
    """About 300 tokens, different from the first word on."""
    examples = " ".join(
        f"example {prompt}.{j}: label {j % 5} because clause {(7 * j + prompt) % 13}." for j in range(24)
    )
    return f"Task {prompt}. Classify the item as the examples do. {examples}"


def job(tenant: str) -> list[dict]:
    lines = [
        {
            "custom_id": f"{tenant}-{p}-{i}",
            "method": "POST",
            "url": CHAT,
            "body": {
                "model": "demo",
                "max_tokens": 64,
                "min_tokens": 64,  # long enough that the first job still runs when the others arrive
                "messages": [
                    {"role": "system", "content": few_shot(p)},
                    {"role": "user", "content": f"Item {tenant} {i}."},
                ],
            },
        }
        for p in range(PROMPTS)
        for i in range(ITEMS)
    ]
    random.Random(tenant).shuffle(lines)
    return lines


def hit_rate(finals: list) -> float:
    cached = sum(b.usage.input_tokens_details.cached_tokens for b in finals)
    return cached / sum(b.usage.input_tokens for b in finals)


def test_jobs_of_three_tenants_on_the_same_prompts_meet_in_the_prefix_cache(shared: LiveStack) -> None:
    jobs = {tenant: job(tenant) for tenant in TENANTS}
    alpha = shared.client("alpha")
    # the limit to compare with: every line as one job, prefix-sorted as a whole
    together = [line for lines in jobs.values() for line in lines]
    one = alpha.batches.create(input_file_id=upload(alpha, together), endpoint=CHAT, completion_window="24h")
    single = wait_final(alpha, one.id, timeout=300)
    assert single.status == "completed" and single.request_counts.completed == len(together)

    # the same lines as three tenants' jobs, the later two sent while the first one runs
    batches = {}
    for tenant in TENANTS:
        client = shared.client(tenant)
        batch = client.batches.create(
            input_file_id=upload(client, jobs[tenant]), endpoint=CHAT, completion_window="24h"
        )
        batches[tenant] = (client, batch.id)
        if tenant == "alpha":
            wait_final(client, batch.id, timeout=120, until=("in_progress", "failed"))
        else:
            time.sleep(1.0)
    finals = [wait_final(client, batch_id, timeout=300) for client, batch_id in batches.values()]
    assert all(b.status == "completed" and b.request_counts.completed == PROMPTS * ITEMS for b in finals)
    assert finals[0].completed_at >= finals[1].in_progress_at  # they did overlap

    one_job, three_jobs = hit_rate([single]), hit_rate(finals)
    assert one_job > 0.7, one_job  # the prompts are shared: most prompt tokens come from the cache
    assert three_jobs >= 0.9 * one_job, (three_jobs, one_job)
