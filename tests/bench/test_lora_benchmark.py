"""bench/lora.py's own parts: the workload, Freight's order, the jobs, the ratios and the untrained
adapters (which Freight's registration must take like the trained ones)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import lora
from bench import workloads as wl

NAMES = ["lora-alpha", "lora-beta", "lora-random-2"]


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> Any:
    return wl.load_tokenizer(demo_model)


def test_lines_are_seeded_per_adapter_on_a_few_templates(tokenizer: Any) -> None:
    first = lora.lines(tokenizer, NAMES, 12, seed=0)
    assert first == lora.lines(tokenizer, NAMES, 12, seed=0)
    assert first != lora.lines(tokenizer, NAMES, 12, seed=1)
    assert len(first) == 36 and len({line["custom_id"] for line in first}) == 36
    assert {n: sum(line["body"]["model"] == n for line in first) for n in NAMES} == dict.fromkeys(NAMES, 12)
    systems = {line["body"]["messages"][0]["content"] for line in first}
    assert 1 < len(systems) <= lora.TEMPLATES  # prompts share prefixes
    assert len({line["body"]["messages"][1]["content"] for line in first}) == 36
    bodies = [line["body"] for line in first]
    assert all(b["max_tokens"] == b["min_tokens"] == lora.OUTPUT_TOKENS and b["ignore_eos"] for b in bodies)
    assert all(b["temperature"] == 0 for b in bodies)
    assert [line["body"]["model"] for line in first] != sorted(
        line["body"]["model"] for line in first
    )  # mixed


def test_jobs_hold_every_line_once_across_tenants() -> None:
    items = [{"custom_id": str(i)} for i in range(2000)]
    jobs = lora.split_jobs(items, 4)
    assert [len(job) for _, job in jobs] == [500] * 4
    assert [tenant for tenant, _ in jobs] == [*wl.TENANTS, wl.TENANTS[0]]
    assert [line for _, job in jobs for line in job] == items
    assert sum(len(job) for _, job in lora.split_jobs(items[:10], 4)) == 10


def test_freight_order_groups_each_adapter_in_prompt_order(tokenizer: Any) -> None:
    mixed = lora.lines(tokenizer, NAMES, 10, seed=3)
    base_lines = lora.as_base(lora.lines(tokenizer, ["x"], 4, seed=4))
    ordered = lora.freight_order(tokenizer, mixed + base_lines)
    models = [line["body"]["model"] for line in ordered]
    assert models[:4] == [lora.BASE] * 4  # the base's lines sort first
    runs = [m for i, m in enumerate(models) if i == 0 or models[i - 1] != m]
    assert len(runs) == 1 + len(NAMES)  # each adapter's lines together
    for name in NAMES:
        ids = [wl.prompt_token_ids(tokenizer, line) for line in ordered if line["body"]["model"] == name]
        assert ids == sorted(ids)
    # the base alone: the same lines sorted by prompt only
    alone = lora.freight_order(tokenizer, lora.as_base(mixed))
    ids = [wl.prompt_token_ids(tokenizer, line) for line in alone]
    assert ids == sorted(ids) and {line["body"]["model"] for line in alone} == {lora.BASE}


def test_by_adapter_keeps_the_jobs_order() -> None:
    items = [{"custom_id": str(i), "body": {"model": NAMES[i % 2]}} for i in range(6)]
    groups = lora.by_adapter(items)
    assert [line["custom_id"] for line in groups[NAMES[0]]] == ["0", "2", "4"]
    assert [line["custom_id"] for line in groups[NAMES[1]]] == ["1", "3", "5"]


def test_ratios_take_the_faster_engine_placement_and_skip_what_did_not_run() -> None:
    repeats = [
        {
            "freight": {"wall_s": 10.0},
            "engine_lora_process": {"wall_s": 12.0},
            "engine_lora_inline": {"wall_s": 9.0},
            "engine_base_process": {"wall_s": 6.0},
            "engine_base_inline": {"wall_s": 7.0, "errors": 0},
            "runbatch": {"wall_s": 50.0},
        },
        {
            "freight": {"wall_s": 10.0},
            "engine_lora_process": {"wall_s": 8.0, "errors": 2},  # a failed run counts for none
            "engine_lora_inline": {"wall_s": 9.5},
            "engine_base_process": {"wall_s": 6.0},
        },
    ]
    paired = lora.paired_ratios(repeats)
    assert paired["freight_vs_engine_lora"] == [0.9, 0.95]
    assert paired["freight_vs_runbatch_per_adapter"] == [5.0]
    assert paired["engine_lora_vs_engine_base"] == [6.0 / 9.0, 6.0 / 9.5]
    ratios = {name: lora.median(values) for name, values in paired.items()}
    targets = lora.targets(ratios)
    assert targets["freight_vs_engine_lora"] == {"value": 0.9, "bound": 0.95, "pass": False}
    assert targets["freight_vs_runbatch_per_adapter"] == {"value": 5.0, "bound": 3.0, "pass": True}
    assert lora.targets({})["freight_vs_engine_lora"]["pass"] is False


def test_both_cache_modes_are_paired_and_the_default_has_its_target() -> None:
    """The tenant mode against the engine on the tenant order (engine_lora_tenant_*, the faster
    placement), the global mode against the engine on the global order."""
    repeats = [
        {
            "freight": {"wall_s": 10.0},
            "freight_tenant": {"wall_s": 12.5},
            "engine_lora_inline": {"wall_s": 10.0},
            "engine_lora_tenant_inline": {"wall_s": 11.0},
            "engine_lora_tenant_process": {"wall_s": 10.0},
        },
        {"freight": {"wall_s": 10.0}, "freight_tenant": {"wall_s": 8.0, "errors": 1}},  # counts for none
    ]
    assert lora.CACHE_MODES == {"freight": "global", "freight_tenant": "tenant"}
    paired = lora.paired_ratios(repeats)
    assert paired["tenant_over_global"] == [0.8]  # tenant mode's throughput over global's
    assert paired["freight_tenant_vs_engine_lora"] == [0.8]  # 10.0 (tenant order) / 12.5
    assert paired["freight_vs_engine_lora"] == [1.0]
    no_tenant_limit = [{k: v for k, v in repeats[0].items() if "tenant_" not in k or k == "freight_tenant"}]
    assert lora.paired_ratios(no_tenant_limit)["freight_tenant_vs_engine_lora"] == []
    targets = lora.targets({name: lora.median(values) for name, values in paired.items()})
    assert targets["freight_tenant_vs_engine_lora"] == {"value": 0.8, "bound": 0.95, "pass": False}
    assert "tenant_over_global" not in targets  # a cost reported, not a bound


def test_an_untrained_adapter_passes_freights_registration_checks(demo_model: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    from infra.build_lora_adapters import RANK, TARGETS
    from workers.adapter_registration import WEIGHTS, check_against_base, read_adapter_config

    out = lora.random_adapter(demo_model, tmp_path / "random-2", seed=2)
    config = read_adapter_config(out)
    assert sorted(config["target_modules"]) == sorted(TARGETS)
    assert check_against_base(out, demo_model) == RANK
    with safe_open(str(out / WEIGHTS), "pt") as weights:
        b = [weights.get_tensor(k) for k in weights.keys() if ".lora_B." in k]  # noqa: SIM118
    assert b and all(t.abs().sum() > 0 for t in b)  # not the zero B of PEFT's default init
    mtime = (out / WEIGHTS).stat().st_mtime_ns
    assert lora.random_adapter(demo_model, out, seed=2) == out  # kept, not built again
    assert (out / WEIGHTS).stat().st_mtime_ns == mtime


def test_the_tenant_order_is_by_tenant_then_freights_order_each_line_salted(tokenizer: Any) -> None:
    """engine_lora_tenant's lines: every line once, grouped by tenant in wl.TENANTS' order, each
    tenant's in Freight's order, each carrying its tenant's cache_salt."""
    names = [lora.adapter_name(i) for i in range(3)]
    these = lora.lines(tokenizer, names, 12, 0)
    jobs = lora.split_jobs(these, 4)
    ordered = lora.tenant_order(tokenizer, jobs)
    assert sorted(line["custom_id"] for line in ordered) == sorted(line["custom_id"] for line in these)
    owner = {line["custom_id"]: tenant for tenant, job in jobs for line in job}
    salts = [line["body"]["cache_salt"] for line in ordered]
    assert salts == [owner[line["custom_id"]] for line in ordered]
    assert salts == sorted(salts, key=wl.TENANTS.index)  # grouped, in the tenants' order
    for tenant in wl.TENANTS:
        mine = [line for line in ordered if line["body"]["cache_salt"] == tenant]
        unsalted = [
            {**line, "body": {k: v for k, v in line["body"].items() if k != "cache_salt"}} for line in mine
        ]
        assert unsalted == lora.freight_order(tokenizer, unsalted)
