"""Valid lines' prompts rendered a block at a time, in file order.

Why: tokenizing line by line crosses into the Rust tokenizer once a line and uses one core; its
batch API takes a block of texts at once and spreads them over the cores (on the BF16 host, 17
against 23 us a line of the request-rate benchmark's short prompts, at a third more CPU; nothing
gained where one core is all there is). Validation checks each
line as it reads it (errors, custom_ids and the file's limits are decided there, in order), and
parks the valid ones here until a block is full; the rows come out in the order the lines went in,
with the same prompts `PromptRenderer.render` gives one at a time.

Bounded: a block holds at most `BLOCK_LINES` lines and `BLOCK_BYTES` of bodies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scheduler.ordering import adapter_key
from scheduler.request_work import request_work
from storage.shards import ShardRow
from workers.prompt_tokens import RenderedPrompt

BLOCK_LINES = 256
BLOCK_BYTES = 4 * 1024 * 1024  # of body JSON: a block of long lines renders early

PromptFn = Callable[[str, str, dict], RenderedPrompt]  # (model, endpoint, body) -> ids / sort key
PromptsFn = Callable[[str, str, list[dict]], list[RenderedPrompt]]  # the same for many bodies


@dataclass(frozen=True, slots=True)
class CheckedLine:
    """A line that passed every check; its prompt is not rendered yet."""

    line: int
    custom_id: str
    body_json: str
    body: dict[str, Any]
    model: str
    max_tokens: int | None
    sequences: int = 1  # the outputs it asks for (scheduler.request_work)
    expected_output: int | None = None  # each sequence's expected output tokens; None: a pooling model's

    def row(self, rendered: RenderedPrompt | None) -> ShardRow:
        if rendered is None:  # no rendering: no ids, no ordering key (rows keep file order)
            work = request_work(0, self.sequences, self.expected_output)
            return ShardRow(
                self.line, self.custom_id, self.body_json, b"", None, 0, self.max_tokens, 0,
                self.sequences, work,
            )  # fmt: skip
        key = rendered.key
        if self.body.get("model") != self.model:  # a LoRA adapter's line: its adapter's group
            key = adapter_key(self.body["model"], key)
        work = request_work(rendered.prompt_len, self.sequences, self.expected_output)
        return ShardRow(
            self.line, self.custom_id, self.body_json, key, rendered.id_bytes,
            rendered.prompt_len, self.max_tokens, 0, self.sequences, work,
        )  # fmt: skip


class RenderBlock:
    """Checked lines waiting for their prompts (see the module)."""

    def __init__(self, endpoint: str, render: PromptFn | None, render_many: PromptsFn | None) -> None:
        self.endpoint = endpoint
        self.render = render
        self.render_many = render_many
        self.waiting: list[CheckedLine] = []
        self.size = 0

    def add(self, line: CheckedLine) -> list[ShardRow]:
        """The rows of a full block, in order, or nothing yet."""
        if self.render is None:
            return [line.row(None)]
        self.waiting.append(line)
        self.size += len(line.body_json)
        if len(self.waiting) >= BLOCK_LINES or self.size >= BLOCK_BYTES:
            return self.flush()
        return []

    def flush(self) -> list[ShardRow]:
        """The rows of every line still waiting, in the order they came."""
        waiting, self.waiting, self.size = self.waiting, [], 0
        if not waiting:
            return []
        rendered: list[RenderedPrompt | None] = [None] * len(waiting)
        by_model: dict[str, list[int]] = {}
        for i, line in enumerate(waiting):
            by_model.setdefault(line.model, []).append(i)
        for model, where in by_model.items():
            bodies = [waiting[i].body for i in where]
            if self.render_many is not None:
                prompts = self.render_many(model, self.endpoint, bodies)
            else:
                assert self.render is not None
                prompts = [self.render(model, self.endpoint, body) for body in bodies]
            for i, prompt in zip(where, prompts, strict=True):
                rendered[i] = prompt
        return [line.row(prompt) for line, prompt in zip(waiting, rendered, strict=True)]
