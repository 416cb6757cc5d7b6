"""bench/workloads.py's issue #51 workloads (blend, long_prefix, dups, request_rate): seeded, and of
the shape they are named for, measured with the demo model's own tokenizer."""

from __future__ import annotations

import collections
import json
from pathlib import Path

from bench import workloads as wl


def _bodies(lines: list[dict]) -> list[str]:
    return [json.dumps(line["body"], sort_keys=True) for line in lines]


def test_dups_are_exactly_a_fifth_of_the_lines_and_seeded(demo_model: Path) -> None:
    tokenizer = wl.load_tokenizer(demo_model)
    lines = wl.dups_lines(tokenizer, scale=0.05)  # 40 originals, 10 copies
    assert len(lines) == 50
    assert lines == wl.dups_lines(tokenizer, scale=0.05)
    assert lines != wl.dups_lines(tokenizer, scale=0.05, seed=f"{wl.SEED}-r1")
    counts = collections.Counter(_bodies(lines))
    duplicates = len(lines) - len(counts)
    assert duplicates / len(lines) == 0.2
    assert set(counts.values()) == {1, 2}  # each original copied at most once
    assert len({line["custom_id"] for line in lines}) == len(lines)
    by_id = {line["custom_id"]: line for line in lines}
    for cid, line in by_id.items():
        if cid.startswith("dup-"):
            assert line["body"] == by_id[f"orig-{cid.split('-of-')[1]}"]["body"]
    assert {line["body"]["temperature"] for line in lines} == {0}  # greedy: one run serves both
    tiny = wl.dups_lines(tokenizer, scale=0.001)  # rounds up to 4 originals, never to none
    assert (len(tiny), len(set(_bodies(tiny)))) == (5, 4)


def test_long_prefix_documents_fill_the_context_and_fit_it(demo_model: Path) -> None:
    tokenizer = wl.load_tokenizer(demo_model)
    lines = wl.long_prefix_lines(tokenizer, scale=0.1)  # 1 document (of 12) x 20 questions
    assert len(lines) == wl.LONG_PREFIX_QUESTIONS
    assert lines == wl.long_prefix_lines(tokenizer, scale=0.1)
    for line in lines:
        total = wl.prompt_tokens(tokenizer, line) + line["body"]["max_tokens"]
        assert wl.CONTEXT_TOKENS - wl.LONG_PREFIX_HEADROOM < total <= wl.CONTEXT_TOKENS
    info = wl.describe(tokenizer, lines)
    assert info["shared_prefix_tokens"] >= wl.CONTEXT_TOKENS - 2 * wl.LONG_PREFIX_HEADROOM
    small = wl.long_prefix_lines(tokenizer, scale=0.1, context_tokens=512)
    assert max(wl.prompt_tokens(tokenizer, x) + x["body"]["max_tokens"] for x in small) <= 512


def test_blend_mixes_classification_and_generation_over_shared_prompts(demo_model: Path) -> None:
    tokenizer = wl.load_tokenizer(demo_model)
    lines = wl.blend_lines(tokenizer, scale=0.1)  # 2 prompts x 30 items
    assert len(lines) == 2 * wl.BLEND_ITEMS
    assert lines == wl.blend_lines(tokenizer, scale=0.1)
    tokens = collections.Counter(line["body"]["max_tokens"] for line in lines)
    per_prompt_gen = -(-wl.BLEND_ITEMS // wl.BLEND_GENERATE_EVERY)
    assert tokens == {
        wl.BLEND_GENERATE_TOKENS: 2 * per_prompt_gen,
        wl.BLEND_CLASSIFY_TOKENS: 2 * (wl.BLEND_ITEMS - per_prompt_gen),
    }
    for system in {line["body"]["messages"][0]["content"] for line in lines}:
        kinds = {
            x["custom_id"].rsplit("-", 1)[1] for x in lines if x["body"]["messages"][0]["content"] == system
        }
        assert kinds == {"cls", "gen"}  # both kinds share each prompt


def test_request_rate_shape_reuses_request_rates_lines(demo_model: Path) -> None:
    from bench import request_rate

    lines = wl.request_rate_shape_lines(None, scale=0.1)
    assert len(lines) == wl.REQUEST_RATE_REQUESTS // 10
    assert {line["body"]["max_tokens"] for line in lines} == {wl.REQUEST_RATE_OUTPUT_TOKENS}
    assert len(set(_bodies(lines))) == len(lines)
    same_seed = request_rate.lines(len(lines), wl.SEED)  # the prompts of request_rate's own lines
    assert [x["body"]["messages"] for x in lines] == [x["body"]["messages"] for x in same_seed]
