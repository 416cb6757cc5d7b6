"""bench/scheduler.py: multi_job_shared_prefix's ratios and the two-sided targets (pure)."""

from __future__ import annotations

import pytest

from bench import scheduler as bs


def _cell(rate: float, hit: float | None = None) -> dict:
    return {"output_tok_s": rate, "cache_hit_rate": hit}


def test_mjsp_ratios_and_targets() -> None:
    results = {
        bs.MJSP: {
            "tight": {
                "engine": _cell(50.0),
                "engine_sorted": _cell(100.0),
                "freight_single_job": _cell(95.0),
                "freight": _cell(92.0, hit=0.90),
                "freight_per_tenant": _cell(80.0),
                "freight_per_tenant_1job": _cell(100.0),
            }
        },
        "shared_prefix": {"tight": {"engine_sorted": _cell(10.0), "freight": _cell(9.5)}},
    }
    ratios = bs.compute_ratios(results, {}, {bs.MJSP: 0.93})
    entry = ratios[f"{bs.MJSP}_tight_kv"]
    assert entry["freight_over_single_job"] == pytest.approx(92 / 95)
    assert entry["hit_rate_gap_points"] == pytest.approx(3.0)
    assert entry["per_tenant_over_single_job_per_tenant"] == pytest.approx(0.8)
    assert entry["freight_over_engine_sorted"] == pytest.approx(0.95)
    assert entry["multi_job_over_engine_sorted"] == pytest.approx(0.92)
    assert entry["engine_sorted_over_engine"] == pytest.approx(2.0)
    assert ratios["shared_prefix_tight_kv"]["freight_over_engine_sorted"] == pytest.approx(0.95)
    targets = bs.evaluate_targets(ratios)
    gap = targets[f"{bs.MJSP}_tight_kv.hit_rate_gap_points"]
    assert (gap["op"], gap["bound"], gap["max"], gap["pass"]) == ("<=", 2.0, 2.0, False)
    assert targets[f"{bs.MJSP}_tight_kv.freight_over_single_job"]["pass"] is True
    assert targets[f"{bs.MJSP}_tight_kv.per_tenant_over_single_job_per_tenant"]["pass"] is False
    assert targets["shared_prefix_tight_kv.freight_over_engine_sorted"]["pass"] is True
    assert targets["unique.freight_over_engine"] == {
        "value": None, "bound": 0.95, "op": ">=", "min": 0.95, "pass": None,
    }  # fmt: skip
    assert "hit_rate_gap_points" in bs.table(results, ratios, targets)


def test_mjsp_tight_kv_holds_half_the_shared_prefixes() -> None:
    info = {"prompt_tokens_max": 846, "output_tokens_per_request": 8, "shared_prefix_tokens": 32_000}
    manifest = {"workloads": {n: info for n in ("unique", "shared_prefix", "system_prompts", bs.MJSP)}}
    plan = bs.kv_plan(manifest, kv_bytes_per_token=2048, block_size=32)
    assert plan["tight"][bs.MJSP]["tokens"] == 16_000
    assert plan["tight"]["shared_prefix"]["tokens"] > 32_000  # the others keep the running-batch rule
