"""bench/workloads.py: multi_job_shared_prefix's generator and its multi-job split."""

from __future__ import annotations

import collections
import json
from pathlib import Path

from bench import workloads as wl


def _lines(prompts: int, items: int) -> list[dict]:
    lines = [
        wl.request_line(
            f"fs{p:02d}-i{i:02d}",
            [{"role": "system", "content": f"few-shot prompt {p}"}, {"role": "user", "content": f"item {i}"}],
            wl.FEW_SHOT_OUTPUT_TOKENS,
        )
        for p in range(prompts)
        for i in range(items)
    ]
    import random

    random.Random(1).shuffle(lines)
    return lines


def _ids(path: str | Path) -> list[str]:
    return [json.loads(x)["custom_id"] for x in Path(path).read_text().splitlines() if x.strip()]


def test_split_gives_every_job_items_of_every_prompt(tmp_path: Path) -> None:
    source = tmp_path / "mjsp.jsonl"
    wl.write_jsonl(source, _lines(prompts=7, items=30))
    pieces = wl.split_multi_job_shared_prefix(source, tmp_path / "jobs")
    assert [(p["tenant"], p["job"]) for p in pieces] == [(t, j) for j in range(2) for t in wl.TENANTS]
    every = [cid for p in pieces for cid in _ids(p["path"])]
    assert sorted(every) == sorted(_ids(source))  # each line exactly once
    order = {cid: n for n, cid in enumerate(_ids(source))}
    for piece in pieces:
        ids = _ids(piece["path"])
        assert piece["requests"] == len(ids)
        assert [order[c] for c in ids] == sorted(order[c] for c in ids)  # file order kept
        per_prompt = collections.Counter(c.split("-")[0] for c in ids)
        assert set(per_prompt) == {f"fs{p:02d}" for p in range(7)}
        assert set(per_prompt.values()) == {5}  # 30 items over 6 jobs


def test_split_is_seeded(tmp_path: Path) -> None:
    source = tmp_path / "mjsp.jsonl"
    wl.write_jsonl(source, _lines(prompts=3, items=10))  # 10 over 6 jobs: uneven
    first = [_ids(p["path"]) for p in wl.split_multi_job_shared_prefix(source, tmp_path / "a")]
    again = [_ids(p["path"]) for p in wl.split_multi_job_shared_prefix(source, tmp_path / "b")]
    other = [_ids(p["path"]) for p in wl.split_multi_job_shared_prefix(source, tmp_path / "c", seed=4)]
    assert first == again
    assert first != other
    assert max(map(len, first)) - min(map(len, first)) <= 3  # at most one line more per prompt


def test_merge_by_tenant_joins_each_tenants_jobs(tmp_path: Path) -> None:
    source = tmp_path / "mjsp.jsonl"
    wl.write_jsonl(source, _lines(prompts=4, items=30))
    pieces = wl.split_multi_job_shared_prefix(source, tmp_path / "jobs")
    merged = wl.merge_by_tenant(pieces, tmp_path / "jobs", stem="mjsp-per-tenant")
    assert [m["tenant"] for m in merged] == list(wl.TENANTS)
    for m in merged:
        mine = [cid for p in pieces if p["tenant"] == m["tenant"] for cid in _ids(p["path"])]
        assert _ids(m["path"]) == mine
        assert m["requests"] == 40
        assert Path(m["path"]).name == f"mjsp-per-tenant-{m['tenant']}.jsonl"


def test_generator_shape(demo_model: Path) -> None:
    tokenizer = wl.load_tokenizer(demo_model)
    lines = wl.multi_job_shared_prefix_lines(tokenizer, scale=0.05)  # 2 prompts
    assert len(lines) == 2 * wl.FEW_SHOT_ITEMS
    assert lines == wl.multi_job_shared_prefix_lines(tokenizer, scale=0.05)
    systems = {line["body"]["messages"][0]["content"] for line in lines}
    assert len(systems) == 2
    for system in systems:
        assert abs(wl.count_tokens(tokenizer, system) - wl.FEW_SHOT_PROMPT_TOKENS) <= 40
    assert {line["body"]["max_tokens"] for line in lines} == {wl.FEW_SHOT_OUTPUT_TOKENS}
    info = wl.describe(tokenizer, lines)
    assert info["shared_prefix_tokens"] >= 2 * (wl.FEW_SHOT_PROMPT_TOKENS - 40)


def test_a_repeat_has_other_prompts_so_nothing_of_the_last_run_is_cached(demo_model: Path) -> None:
    """The repeats of multi_job_shared_prefix (seed SEED-rN) share no whole KV block of prompt with
    the workload: a warm stack measured again finds none of the last run's prefixes cached."""
    tokenizer = wl.load_tokenizer(demo_model)
    base = wl.multi_job_shared_prefix_lines(tokenizer, scale=0.05)
    repeat = wl.multi_job_shared_prefix_lines(tokenizer, scale=0.05, seed=f"{wl.SEED}-r1")
    assert wl.repeat_file(1, "multi_job_shared_prefix") == "multi_job_shared_prefix-r1.jsonl"
    assert wl.repeat_file(0, "multi_job_shared_prefix") == wl.WORKLOAD_FILES["multi_job_shared_prefix"]
    ids = {tuple(wl.prompt_token_ids(tokenizer, line)[:32]) for line in base}
    assert not ids & {tuple(wl.prompt_token_ids(tokenizer, line)[:32]) for line in repeat}
