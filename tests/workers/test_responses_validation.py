"""/v1/responses lines through parse_body (vLLM's chat request model) and the validating step: a
Responses line is validated, tokenized and ordered as its chat translation, its refusals name
Responses fields with their line numbers, and a file of them validates on SQLite and PostgreSQL.
Real vLLM request models and the demo model's tokenizer; no engine."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from sqlalchemy import select

from api.services.tenants import create_tenant
from storage.models import Batch, WorkUnit
from storage.shards import read_rows
from tests.conftest import now
from tests.factories import chat_line, parquet_bytes, responses_line, upload_and_create, validated_batch
from workers.prompt_tokens import PromptRenderer, renderer_for
from workers.request_bodies import CHAT, RequestError, parse_body
from workers.responses import RESPONSES, to_chat
from workers.validation import FileRules, LineError, ValidLine, check_line, validate_batch

SERVED = frozenset({"demo", "embed"})
RULES = FileRules(RESPONSES, SERVED, 10, 1 << 16, embed_models=frozenset({"embed"}))
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "weather", "parameters": SCHEMA}


def raw(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_a_responses_body_parses_as_its_chat_translation() -> None:
    text = {"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA, "strict": True}}
    body = {"model": "demo", "instructions": "Be brief.", "input": "Is it?", "max_output_tokens": 12,
            "temperature": 0.3, "text": text, "metadata": {"k": "v"}}  # fmt: skip
    parsed = parse_body(RESPONSES, body)
    assert (parsed.endpoint, parsed.model, parsed.max_tokens, parsed.n) == (RESPONSES, "demo", 12, 1)
    assert parsed.is_chat and type(parsed.request).__name__ == "ChatCompletionRequest"
    assert [m["role"] for m in parsed.request.messages] == ["system", "user"]
    assert parsed.request.temperature == 0.3
    assert parsed.request.response_format.type == "json_schema"
    assert parsed.responses == {k: body[k] for k in body if k not in ("model", "input")}
    assert parse_body(RESPONSES, {"model": "demo", "input": "x"}).max_tokens is None  # engine default


def test_forced_tool_choices_constrain_the_output_as_for_chat() -> None:
    required = parse_body(RESPONSES, {"input": "x", "tools": [WEATHER], "tool_choice": "required"})
    assert required.request.structured_outputs is not None and required.request.structured_outputs.json
    named = parse_body(
        RESPONSES, {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "weather"}}
    )
    assert named.request.structured_outputs.json == SCHEMA
    auto = {"input": "x", "tools": [WEATHER]}  # tools without tool_choice: "auto"
    with pytest.raises(RequestError) as caught:
        parse_body(RESPONSES, auto)
    assert (caught.value.code, caught.value.param) == ("unsupported_parameter", "tool_choice")
    assert "tool-call parser" in caught.value.message
    assert parse_body(RESPONSES, auto, auto_tools=True).request.tool_choice == "auto"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": "x", "top_p": 7}, "top_p"),
        ({"input": "x", "parallel_tool_calls": [1]}, "parallel_tool_calls"),
        (
            {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "clock"}},
            "tool_choice.name",
        ),
        ({"input": "x", "tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools.1.name"),
        ({"input": "x", "tools": [{"type": "function", "name": ""}], "tool_choice": "none"}, "tools.0.name"),
        (
            {"input": "x", "tools": [{**WEATHER, "parameters": {"type": 5}}], "tool_choice": "required"},
            "tools.0.parameters",
        ),
        (
            {
                "input": "x",
                "tools": [WEATHER],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            "text.format",
        ),
        ({"input": "x", "reasoning": {"effort": "enormous"}}, "reasoning.effort"),
    ],
)
def test_chats_refusals_name_the_responses_field(body: dict, param: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse_body(RESPONSES, {"model": "demo", **body}, reasoning=True)
    assert caught.value.param is not None and caught.value.param.startswith(param), caught.value
    assert caught.value.message


def test_lines_at_validation_carry_their_line_numbers_and_responses_params() -> None:
    good = check_line(raw(responses_line("a", "hi", max_output_tokens=7)), 1, RULES)
    assert isinstance(good, ValidLine) and good.row.max_tokens == 7 and good.model == "demo"
    bad = check_line(raw(responses_line("b", [{"role": "user", "content": 5}])), 4, RULES)
    assert isinstance(bad, LineError)
    assert (bad.line, bad.code, bad.param) == (4, "invalid_request", "body.input.0.content")
    unknown = check_line(raw(responses_line("c", "hi", seed=3)), 5, RULES)
    assert isinstance(unknown, LineError) and (unknown.line, unknown.param) == (5, "body.seed")
    # what Freight cannot honour passes to run time, where it is that request's 400
    for body in ({"store": True}, {"previous_response_id": "resp_1"}, {"tools": [{"type": "web_search"}]}):
        assert isinstance(check_line(raw(responses_line("d", "hi", **body)), 6, RULES), ValidLine)
    to_embed = check_line(raw(responses_line("e", "hi", model="embed")), 7, RULES)
    assert isinstance(to_embed, LineError) and to_embed.code == "invalid_model"
    assert (
        "'embed' is an embedding model; it serves /v1/embeddings, /v1/score and /v1/rerank only, not /v1/responses"
        in to_embed.message
    )
    chat_in_file = check_line(raw(chat_line("f")), 8, RULES)
    assert isinstance(chat_in_file, LineError) and chat_in_file.code == "mismatched_url"


def test_reasoning_passes_only_for_a_model_that_reads_it_back() -> None:
    line = raw(responses_line("r", "hi", reasoning={"effort": "low"}))
    assert check_line(line, 1, RULES).row.max_tokens is None  # type: ignore[union-attr]  # passes on, refused at run time
    with pytest.raises(RequestError) as caught:
        parse_body(RESPONSES, json.loads(line)["body"])
    assert (caught.value.code, caught.value.param) == ("unsupported_parameter", "reasoning")
    rules = FileRules(RESPONSES, SERVED, 10, 1 << 16, reasoning_models=frozenset({"demo"}))
    assert isinstance(check_line(line, 1, rules), ValidLine)
    assert parse_body(RESPONSES, json.loads(line)["body"], reasoning=True).request.reasoning_effort == "low"


@pytest.fixture(scope="module")
def renderer(demo_model_dir: Path) -> PromptRenderer:
    return renderer_for(str(demo_model_dir), 1024)


def test_prompts_are_tokenized_and_keyed_as_their_chat_translation(renderer: PromptRenderer) -> None:
    for body in (
        {"model": "demo", "input": "hi"},
        {
            "model": "demo",
            "instructions": "Be brief.",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}],
            "max_output_tokens": 5,
        },
        {"model": "demo", "input": "x", "tools": [WEATHER], "tool_choice": "required"},
    ):
        responses = renderer.render(RESPONSES, body)
        chat = renderer.render(CHAT, to_chat(body).chat)
        assert (responses.key_bytes, responses.exact) == (chat.key_bytes, chat.exact) and responses.key
    assert renderer.render(RESPONSES, {"model": "demo", "input": "hi"}).exact  # plain: exact ids
    assert renderer.render(RESPONSES, {"input": 5}).key == b""  # it never runs


def test_a_responses_file_validates_or_fails_with_line_errors(runtime) -> None:
    tenant, _ = create_tenant(runtime.db, "t", now())
    good = [responses_line(f"ok-{i}", f"Question {i}?", instructions="Be brief.") for i in range(3)]
    good.append(responses_line("refused-later", "hi", store=True))  # a 400 at run time, not here
    batch_id = validated_batch(runtime, tenant.id, good, endpoint=RESPONSES)
    with runtime.db.read() as s:
        batch = s.get(Batch, batch_id)
        assert (batch.status, batch.endpoint, batch.errors) == ("in_progress", RESPONSES, None)
        assert batch.request_total == 4 and batch.planned_prompt_tokens > 0
    bad = [good[0], responses_line("b", "hi", text={"format": {"type": "xml"}}), chat_line("c")]
    batch_id = validated_batch(runtime, tenant.id, bad, endpoint=RESPONSES)
    with runtime.db.read() as s:
        batch = s.get(Batch, batch_id)
    assert batch.status == "failed"
    assert [(e["line"], e["code"], e["param"]) for e in batch.errors["data"]] == [
        (2, "invalid_request", "body.text.format.type"),
        (3, "mismatched_url", "url"),
    ]


def test_a_responses_parquet_file_validates_from_its_body_column(runtime) -> None:
    tenant, _ = create_tenant(runtime.db, "t", now())
    bodies = [json.dumps({"input": f"Question {i}?", "max_output_tokens": i + 1}) for i in range(3)]
    table = pa.table({"custom_id": [f"pq-resp-{i}" for i in range(3)], "body": bodies})
    batch = upload_and_create(
        runtime,
        tenant.id,
        parquet_bytes(table),
        name="pq-resp.parquet",
        endpoint=RESPONSES,
        metadata={"default_model": "demo"},
    )
    validate_batch(runtime, batch.id)
    with runtime.db.read() as s:
        batch = s.get(Batch, batch.id)
        units = s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch.id)).all()
    assert (batch.status, batch.request_total, batch.model) == ("in_progress", 3, "demo"), batch.errors
    rows = [r for u in units for r in read_rows(runtime.store, u.shard_key, u.row_start, u.n_requests)]
    assert sorted((r.custom_id, r.max_tokens, r.body["model"]) for r in rows) == [
        (f"pq-resp-{i}", i + 1, "demo") for i in range(3)
    ]
    assert all(r.prompt_token_ids for r in rows)  # plain input: tokenized exactly at validation
