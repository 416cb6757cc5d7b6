"""/v1/responses bodies both ways, pure (no vLLM, no engine): every accepted field's chat
translation, every refusal naming its Responses field, and chat results written back as Response
objects that the openai package's own type accepts."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import Response

from workers.request_errors import RequestError
from workers.responses import FIELDS, ResponsesRequest, prompt_chat_body, response_from_chat, to_chat

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
WEATHER = {"type": "function", "name": "weather", "description": "Weather now", "parameters": SCHEMA}


def chat_of(**body: object) -> dict:
    return to_chat({"model": "demo", "input": "hi", **body}).chat


def refused(body: dict, reasoning: bool = False) -> RequestError:
    with pytest.raises(RequestError) as caught:
        to_chat({"model": "demo", **body}, reasoning=reasoning)
    assert caught.value.status_code == 400 and caught.value.message
    return caught.value


def test_a_string_input_is_one_user_message() -> None:
    assert to_chat({"model": "demo", "input": "Hello"}).chat == {
        "model": "demo",
        "messages": [{"role": "user", "content": "Hello"}],
    }


def test_message_items_and_instructions_become_chat_messages_in_order() -> None:
    translated = to_chat(
        {
            "model": "demo",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Answer in French."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                {
                    "type": "message",
                    "id": "msg_1",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Salut", "annotations": []}],
                },
                {"role": "system", "content": "Still brief."},
                {"role": "user", "content": "Again"},
            ],
        }
    )
    assert translated.chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer in French."},  # developer: the templates' system
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Salut"}]},
        {"role": "system", "content": "Still brief."},
        {"role": "user", "content": "Again"},
    ]
    assert translated.origins == ("instructions", "input.0", "input.1", "input.2", "input.3", "input.4")
    assert translated.echo == {"instructions": "Be brief."}


def test_function_calls_and_their_outputs_replay_as_assistant_calls_and_tool_messages() -> None:
    messages = chat_of(
        input=[
            {"role": "user", "content": "Weather in Oslo and Lima?"},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"ok": true}'},
            {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{}", "id": "fc_2"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": "rain"},
        ]
    )["messages"]
    assert messages[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"ok": true}'}},
            {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": "{}"}},
        ],
    }
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]


def test_sampling_budget_identity_and_store_false_map_to_chat() -> None:
    chat = chat_of(
        max_output_tokens=40,
        temperature=0.2,
        top_p=0.9,
        user="u-1",
        safety_identifier="s-1",
        store=False,
        stream=False,
        background=False,
        include=[],
        truncation="disabled",
        service_tier="auto",
        metadata={"run": "7"},
        parallel_tool_calls=False,
        reasoning=None,
    )
    assert chat == {
        "model": "demo",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 40,
        "temperature": 0.2,
        "top_p": 0.9,
        "user": "u-1",
        "parallel_tool_calls": False,
    }


@pytest.mark.parametrize(
    ("text", "response_format"),
    [
        ({"format": {"type": "text"}}, None),
        ({}, None),
        ({"format": {"type": "json_object"}}, {"type": "json_object"}),
        (
            {"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA, "strict": True}},
            {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}},
        ),
    ],
)
def test_text_format_is_chats_response_format(text: dict, response_format: dict | None) -> None:
    assert chat_of(text=text).get("response_format") == response_format


def test_flat_function_tools_and_tool_choice_become_chats_nested_ones() -> None:
    chat = chat_of(tools=[WEATHER, {"type": "function", "name": "clock"}], tool_choice="required")
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "weather", "description": "Weather now", "parameters": SCHEMA},
        },
        {"type": "function", "function": {"name": "clock"}},
    ]
    assert chat["tool_choice"] == "required"
    named = chat_of(tools=[WEATHER], tool_choice={"type": "function", "name": "weather"})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert chat_of(tools=[WEATHER], tool_choice="none")["tool_choice"] == "none"


def test_reasoning_is_effort_where_the_model_reads_reasoning_back() -> None:
    translated = to_chat({"model": "m", "input": "x", "reasoning": {"effort": "low"}}, reasoning=True)
    assert translated.chat["reasoning_effort"] == "low"
    assert translated.echo["reasoning"] == {"effort": "low"}
    assert "reasoning_effort" not in chat_of(reasoning={"effort": None, "summary": None})


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "no stored responses"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "no stored responses"),
        ({"input": "x", "store": True}, "store", "no response store"),
        ({"input": "x", "stream": True}, "stream", "streaming"),
        ({"input": "x", "stream": 0}, "stream", "streaming"),  # not False: a number
        ({"input": "x", "background": True}, "background", "background"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include", "extra output"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "stored prompt"),
        ({"input": "x", "truncation": "auto"}, "truncation", "never truncated"),
        ({"input": "x", "top_logprobs": 3}, "top_logprobs", "log probabilities"),
        ({"input": "x", "max_tool_calls": 2}, "max_tool_calls", "one model turn"),
        ({"input": "x", "service_tier": "flex"}, "service_tier", "completion_window"),
        ({"input": "x", "prompt_cache_key": "k"}, "prompt_cache_key", "prefix cache"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type", "'web_search' tools"),
        (
            {"input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]},
            "tools.0.type",
            "only function",
        ),
        (
            {"input": "x", "tools": [{**WEATHER, "defer_loading": True}]},
            "tools.0.defer_loading",
            "not supported",
        ),
        ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "only function"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            "input.0.content.0",
            "only text and image parts",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input.0.content.0",
            "'input_file'",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0", "'reasoning' are not supported"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0", "'item_reference'"),
        (
            {
                "input": [
                    {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}
                ]
            },
            "input.0.output",
            "only text outputs",
        ),
        ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity", "max_output_tokens"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "reasoning_parser"),
    ],
)
def test_what_a_batch_cannot_honour_is_unsupported_naming_the_field(
    body: dict, param: str, says: str
) -> None:
    error = refused(body)
    assert (error.code, error.param) == ("unsupported_parameter", param), error
    assert says in error.message, error.message


def test_reasoning_summaries_are_refused_even_where_reasoning_is_read_back() -> None:
    error = refused({"input": "x", "reasoning": {"effort": "low", "summary": "auto"}}, reasoning=True)
    assert (error.code, error.param) == ("unsupported_parameter", "reasoning.summary")


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({}, "input", "`input` is required"),
        ({"input": ""}, "input", "must not be empty"),
        ({"input": []}, "input", "non-empty array"),
        ({"input": 5}, "input", "`input` is required"),
        ({"input": ["text"]}, "input.0", "must be an object"),
        ({"input": [{"content": "no role"}]}, "input.0", "needs a `role`"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role", "user, system, developer, assistant"),
        ({"input": [{"role": "user", "content": 3}]}, "input.0.content", "string or an array"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input.0.content.0.text",
            "string",
        ),
        ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "input.0.name", "Unrecognized"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input.0.call_id",
            "non-empty",
        ),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input.0.output", "string"),
        ({"input": "x", "instructions": ["a"]}, "instructions", "must be a string"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "positive integer"),
        ({"input": "x", "max_output_tokens": True}, "max_output_tokens", "positive integer"),
        ({"input": "x", "max_output_tokens": "9"}, "max_output_tokens", "positive integer"),
        ({"input": "x", "text": "json"}, "text", "must be an object"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type", "json_schema"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "schema": SCHEMA}}},
            "text.format.name",
            "name",
        ),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}},
            "text.format.schema",
            "schema",
        ),
        ({"input": "x", "text": {"fmt": {}}}, "text.fmt", "Unrecognized"),
        ({"input": "x", "tools": {"name": "f"}}, "tools", "must be an array"),
        ({"input": "x", "tools": [{"name": "f"}]}, "tools.0.type", '"function"'),
        ({"input": "x", "tools": [{**WEATHER, "function": {}}]}, "tools.0.function", "Unrecognized"),
        ({"input": "x", "tool_choice": "any"}, "tool_choice", '"required"'),
        ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice.name", "non-empty"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata", "strings"),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
        ({"input": "x", "user": 5}, "user", "must be a string"),
        ({"input": "x", "store": "no"}, "store", "boolean"),
        ({"input": "x", "reasoning": "high"}, "reasoning", "must be an object"),
        ({"input": "x", "seed": 3}, "seed", "Unrecognized request argument supplied: seed"),
        (
            {"input": [{"role": "user", "content": [{"type": ["input_text"]}]}]},
            "input.0.content.0",
            "content part",
        ),
        ({"input": [{"role": "user", "content": ["text"]}]}, "input.0.content.0", "content part"),
        ({"input": [{"role": ["user"], "content": "x"}]}, "input.0.role", "must be one of"),
        ({"input": "x", "messages": []}, "messages", "Unrecognized request argument"),
        ({"input": "x", "max_tokens": 5}, "max_tokens", "Unrecognized request argument"),
    ],
)
def test_malformed_bodies_are_invalid_naming_the_field(body: dict, param: str, says: str) -> None:
    error = refused(body)
    assert (error.code, error.param) == ("invalid_request", param), error
    assert says in error.message, error.message


def test_chat_errors_are_renamed_to_the_responses_field_they_came_from() -> None:
    translated = to_chat(
        {
            "model": "m",
            "instructions": "sys",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}],
        }
    )
    rename = translated.responses_param
    assert rename("messages.0.content") == "instructions"
    assert rename("messages.1.content.0.text") == "input.0.content.0.text"
    assert rename("messages") == "input"
    assert rename("max_completion_tokens") == "max_output_tokens"
    assert rename("response_format.json_schema.schema") == "text.format"
    assert rename("structured_outputs") == "text.format"
    assert rename("tools.1.function.parameters") == "tools.1.parameters"
    assert rename("tool_choice.function.name") == "tool_choice.name"
    assert rename("reasoning_effort") == "reasoning.effort"
    assert rename("temperature") == "temperature" and rename(None) is None
    error = translated.responses_error(RequestError("invalid_request", "bad", "messages.9"))
    assert (error.code, error.param, error.message) == ("invalid_request", "messages.9", "bad")
    one_string = ResponsesRequest({}, {}, ("input",))
    assert one_string.responses_param("messages.0.content") == "input"


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.text(max_size=6)
    | st.sampled_from(["message", "function_call", "function_call_output", "input_text", "function", "user"]),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["type", "role", "content", "text", "name", "format", "call_id"]) | st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.dictionaries(st.sampled_from(sorted(FIELDS)) | st.text(max_size=5), _json, max_size=6))
def test_any_json_object_is_translated_or_refused_with_a_request_error(body: dict) -> None:
    try:
        translated = to_chat(body, reasoning=True)
    except RequestError as error:
        assert error.code in ("invalid_request", "unsupported_parameter") and error.message
        assert isinstance(error.param, str)  # the field at fault ("" for a key "")
    else:
        assert translated.chat["messages"] and len(translated.origins) <= len(translated.chat["messages"])
        json.dumps(translated.chat)  # plain JSON, as the chat path reads it


def test_prompt_body_is_the_chat_translation_or_none() -> None:
    assert prompt_chat_body({"input": "x", "instructions": "s"}) == {
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]
    }
    assert prompt_chat_body({"input": "x", "reasoning": {"effort": "low"}}) is not None
    assert prompt_chat_body({"input": "x", "store": True}) is None
    assert prompt_chat_body({"input": 3}) is None


# --------------------------------------------------------------------------- Response objects


def chat_body(message: dict, finish_reason: str = "stop", cached: int = 3) -> dict:
    """A chat.completion as vLLM dumps it (the fields Freight's writer reads)."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1_780_000_000,
        "model": "demo",
        "choices": [
            {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish_reason}
        ],
        "usage": {
            "prompt_tokens": 11,
            "completion_tokens": 5,
            "total_tokens": 16,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }


def test_a_text_answer_is_one_output_message_with_usage() -> None:
    echo = to_chat(
        {
            "model": "demo",
            "input": "x",
            "instructions": "s",
            "max_output_tokens": 9,
            "temperature": 0.5,
            "metadata": {"a": "b"},
        }
    ).echo
    body = response_from_chat(chat_body({"content": "Bonjour"}), echo)
    response = Response.model_validate(body)
    assert (
        response.object == "response" and response.status == "completed" and response.id.startswith("resp_")
    )
    assert response.incomplete_details is None and response.model == "demo"
    (item,) = response.output
    assert item.type == "message" and item.id.startswith("msg_") and item.status == "completed"
    assert [part.text for part in item.content] == ["Bonjour"] and response.output_text == "Bonjour"  # type: ignore[union-attr]
    usage = response.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (11, 5, 16)
    assert usage.input_tokens_details.cached_tokens == 3 and usage.output_tokens_details.reasoning_tokens == 0
    assert (response.instructions, response.max_output_tokens, response.temperature) == ("s", 9, 0.5)
    assert response.metadata == {"a": "b"} and response.tools == [] and response.tool_choice == "auto"
    assert response.parallel_tool_calls is True and response.text.format.type == "text"  # type: ignore[union-attr]
    assert json.loads(json.dumps(body)) == body  # plain JSON


def test_a_length_cut_answer_is_incomplete_for_max_output_tokens() -> None:
    response = Response.model_validate(response_from_chat(chat_body({"content": "Bon"}, "length"), {}))
    assert response.status == "incomplete"
    assert (
        response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    )
    assert response.output[0].status == "incomplete"  # type: ignore[union-attr]


def test_tool_calls_are_function_call_items_and_reasoning_comes_first() -> None:
    echo = to_chat({"model": "demo", "input": "x", "tools": [WEATHER], "tool_choice": "required"}).echo
    calls = [
        {"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": '{"ok": true}'}},
        {"id": "call_b", "type": "function", "function": {"name": "weather", "arguments": '{"ok": false}'}},
    ]
    message = {"content": None, "tool_calls": calls, "reasoning": "Two cities."}
    response = Response.model_validate(response_from_chat(chat_body(message, "tool_calls"), echo, 4))
    reasoning, *items = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [c.text for c in reasoning.content or []] == ["Two cities."]  # type: ignore[union-attr]
    assert [(i.type, i.call_id, i.name, i.status) for i in items] == [  # type: ignore[union-attr]
        ("function_call", "call_a", "weather", "completed"),
        ("function_call", "call_b", "weather", "completed"),
    ]
    assert [json.loads(i.arguments) for i in items] == [{"ok": True}, {"ok": False}]  # type: ignore[union-attr]
    assert all(i.id.startswith("fc_") for i in items)  # type: ignore[union-attr]
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == 4
    assert response.tool_choice == "required" and response.tools[0].name == "weather"  # type: ignore[union-attr]
    assert response.status == "completed"


def test_text_beside_calls_is_kept_and_an_empty_answer_is_an_empty_message() -> None:
    call = {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    both = response_from_chat(chat_body({"content": "Let me check.", "tool_calls": [call]}), {})
    assert [item["type"] for item in both["output"]] == ["message", "function_call"]
    only_call = response_from_chat(chat_body({"content": "", "tool_calls": [call]}), {})
    assert [item["type"] for item in only_call["output"]] == ["function_call"]
    empty = Response.model_validate(response_from_chat(chat_body({"content": ""}), {}))
    assert empty.output_text == "" and len(empty.output) == 1


def test_json_schema_format_is_echoed_in_openais_shape() -> None:
    text = {"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA, "strict": True}}
    echo = to_chat({"model": "demo", "input": "x", "text": text}).echo
    response = Response.model_validate(response_from_chat(chat_body({"content": '{"ok": true}'}), echo))
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema" and response.text.format.name == "verdict"  # type: ignore[union-attr]
    assert json.loads(response.output_text) == {"ok": True}
