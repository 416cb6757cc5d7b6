"""A /v1/responses batch through the live stack's real vLLM engine (demo model, no tool-call
parser), with the official `openai` client: a string input, messages with instructions, a
json_schema text format and a forced function call come back as Response objects the openai
package validates; what a batch cannot honour is that line's 400 naming the field.

The demo model's weights are random: structured outputs alone make the json_schema and the
function-call answers valid JSON of their schemas. They sample at the model's temperature (1.0),
as the chat and tool-call tests' structured lines do: a greedy random model can keep choosing
the whitespace a JSON grammar allows."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai.types.responses import Response
from transformers import AutoTokenizer

from tests.e2e.batch_client import read_jsonl, upload
from tests.e2e.conftest import wait_final
from tests.factories import responses_line

pytestmark = pytest.mark.stack

RESPONSES = "/v1/responses"
VERDICT = {
    "type": "object",
    "properties": {"label": {"enum": ["yes", "no"]}},
    "required": ["label"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "weather", "description": "Weather now", "parameters": WEATHER}


def test_a_responses_batch_answers_with_response_objects(live) -> None:
    client = live.client()
    lines = [
        responses_line("resp-live-plain", "Name a colour.", max_output_tokens=8, temperature=0),
        responses_line(
            "resp-live-messages",
            [
                {"role": "developer", "content": "Answer in one word."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi?"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
                {"role": "user", "content": "And again?"},
            ],
            instructions="You are terse.",
            max_output_tokens=6,
            temperature=0,
            metadata={"case": "resp-live-messages"},
        ),
        *(
            responses_line(
                f"resp-live-schema-{i}",
                "Is the sky blue?",
                max_output_tokens=48,
                text={
                    "format": {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}
                },
            )
            for i in range(2)
        ),
        *(
            responses_line(
                f"resp-live-tool-{i}",
                "Weather in Oslo?",
                max_output_tokens=120,
                tools=[TOOL],
                tool_choice="required",
                parallel_tool_calls=False,
            )
            for i in range(2)
        ),
        responses_line("resp-live-stored", "hi", store=True),
        responses_line("resp-live-search", "hi", tools=[{"type": "web_search"}]),
        responses_line("resp-live-too-long", "word " * 5000),  # past the context: the engine's 400
    ]
    file_id = upload(client, lines, "resp-live-requests.jsonl")  # names unique in the suite: shared stack
    created = client.batches.create(
        input_file_id=file_id, endpoint=RESPONSES, completion_window="24h", metadata={"suite": "resp-live"}
    )
    batch = wait_final(client, created.id)
    assert batch.status == "completed", batch
    assert batch.endpoint == RESPONSES
    assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 3)

    errors = {e["custom_id"]: e["response"] for e in read_jsonl(client, batch.error_file_id)}
    for custom_id, code, param in (
        ("resp-live-stored", "unsupported_parameter", "store"),
        ("resp-live-search", "unsupported_parameter", "tools.0.type"),
        ("resp-live-too-long", "context_length_exceeded", "input"),
    ):
        error = errors[custom_id]
        assert error["status_code"] == 400, error
        assert (error["body"]["error"]["code"], error["body"]["error"]["param"]) == (code, param), error
        assert error["body"]["error"]["message"]

    by_id = {line["custom_id"]: line["response"] for line in read_jsonl(client, batch.output_file_id)}
    assert sorted(by_id) == sorted(line["custom_id"] for line in lines[:6])
    responses = {}
    for custom_id, response in by_id.items():
        assert response["status_code"] == 200
        parsed = Response.model_validate(response["body"])  # the openai package's own type
        assert parsed.object == "response" and parsed.id.startswith("resp_") and parsed.model == "demo"
        usage = parsed.usage
        assert usage is not None
        assert all(
            type(v) is int
            for v in (usage.input_tokens, usage.output_tokens, usage.input_tokens_details.cached_tokens)
        )
        assert 0 <= usage.input_tokens_details.cached_tokens <= usage.input_tokens
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens
        assert 1 <= usage.output_tokens <= (parsed.max_output_tokens or 0)
        responses[custom_id] = parsed
    # usage is the batch's, line by line
    assert batch.usage.input_tokens == sum(r.usage.input_tokens for r in responses.values())  # type: ignore[union-attr]
    assert batch.usage.output_tokens == sum(r.usage.output_tokens for r in responses.values())  # type: ignore[union-attr]
    assert batch.usage.input_tokens_details.cached_tokens == sum(
        r.usage.input_tokens_details.cached_tokens  # type: ignore[union-attr]
        for r in responses.values()
    )

    plain = responses["resp-live-plain"]
    tokenizer = AutoTokenizer.from_pretrained(live.model_dir)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True, tokenize=True
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert plain.usage.input_tokens == len(ids)  # type: ignore[union-attr]
    (message,) = plain.output
    assert message.type == "message" and message.role == "assistant"
    assert plain.status in ("completed", "incomplete") and isinstance(plain.output_text, str)
    if plain.status == "incomplete":
        assert plain.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
        assert plain.usage.output_tokens == 8  # type: ignore[union-attr]

    messages = responses["resp-live-messages"]
    assert messages.instructions == "You are terse." and messages.metadata == {"case": "resp-live-messages"}
    assert messages.usage.input_tokens > plain.usage.input_tokens  # type: ignore[union-attr]

    # a tiny model may spend a budget on the whitespace JSON allows: two tries each, and a
    # try cut short is an incomplete Response whose text stays a message (no call)
    for kind in ("schema", "tool"):
        tries = [responses[f"resp-live-{kind}-{i}"] for i in range(2)]
        for cut in (r for r in tries if r.status == "incomplete"):
            assert cut.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
            assert cut.usage.output_tokens == cut.max_output_tokens  # type: ignore[union-attr]
            assert [item.type for item in cut.output] == ["message"]
        assert any(r.status == "completed" for r in tries), f"no {kind} line finished"
    for i in range(2):
        schema = responses[f"resp-live-schema-{i}"]
        assert schema.text.format.type == "json_schema"  # type: ignore[union-attr]
        if schema.status == "completed":
            jsonschema.validate(json.loads(schema.output_text), VERDICT)
        tool = responses[f"resp-live-tool-{i}"]
        assert tool.tool_choice == "required"
        if tool.status == "completed":
            (call,) = tool.output
            assert call.type == "function_call" and call.name == "weather"  # type: ignore[union-attr]
            assert call.call_id.startswith("call_")  # type: ignore[union-attr]
            jsonschema.validate(json.loads(call.arguments), WEATHER)  # type: ignore[union-attr]
