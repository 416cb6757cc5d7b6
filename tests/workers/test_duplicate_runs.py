"""Duplicate lines on the real engine (issue #51 part 3): files validated as a batch's are, run by
an engine worker's pack path on the session's vLLM engine (the demo model), their units recorded.
Each line gets its own result line; the engine runs each distinct deterministic request once (its
own count of finished requests); the copies are marked in x_freight and cost nothing; tenants
meet only in global prefix-cache sharing. The loop's logic alone: test_duplicate_lines.py."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from api.services.tenants import create_tenant
from storage.models import WorkUnit
from storage.runtime import Runtime
from storage.settings import Settings
from tests.conftest import now
from tests.factories import batch_units, chat_line, validated_batch, wait_units_done
from workers.engine import Engine
from workers.pack_feed import PackOrder

pytestmark = pytest.mark.parametrize(
    "database_url", ["sqlite"], indirect=True
)  # the engine's, not the database's


def results(rt: Runtime, units: list[WorkUnit]) -> dict[str, dict]:
    """Every recorded output line of the units by custom_id; a custom_id twice fails."""
    lines: dict[str, dict] = {}
    for unit in units:
        for key in (unit.output_key, unit.error_key):
            if key is None:
                continue
            with rt.store.open(key) as f:
                for raw in f.read().splitlines():
                    line = json.loads(raw)
                    assert line["custom_id"] not in lines, line["custom_id"]
                    lines[line["custom_id"]] = line
    return lines


def greedy(custom_id: str, text: str, **body: Any) -> dict:
    return chat_line(custom_id, text, max_tokens=8, min_tokens=8, temperature=0, **body)


def answer(line: dict) -> str:
    return line["response"]["body"]["choices"][0]["message"]["content"]


def test_a_file_with_duplicates_runs_each_distinct_request_once(
    settings: Settings, vllm_engine: Engine, runner_of
) -> None:
    """Thirteen lines, eight distinct runs: four identical greedy lines, two more, two with one
    seed, two sampled without one and two seeded asking n=2 (each run; vLLM refuses n=2 greedy), and a line of its own. Units of
    two lines, so one unit holds only copies: it is charged no engine time and no cost."""
    rt = Runtime(replace(settings, unit_size=2))
    try:
        runner = runner_of(rt, vllm_engine)
        tenant, _ = create_tenant(rt.db, "dups", now())
        lines = [
            *(greedy(f"four-{i}", "Tell me about rivers") for i in range(4)),
            *(greedy(f"two-{i}", "Name a mountain") for i in range(2)),
            *(
                chat_line(f"seed-{i}", "Pick a colour", max_tokens=8, min_tokens=8, temperature=0.9, seed=3)
                for i in range(2)
            ),
            *(
                chat_line(f"free-{i}", "Pick a number", max_tokens=8, min_tokens=8, temperature=0.9)
                for i in range(2)
            ),
            *(
                chat_line(
                    f"many-{i}", "Say two things", max_tokens=8, min_tokens=8, temperature=0.9, seed=3, n=2
                )
                for i in range(2)
            ),
            greedy("alone", "Something else entirely"),
        ]
        batch_id = validated_batch(rt, tenant.id, lines)
        ids = [u.id for u in batch_units(rt, batch_id)]
        before = vllm_engine.stats.finished
        assert runner.run_pack(PackOrder("pack-dups", ids)) == len(ids) == 7
        units = wait_units_done(rt, runner, batch_id)
        assert vllm_engine.stats.finished - before == 8  # each distinct deterministic request once

        out = results(rt, units)
        assert sorted(out) == sorted(x["custom_id"] for x in lines)  # every line once
        assert all(line["response"]["status_code"] == 200 for line in out.values())
        for field in ("id",):
            assert len({line[field] for line in out.values()}) == 13
        assert len({line["response"]["request_id"] for line in out.values()}) == 13
        assert len({line["response"]["body"]["id"] for line in out.values()}) == 13
        copies = {cid for cid, line in out.items() if "x_freight" in line["response"]["body"]}
        assert len(copies) == 5  # three of the four, one of two, one of the seeded pair
        assert {out[c]["response"]["body"]["x_freight"]["copy"] for c in copies} == {"shared_run"}
        for group, n in (("four", 4), ("two", 2), ("seed", 2)):
            members = [f"{group}-{i}" for i in range(n)]
            assert len([m for m in members if m in copies]) == n - 1
            assert len({answer(out[m]) for m in members}) == 1  # the same answer on every line
            assert len({json.dumps(out[m]["response"]["body"]["usage"]) for m in members}) == 1
            assert out[members[0]]["response"]["body"]["usage"]["completion_tokens"] == 8
        assert not copies & {"free-0", "free-1", "many-0", "many-1", "alone"}
        assert len(out["many-0"]["response"]["body"]["choices"]) == 2

        # usage: every line's answer, as its result line shows it; cost: the runs' engine time only
        body_tokens = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in out.values())
        assert sum(u.completion_tokens for u in units) == body_tokens == 11 * 8 + 2 * 16
        assert sum(u.completed for u in units) == 13
        only_copies = [u for u in units if {r for r in results(rt, [u])} <= copies]
        assert only_copies, [sorted(results(rt, [u])) for u in units]
        for unit in only_copies:
            assert (unit.engine_seconds, unit.cost_micros) == (0.0, 0)
            assert unit.completion_tokens == 2 * 8
        ran = [u for u in units if u not in only_copies]
        assert all(u.engine_seconds > 0 for u in ran)  # cost is engine seconds x the price (none here)
    finally:
        rt.db.dispose()


@pytest.mark.parametrize("sharing", ["tenant", "global"])
def test_jobs_of_one_tenant_share_runs_and_tenants_only_in_global_mode(
    settings: Settings, vllm_engine: Engine, runner_of, sharing: str
) -> None:
    """Alpha's two jobs and beta's one hold the same greedy line, in one pack: alpha's jobs share
    a run in either mode; beta's line shares it only when every tenant shares the prefix cache."""
    rt = Runtime(replace(settings, prefix_cache_sharing=sharing))
    try:
        runner = runner_of(rt, vllm_engine)
        alpha, _ = create_tenant(rt.db, "alpha", now())
        beta, _ = create_tenant(rt.db, "beta", now())
        line = [greedy("same", f"Shared question in {sharing} mode")]
        batches = [validated_batch(rt, t.id, line) for t in (alpha, alpha, beta)]
        ids = [u.id for b in batches for u in batch_units(rt, b)]
        before = vllm_engine.stats.finished
        assert runner.run_pack(PackOrder(f"pack-{sharing}", ids)) == 3
        outs = [results(rt, wait_units_done(rt, runner, b))["same"] for b in batches]
        assert vllm_engine.stats.finished - before == (2 if sharing == "tenant" else 1)
        marked = ["x_freight" in o["response"]["body"] for o in outs]
        assert marked[:2].count(True) == 1  # alpha's second job copied its first's run
        assert marked[2] is (sharing == "global")
        assert len({answer(o) for o in outs[:2]}) == 1
        if sharing == "global":
            assert len({answer(o) for o in outs}) == 1
    finally:
        rt.db.dispose()
