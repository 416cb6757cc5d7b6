"""bench/against_limit.py and bench/scheduler.py's limit plumbing (pure): Freight over the limit
repeat by repeat, the targets (0.97 everywhere, 1.2 on dups) with their spread, the engine files
per repeat and warm-up, and the engine worker's CPU per step beside vLLM's."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import against_limit as al
from bench import scheduler as bs
from bench import workloads as wl


def _runs(*rates: float | None) -> dict:
    """A combined cell (bench.scheduler.combine_repeats) of runs at these output rates."""
    runs = [{"output_tok_s": r, "errors": 0} if r is not None else {"error": "boom"} for r in rates]
    return bs.combine_repeats(runs)


def test_limit_targets_cover_every_workload_and_mode() -> None:
    targets = al.limit_targets(bs.WORKLOADS, bs.KV_CONFIGS)
    assert targets["dups.freight_over_limit"] == (">=", 1.2)
    assert targets["blend_tight_kv.freight_over_limit"] == (">=", 0.97)
    for name in ("long_prefix", "request_rate", "unique", "shared_prefix", "system_prompts"):
        assert targets[f"{name}.freight_over_limit"] == (">=", 0.97)
    assert targets["multi_job.freight_tenant_over_limit"] == (">=", 0.97)  # both cache modes
    for field in ("freight_single_job", "freight", "freight_per_tenant_1job", "freight_per_tenant"):
        assert targets[f"{bs.MJSP}.{field}_over_limit"] == (">=", 0.97)
    assert set(targets) <= set(bs.TARGETS)


def test_freight_over_the_limit_is_paired_repeat_by_repeat_and_a_failed_repeat_drops_out() -> None:
    results = {
        "dups": {"default": {"engine_sorted": _runs(100.0, 80.0, 90.0), "freight": _runs(130.0, None, 99.0)}},
        bs.MJSP: {
            "tight": {
                "engine_sorted": _runs(100.0, 100.0),
                "engine_sorted_tenant": _runs(50.0, 40.0),
                "freight": _runs(96.0, 99.0),
                "freight_per_tenant": _runs(49.0, 40.0),
            }
        },
    }
    lists = al.limit_ratio_lists(results)
    assert lists["dups"]["freight_over_limit"] == pytest.approx([1.3, 1.1])
    assert lists[f"{bs.MJSP}_tight_kv"]["freight_over_limit"] == pytest.approx([0.96, 0.99])
    assert lists[f"{bs.MJSP}_tight_kv"]["freight_per_tenant_over_limit"] == pytest.approx([0.98, 1.0])
    assert "freight_single_job_over_limit" not in lists[f"{bs.MJSP}_tight_kv"]  # not measured
    ratios = bs.compute_ratios(results, lists)
    targets = bs.evaluate_targets(ratios, lists)
    cell = results["dups"]["default"]["engine_sorted"]
    assert cell["output_tok_s"] == 90.0  # the median run
    assert cell["spread"]["output_tok_s"] == {
        "repeats": 3, "min": 80.0, "median": 90.0, "max": 100.0, "values": [100.0, 80.0, 90.0],
    }  # fmt: skip
    assert results["dups"]["default"]["freight"]["spread"]["output_tok_s"]["repeats"] == 2  # one failed
    dups = targets["dups.freight_over_limit"]
    assert dups["value"] == pytest.approx(1.2)  # the median of 1.3 and 1.1
    assert dups["pass"] is True
    assert dups["spread"]["repeats"] == 2
    assert (dups["spread"]["min"], dups["spread"]["max"]) == pytest.approx((1.1, 1.3))
    tenant = targets[f"{bs.MJSP}_tight_kv.freight_per_tenant_over_limit"]
    assert tenant["value"] == pytest.approx(0.99) and tenant["pass"] is True
    assert targets[f"{bs.MJSP}_tight_kv.freight_over_limit"]["pass"] is True  # 0.975
    assert targets["blend.freight_over_limit"]["pass"] is None  # not run: n/a, never a pass


def test_a_limit_target_fails_below_its_bound() -> None:
    results = {"long_prefix": {"default": {"engine_sorted": _runs(100.0), "freight": _runs(96.0)}}}
    lists = al.limit_ratio_lists(results)
    targets = bs.evaluate_targets(bs.compute_ratios(results, lists), lists)
    assert targets["long_prefix.freight_over_limit"]["value"] == pytest.approx(0.96)
    assert targets["long_prefix.freight_over_limit"]["pass"] is False
    dups = {"dups": {"default": {"engine_sorted": _runs(100.0), "freight": _runs(119.0)}}}
    lists = al.limit_ratio_lists(dups)
    assert (
        bs.evaluate_targets(bs.compute_ratios(dups, lists), lists)["dups.freight_over_limit"]["pass"] is False
    )


def test_unique_and_multi_job_are_against_the_engine_on_the_lines_as_written() -> None:
    results = {
        "multi_job": {
            "default": {
                "engine": _runs(10.0, 20.0),
                "freight": _runs(9.8, 19.0),
                "freight_tenant": _runs(9.0, 20.0),
            }
        }
    }
    lists = al.limit_ratio_lists(results)["multi_job"]
    assert lists["freight_over_limit"] == pytest.approx([0.98, 0.95])
    assert lists["freight_tenant_over_limit"] == pytest.approx([0.9, 1.0])


def test_engine_files_interleave_repeats_and_warm_up_each_shape(tmp_path: Path) -> None:
    def paths(stem: str) -> list[Path]:
        return [tmp_path / f"{stem}.jsonl", tmp_path / f"{stem}-r1.jsonl", tmp_path / f"{stem}-warm.jsonl"]

    all_files = {"dups": paths("dups"), bs.MJSP: paths("mjsp")}
    sorted_files = {n: [p.with_name(p.stem + "-sorted.jsonl") for p in v] for n, v in all_files.items()}
    tenant = {bs.MJSP: [p.with_name(p.stem + "-tenant-sorted.jsonl") for p in all_files[bs.MJSP]]}
    files, warmups = bs.engine_repeat_files(
        ["dups", bs.MJSP], ["engine", "engine_sorted"], all_files, sorted_files, tenant
    )
    assert list(files) == [
        "dups#r0", "dups+sorted#r0", "dups#r1", "dups+sorted#r1",
        f"{bs.MJSP}#r0", f"{bs.MJSP}+sorted#r0", f"{bs.MJSP}+tenant-sorted#r0",
        f"{bs.MJSP}#r1", f"{bs.MJSP}+sorted#r1", f"{bs.MJSP}+tenant-sorted#r1",
    ]  # fmt: skip
    assert files["dups+sorted#r1"].name == "dups-r1-sorted.jsonl"
    assert not any("warm" in p.name for p in files.values())  # warm-ups are never measured
    assert [p.name for p in warmups] == ["dups-warm-sorted.jsonl", "mjsp-warm-tenant-sorted.jsonl"]
    only_sorted, _ = bs.engine_repeat_files(["dups"], ["engine_sorted"], all_files, sorted_files, tenant)
    assert list(only_sorted) == ["dups+sorted#r0", "dups+sorted#r1"]

    cells = {key: {"output_tok_s": float(n), "errors": 0} for n, key in enumerate(files, 1)}
    by_system = bs.engine_cells_by_system(cells)
    mjsp = by_system[bs.MJSP]
    assert set(mjsp) == {"engine", "engine_sorted", "engine_sorted_tenant"}
    assert [r["output_tok_s"] for r in mjsp["engine_sorted_tenant"]["repeats"]] == [7.0, 10.0]
    assert [r["output_tok_s"] for r in by_system["dups"]["engine"]["repeats"]] == [1.0, 3.0]


def test_tenant_sorted_lines_are_grouped_by_tenant_then_prompt_and_salted(
    demo_model: Path, tmp_path: Path
) -> None:
    tokenizer = wl.load_tokenizer(demo_model)
    path = tmp_path / "mjsp.jsonl"
    wl.write_jsonl(path, wl.multi_job_shared_prefix_lines(tokenizer, scale=0.05))
    out = bs.tenant_sorted_file(tokenizer, path)
    lines = wl.read_jsonl(out)
    assert sorted(x["custom_id"] for x in lines) == sorted(x["custom_id"] for x in wl.read_jsonl(path))
    salts = [x["body"]["cache_salt"] for x in lines]
    assert salts == sorted(salts) and set(salts) == set(wl.TENANTS)
    pieces = wl.split_multi_job_shared_prefix(path, tmp_path / "jobs")
    tenant_of = {x["custom_id"]: p["tenant"] for p in pieces for x in wl.read_jsonl(Path(p["path"]))}
    assert all(tenant_of[x["custom_id"]] == x["body"]["cache_salt"] for x in lines)
    for tenant in wl.TENANTS:
        ids = [wl.prompt_token_ids(tokenizer, x) for x in lines if x["body"]["cache_salt"] == tenant]
        assert ids == sorted(ids)


def test_engine_worker_cpu_per_step_beside_vllms() -> None:
    freight = {
        "requests": 100,
        "engine_steps": 50.0,
        "cpu_s": {"api": 1.0, "control": 2.0, "engine-0": 6.0, "engine-0/children": 0.5, "redis": 0.1},
    }
    engine = {"requests": 100, "steps": 40, "cpu_s": {"engine": 5.0, "engine/children": 0.0}}
    results = {"dups": {"default": {"freight": freight, "engine_sorted": engine}}}
    figures = al.engine_cpu(results)["dups"]["freight"]
    assert figures["engine_worker"]["cpu_ms_per_step"] == pytest.approx(130.0)  # 6.5 s / 50 steps
    assert figures["engine_worker"]["front_end_cpu_s"] == pytest.approx(6.0)
    assert figures["engine_sorted"]["cpu_ms_per_step"] == pytest.approx(125.0)
    assert figures["freight_own_cpu_ms_per_step"] == pytest.approx(5.0)
    assert figures["freight_own_cpu_ms_per_request"] == pytest.approx(15.0)  # 65 - 50 ms
    assert al.engine_cpu({"dups": {"default": {"freight": {"error": "x"}, "engine_sorted": engine}}}) == {}


def test_the_limit_is_the_faster_core_placement_file_by_file() -> None:
    by_core = {
        "inline": {"dups+sorted#r0": {"output_tok_s": 100.0}, "dups+sorted#r1": {"output_tok_s": 50.0}},
        "process": {"dups+sorted#r0": {"output_tok_s": 90.0}, "dups+sorted#r1": {"error": "exit 1"}},
    }
    cells = bs.faster_placement(by_core)
    assert list(cells) == ["dups+sorted#r0", "dups+sorted#r1"]
    assert cells["dups+sorted#r0"]["placement"] == "inline"
    assert cells["dups+sorted#r0"]["placements_output_tok_s"] == {"inline": 100.0, "process": 90.0}
    assert cells["dups+sorted#r1"]["placement"] == "inline"  # a failed run never wins
    by_core["process"]["dups+sorted#r1"] = {"output_tok_s": 400.0}
    assert bs.faster_placement(by_core)["dups+sorted#r1"]["placement"] == "process"
    failed = bs.faster_placement({"inline": {"k#r0": {"error": "a"}}, "process": {"k#r0": {"error": "b"}}})
    assert "error" in failed["k#r0"]
