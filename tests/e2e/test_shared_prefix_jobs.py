"""Jobs on the same long prompts meet in the prefix cache (issue #24), on the real stack: the
engine worker's feed merges a job that arrives while another runs into the running sweep
(scheduler/feed_order.py), so its prompts are not computed once more per job; and an idle worker
waits for jobs whose files were uploaded by the time the first one's pack was made (the pack says
more may come: workers/arrivals.py), so jobs submitted together start as one sweep.

Each test runs in both cache modes (FREIGHT_PREFIX_CACHE_SHARING, issue #49 part 8), one stack
each: `global`, where the jobs of three tenants meet, and the default, `tenant`, where the jobs
that meet are one tenant's (its own cache domain and vLLM cache_salt) and three tenants' jobs on
the same prompts share nothing: each tenant computes every prompt once.

The KV cache holds about 3,000 tokens and the 16 few-shot prompts about 5,000, so a pass over all
of them never stays cached: a job that ran after another, as a first-in-first-out feed runs it,
computes every prompt again."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.batch_client import CHAT, upload
from tests.e2e.conftest import LiveStack, keep_logs, start_live, wait_final

pytestmark = pytest.mark.stack

TENANTS = ("alpha", "beta", "gamma")
PROMPTS = 16
ITEMS = 4  # per prompt, per tenant
KV_TOKENS = 3072
KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4  # K and V, 4 layers, 2 KV heads of 64, float32 (pinned below)
# longer than two jobs' creation, validation and packing take on a loaded 2-core machine, so the
# test cannot miss the window (production: 2 s)
MERGE_SECONDS = 5.0


@pytest.fixture(scope="module", params=("global", "tenant"))
def shared(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, demo_model: Path
) -> Iterator[LiveStack]:
    """The module's stack in one cache mode; pytest runs every test on the first mode's stack and
    stops it before it starts the second's."""
    sharing = request.param
    overrides = {
        "FREIGHT_ENGINE_DTYPE": "float32",  # the cache's size in tokens is the same on every CPU
        "FREIGHT_ENGINE_KV_CACHE_GIB": str(KV_TOKENS * KV_BYTES_PER_TOKEN / 2**30),
        "FREIGHT_ENGINE_BLOCK_SIZE": "32",
        "FREIGHT_ENGINE_MAX_MODEL_LEN": "1024",
        "FREIGHT_HEARTBEAT_SECONDS": "1",
        "FREIGHT_PREFIX_CACHE_SHARING": sharing,
        "FREIGHT_FEED_MERGE_SECONDS": str(MERGE_SECONDS),
    }
    live_stack, stack = start_live(
        tmp_path_factory.mktemp(f"shared-{sharing}"), demo_model, overrides, TENANTS
    )
    try:
        yield live_stack
    finally:
        keep_logs(stack, f"shared-prefix-{sharing}")


def senders(live: LiveStack) -> dict[str, str]:
    """Who sends each of the three jobs that are to meet in one cache (job name -> tenant): each
    tenant its own in global mode; in tenant mode one tenant all three, its cache being its own."""
    if live.stack.settings.prefix_cache_sharing == "global":
        return {name: name for name in TENANTS}
    return dict.fromkeys(TENANTS, "alpha")


def engine_log(live: LiveStack, text: str) -> list[str]:
    """The engine worker's log lines holding ``text`` ("engine starting:" once an idle engine that
    gathered packs starts; " units, " for each pack it takes)."""
    log = live.stack.run_dir / "engine-demo.log"
    return [line for line in log.read_text(errors="replace").splitlines() if text in line]


def wait_for_line(live: LiveStack, text: str, seen: int) -> list[str]:
    """The lines holding ``text`` once there are more than ``seen``."""
    deadline = time.monotonic() + 60
    while len(lines := engine_log(live, text)) <= seen:
        assert time.monotonic() < deadline, f"no new {text!r} line in the engine log"
        time.sleep(0.05)
    return lines


