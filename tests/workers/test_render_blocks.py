"""Lines rendered a block at a time come out in the order they went in, each with its own prompt,
whatever the block boundaries and models (the demo model's real tokenizer)."""

from __future__ import annotations

import json

import pytest

from workers import render_blocks
from workers.prompt_tokens import PromptRenderer, renderer_for
from workers.render_blocks import CheckedLine, RenderBlock
from workers.validation import FileRules, ScanResult, scan_lines

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def renderer(demo_model_dir) -> PromptRenderer:
    return renderer_for(str(demo_model_dir), 64)


def body(i: int, model: str = "demo") -> dict:
    return {"model": model, "messages": [{"role": "user", "content": f"question {i} " * (i % 7)}]}


def test_rows_come_out_in_order_with_their_own_prompts(renderer, monkeypatch):
    monkeypatch.setattr(render_blocks, "BLOCK_LINES", 5)
    calls: list[tuple[str, int]] = []

    def many(model: str, endpoint: str, bodies: list[dict]) -> list:
        calls.append((model, len(bodies)))
        return renderer.render_many(endpoint, bodies)

    block = RenderBlock(CHAT, lambda m, e, b: renderer.render(e, b), many)
    lines = [CheckedLine(i, f"id-{i}", json.dumps(body(i)), body(i, "ab"[i % 3 == 0]), "ab"[i % 3 == 0], 3) for i in range(12)]  # fmt: skip
    rows = [row for line in lines for row in block.add(line)]
    assert len(rows) == 10  # two full blocks so far
    rows += block.flush()
    assert [r.line for r in rows] == list(range(12))
    for row, line in zip(rows, lines, strict=True):
        expected = renderer.render(CHAT, line.body)
        assert (row.key, row.prompt_token_ids, row.prompt_len) == (
            expected.key,
            expected.id_bytes,
            expected.prompt_len,
        )
    assert calls[:2] == [("b", 2), ("a", 3)]  # each block's lines, grouped by model in order
    assert block.flush() == []


def test_a_block_of_long_lines_renders_early(renderer, monkeypatch):
    monkeypatch.setattr(render_blocks, "BLOCK_BYTES", 1000)
    block = RenderBlock(CHAT, lambda m, e, b: renderer.render(e, b), None)
    text = json.dumps(body(1))
    long_line = CheckedLine(1, "x", text + " " * 1000, body(1), "demo", None)
    assert [r.line for r in block.add(long_line)] == [1]


def test_scanning_with_blocks_equals_scanning_line_by_line(renderer):
    raw = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": body(i)}).encode() for i in range(700)]  # fmt: skip
    raw[300] = b"{not json"
    one = lambda m, e, b: renderer.render(e, b)  # noqa: E731
    rules = FileRules(CHAT, frozenset({"demo"}), 10_000, 1 << 20, one)
    blocks = FileRules(
        CHAT, frozenset({"demo"}), 10_000, 1 << 20, one, lambda m, e, bs: renderer.render_many(e, bs)
    )
    by_line, by_block = list(scan_lines(raw, rules, 10)), list(scan_lines(raw, blocks, 10))
    assert by_line[:-1] == by_block[:-1] and len(by_block) == 700
    assert isinstance(by_block[-1], ScanResult) and by_block[-1].error_count == 1
