"""bench/scheduler.py and bench/interleaved.py: ratios in both cache modes, two-sided targets (pure)."""

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
        "value": None, "bound": 0.95, "op": ">=", "min": 0.95, "pass": None, "spread": None,
    }  # fmt: skip
    assert "hit_rate_gap_points" in bs.table(results, ratios, targets)


def test_mjsp_tight_kv_holds_half_the_shared_prefixes() -> None:
    info = {"prompt_tokens_max": 846, "output_tokens_per_request": 8, "shared_prefix_tokens": 32_000}
    manifest = {"workloads": {n: info for n in ("unique", "shared_prefix", "system_prompts", bs.MJSP)}}
    plan = bs.kv_plan(manifest, kv_bytes_per_token=2048, block_size=32)
    assert plan["tight"][bs.MJSP]["tokens"] == 16_000
    assert plan["tight"]["shared_prefix"]["tokens"] > 32_000  # the others keep the running-batch rule


def test_multi_job_reports_both_cache_modes_and_the_isolations_cost() -> None:
    results = {
        "multi_job": {
            "default": {
                "freight_single_job": _cell(100.0),
                "freight": _cell(96.0),
                "freight_tenant": _cell(72.0),
            }
        },
        bs.MJSP: {"tight": {"freight": _cell(150.0), "freight_per_tenant": _cell(100.0)}},
    }
    # paired runs replace the ratios of the median runs with the medians of the per-repeat ones
    paired = {"multi_job": {"tenant_over_global": [0.7, 0.8, 0.9], "freight_tenant_over_single_job": []}}
    ratios = bs.compute_ratios(results, paired, {})
    assert ratios["multi_job"]["freight_over_single_job"] == pytest.approx(0.96)
    assert ratios["multi_job"]["freight_tenant_over_single_job"] == pytest.approx(0.72)
    assert ratios["multi_job"]["tenant_over_global"] == pytest.approx(0.8)
    assert ratios[f"{bs.MJSP}_tight_kv"]["tenant_over_global"] == pytest.approx(100 / 150)
    targets = bs.evaluate_targets(ratios)
    default_mode = targets["multi_job.freight_tenant_over_single_job"]
    assert (default_mode["op"], default_mode["bound"], default_mode["pass"]) == (">=", 0.95, False)
    assert targets["multi_job.freight_over_single_job"]["pass"] is True
    assert "tenant_over_global" in bs.table(results, ratios, targets)


class _Stack:
    """A stand-in for a warm Freight stack in run_interleaved's rotation (no engine, no vLLM): its
    output rate is set by its cache mode, and it records the jobs each repeat gives it."""

    def __init__(self, role: str, sharing: str, ran: list[tuple[str, int]]) -> None:
        self.role, self.sharing, self.ran = role, sharing, ran

    def start(self) -> _Stack:
        return self

    def settings(self) -> dict:
        return {"FREIGHT_PREFIX_CACHE_SHARING": self.sharing}

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def stop(self) -> None: ...

    def run_jobs(self, jobs: list) -> dict:
        self.ran.append((self.role, len(jobs)))
        rate = {"single": 100.0, "multi": 95.0, "multi_tenant": 76.0}[self.role]
        return {"output_tok_s": rate, "wall_s": 1.0}


def test_interleaved_multi_job_runs_a_tenant_mode_stack_beside_the_global_one(tmp_path) -> None:
    from bench.interleaved import run_interleaved

    files = []
    for r in range(2):
        path = tmp_path / f"unique-r{r}.jsonl"
        path.write_text("".join(f'{{"custom_id": "r{r}-{i}"}}\n' for i in range(40)))
        files.append(path)
    ran: list[tuple[str, int]] = []
    sharing = {"single": "tenant", "multi": "global", "multi_tenant": "tenant"}
    cells, ratios, settings = run_interleaved(
        names=["unique", "multi_job"],
        systems=["freight"],
        unique_files=files,
        warm=files[0],
        kv_bytes=None,
        engine_argv=[],
        stack_factory=lambda role, warm: _Stack(role, sharing[role], ran),
        run_dir=tmp_path / "run",
        with_rates=lambda cell: cell,
        combine=lambda runs: runs[len(runs) // 2],
        log=lambda message: None,
    )
    # every repeat runs the three stacks; the two multi-job stacks get the same 20 batches
    assert sorted(ran) == sorted([("single", 1), ("multi", 20), ("multi_tenant", 20)] * 2)
    assert {role: s["FREIGHT_PREFIX_CACHE_SHARING"] for role, s in settings.items()} == sharing
    assert cells["multi_job"]["freight"]["cache_sharing"] == "global"
    assert cells["multi_job"]["freight_tenant"]["cache_sharing"] == "tenant"
    assert ratios["multi_job"]["tenant_over_global"] == pytest.approx([0.8, 0.8])
    assert ratios["multi_job"]["freight_tenant_over_single_job"] == pytest.approx([0.76, 0.76])
    assert ratios["multi_job"]["freight_over_single_job"] == pytest.approx([0.95, 0.95])