def few_shot(prompt: int) -> str:
    """About 300 tokens, different from the first word on."""
    examples = " ".join(
        f"example {prompt}.{j}: label {j % 5} because clause {(7 * j + prompt) % 13}." for j in range(24)
    )
    return f"Task {prompt}. Classify the item as the examples do. {examples}"


def job(tenant: str, first_prompt: int = 0, max_tokens: int = 64) -> list[dict]:
    lines = [
        {
            "custom_id": f"{tenant}-{p}-{i}",
            "method": "POST",
            "url": CHAT,
            "body": {
                "model": "demo",
                "max_tokens": max_tokens,
                "min_tokens": max_tokens,  # 64: the first job still runs when the others arrive
                "messages": [
                    {"role": "system", "content": few_shot(first_prompt + p)},
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


def test_jobs_sent_while_one_runs_meet_it_in_the_prefix_cache(shared: LiveStack) -> None:
    """Three jobs on the same prompts, the later two sent while the first runs, reach the cache-hit
    rate of one job of all their lines: three tenants' jobs in global mode, one tenant's in the
    default mode."""
    jobs = {name: job(name) for name in TENANTS}  # the same prompts, items of their own
    alpha = shared.client("alpha")
    # the limit to compare with: every line as one job, prefix-sorted as a whole
    together = [line for lines in jobs.values() for line in lines]
    one = alpha.batches.create(input_file_id=upload(alpha, together), endpoint=CHAT, completion_window="24h")
    single = wait_final(alpha, one.id, timeout=300)
    assert single.status == "completed" and single.request_counts.completed == len(together)

    # the same lines as three jobs sharing a cache, the later two sent while the first one runs
    batches = {}
    starts = len(engine_log(shared, "engine starting:"))
    for name, tenant in senders(shared).items():
        client = shared.client(tenant)
        batch = client.batches.create(
            input_file_id=upload(client, jobs[name]), endpoint=CHAT, completion_window="24h"
        )
        batches[name] = (client, batch.id)
        if name == "alpha":  # running, not just taken (nothing else was on its way)
            wait_for_line(shared, "engine starting:", starts)
        else:
            time.sleep(1.0)
    finals = [wait_final(client, batch_id, timeout=300) for client, batch_id in batches.values()]
    assert all(b.status == "completed" and b.request_counts.completed == PROMPTS * ITEMS for b in finals)
    assert finals[0].completed_at >= finals[1].in_progress_at  # they did overlap

    one_job, three_jobs = hit_rate([single]), hit_rate(finals)
    print(f"sent while one runs: one job {one_job:.3f}, three jobs {three_jobs:.3f}")
    assert one_job > 0.7, one_job  # the prompts are shared: most prompt tokens come from the cache
    # a first-in-first-out feed computes each job's 16 prompts again: of a prompt's 12 lines 9 hit
    # instead of 11, about 0.82x one job's rate; merged, 0.92-0.97x was measured in both modes
    # (0.780-0.823 against 0.852): the bound lies between, off the measured edge
    assert three_jobs >= 0.87 * one_job, (three_jobs, one_job)


def test_jobs_created_a_moment_apart_start_as_one_sweep(shared: LiveStack) -> None:
    """The three files are uploaded first and the first job's pack is made before the other two
    batches exist: it says more may come all the same (their files wait for their batches), the
    idle worker waits for them, and the three jobs run as one sweep: the cache-hit rate of one job
    of all their lines. (Not waiting, the first job fills the engine alone, 2 x 32 sequences, all
    of its 64 requests, and the others' prompts, all behind its cursor, wait for a second sweep
    after the small cache has dropped them.)"""
    alpha = shared.client("alpha")
    # the limit: one job of all the lines (prompts of their own: nothing cached from other tests)
    together = [line for tenant in TENANTS for line in job(tenant, first_prompt=100, max_tokens=4)]
    one = alpha.batches.create(input_file_id=upload(alpha, together), endpoint=CHAT, completion_window="24h")
    single = wait_final(alpha, one.id, timeout=300)
    assert single.status == "completed" and single.request_counts.completed == len(together)

    # the same shape on fresh prompts (the single job's leave nothing for them), as three jobs
    # sharing a cache (three tenants' in global mode, alpha's in tenant mode)
    clients = {name: shared.client(tenant) for name, tenant in senders(shared).items()}
    files = {t: upload(clients[t], job(t, first_prompt=200, max_tokens=4)) for t in TENANTS}  # uploaded first
    packs = len(engine_log(shared, " units, "))
    batches = {}
    for name in TENANTS:
        created = clients[name].batches.create(
            input_file_id=files[name], endpoint=CHAT, completion_window="24h"
        )
        batches[name] = created.id
        if name == "alpha":  # the others are made once its pack is taken
            wait_for_line(shared, " units, ", packs)
    finals = [wait_final(clients[t], batches[t], timeout=300) for t in TENANTS]
    assert all(b.status == "completed" and b.request_counts.completed == PROMPTS * ITEMS for b in finals)
    first = engine_log(shared, " units, ")[packs]
    assert "more may come" in first, first  # the files waiting for their batches held it

    one_job, three_jobs = hit_rate([single]), hit_rate(finals)
    print(f"created a moment apart: one job {one_job:.3f}, three jobs {three_jobs:.3f}")
    assert one_job > 0.7, one_job
    assert three_jobs >= 0.97 * one_job, (three_jobs, one_job)  # one sweep: as one job


def test_jobs_of_different_tenants_meet_only_in_the_global_mode(shared: LiveStack) -> None:
    """Three tenants' jobs on the same prompts, created together: in global mode they share the
    prompts' cache entries, well above the hit rate of one tenant's job alone; in the default mode
    each tenant computes every prompt once, as if it ran alone (its requests carry its own vLLM
    cache_salt), and its hit rate is that one job's."""
    clients = {tenant: shared.client(tenant) for tenant in TENANTS}
    # the limit in tenant mode: one tenant's job alone, on prompts of its own
    alone = clients["alpha"].batches.create(
        input_file_id=upload(clients["alpha"], job("alpha", first_prompt=300, max_tokens=4)),
        endpoint=CHAT,
        completion_window="24h",
    )
    single = wait_final(clients["alpha"], alone.id, timeout=300)
    assert single.status == "completed" and single.request_counts.completed == PROMPTS * ITEMS

    # the three tenants' jobs on fresh prompts, the same for each of them
    files = {t: upload(clients[t], job(t, first_prompt=400, max_tokens=4)) for t in TENANTS}
    batches = {
        t: clients[t].batches.create(input_file_id=files[t], endpoint=CHAT, completion_window="24h").id
        for t in TENANTS
    }
    finals = {t: wait_final(clients[t], batches[t], timeout=300) for t in TENANTS}
    assert all(
        b.status == "completed" and b.request_counts.completed == PROMPTS * ITEMS for b in finals.values()
    )

    one_tenant, three_tenants = hit_rate([single]), hit_rate(list(finals.values()))
    print(f"one tenant's job alone {one_tenant:.3f}, three tenants' jobs {three_tenants:.3f}")
    assert one_tenant > 0.6, one_tenant  # its own 4 items of each prompt: 3 of them read it cached
    if shared.stack.settings.prefix_cache_sharing == "global":
        assert three_tenants >= 1.1 * one_tenant, (three_tenants, one_tenant)  # 11 of 12 items cached
    else:  # each tenant's job as if alone: nothing read from another's entries
        for tenant, batch in finals.items():
            assert abs(hit_rate([batch]) - one_tenant) <= 0.02, (tenant, hit_rate([batch]), one_tenant)
