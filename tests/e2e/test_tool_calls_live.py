"""Tool calls through the live stack's real vLLM engine: forced calls ("required", a named
function) on the demo model, which has no tool-call parser, so "auto" is that line's 400.

The demo model's weights are random: structured outputs alone make its answers calls whose
arguments parse and match the tool's schema (lines are seeded, so a run repeats itself)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai.types.chat import ChatCompletion

from tests.e2e.batch_client import read_jsonl, run_batch
from tests.factories import chat_line

pytestmark = pytest.mark.stack

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"$ref": "#/$defs/unit"}},
    "required": ["city", "unit"],
    "additionalProperties": False,
    "$defs": {"unit": {"enum": ["c", "f"]}},
}
CLOCK = {
    "type": "object",
    "properties": {"utc": {"type": "boolean"}},
    "required": ["utc"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "clock", "parameters": CLOCK}},
]
SCHEMAS = {"weather": WEATHER, "clock": CLOCK}


def tool_line(custom_id: str, seed: int, **body: object) -> dict:
    return chat_line(
        custom_id, "What is the weather in Oslo?", tools=TOOLS, seed=seed, max_tokens=120, **body
    )


def test_forced_tool_calls_come_back_as_openai_tool_calls(live) -> None:
    client = live.client()
    named = {"type": "function", "function": {"name": "weather"}}
    lines = [
        tool_line(f"required-{i}", i, tool_choice="required", parallel_tool_calls=False) for i in range(3)
    ]
    lines += [tool_line(f"named-{i}", 10 + i, tool_choice=named) for i in range(3)]
    lines += [tool_line("auto", 20, tool_choice="auto"), tool_line("none", 21, tool_choice="none")]
    batch = run_batch(client, lines)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (7, 1)

    errors = {e["custom_id"]: e["response"] for e in read_jsonl(client, batch.error_file_id)}
    assert errors["auto"]["status_code"] == 400 and errors["auto"]["body"]["error"]["param"] == "tool_choice"
    assert "tool-call parser" in errors["auto"]["body"]["error"]["message"]

    by_id = {line["custom_id"]: line["response"]["body"] for line in read_jsonl(client, batch.output_file_id)}
    for custom_id, body in by_id.items():
        completion = ChatCompletion.model_validate(body)  # the openai package's own type
        (choice,) = completion.choices
        if custom_id == "none":
            assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
            continue
        assert choice.message.content is None, custom_id
        assert choice.finish_reason == ("tool_calls" if custom_id.startswith("required") else "stop"), body
        (call,) = choice.message.tool_calls  # type: ignore[misc]
        assert call.type == "function" and call.id.startswith("call_")
        if custom_id.startswith("named"):
            assert call.function.name == "weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert body["usage"]["completion_tokens"] > 0
