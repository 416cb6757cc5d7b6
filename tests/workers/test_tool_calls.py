"""Tool calls without an engine: the forced-call schema, the rejections, reading calls back (with
vLLM's real hermes parser for tool_choice "auto") and parser names at registration."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from tests.conftest import DEMO_MODEL
from workers.request_bodies import RequestError, parse_body
from workers.tool_calls import ModelParsers, check_parser_names, shape_choice

CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"$ref": "#/$defs/unit"}},
    "required": ["city", "unit"],
    "additionalProperties": False,
    "$defs": {"unit": {"enum": ["c", "f"]}},
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "clock"}},  # no parameters: any JSON object
]
NAMED = {"type": "function", "function": {"name": "weather"}}


def body(**fields: object) -> dict:
    return {
        "model": "demo",
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": copy.deepcopy(TOOLS),
        **fields,
    }


def test_required_schema_is_vllms_array_of_calls() -> None:
    request = parse_body(CHAT, body(tool_choice="required")).request
    schema = request.structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    weather, clock = schema["items"]["anyOf"]
    assert weather["properties"]["name"] == {"type": "string", "enum": ["weather"]}
    assert clock["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert schema["$defs"] == {"unit": {"enum": ["c", "f"]}}  # hoisted, so the $ref resolves
    # the tools the chat template renders keep their own $defs
    assert request.tools[0].function.parameters["$defs"] == WEATHER["$defs"]
    assert request.response_format is None
    jsonschema.validate([{"name": "weather", "parameters": {"city": "Oslo", "unit": "c"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "weather", "parameters": {"city": "Rome", "unit": "c"}}], schema)
    single = parse_body(CHAT, body(tool_choice="required", parallel_tool_calls=False)).request
    assert single.structured_outputs.json["maxItems"] == 1


def test_named_schema_is_the_functions_parameters() -> None:
    assert parse_body(CHAT, body(tool_choice=NAMED)).request.structured_outputs.json == WEATHER
    clock = {"type": "function", "function": {"name": "clock"}}
    assert parse_body(CHAT, body(tool_choice=clock)).request.structured_outputs.json == {
        "type": "object",
        "properties": {},
    }
    # and the sampling parameters carry it to the engine
    params = parse_body(CHAT, body(tool_choice=NAMED)).request.to_sampling_params(8, {})
    assert params.structured_outputs.json == WEATHER


def _deep(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def _tool(name: str, parameters: object) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize(
    ("fields", "code", "param", "message"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "invalid_request",
         "tool_choice.function.name", "'nope' is not a function in `tools` (weather, clock)"),
        ({"tool_choice": "required", "tools": None}, "invalid_request", "tool_choice", "needs at least one"),
        ({"tool_choice": "required", "tools": []}, "invalid_request", "tools", "needs at least one"),
        ({"tool_choice": {"type": "function", "function": {"name": "weather"}}, "tools": None},
         "invalid_request", "tool_choice", "`tools` must be set"),
        ({"tool_choice": {"function": "weather"}}, "invalid_request", "tool_choice", "must be \"none\""),
        ({"tool_choice": "sometimes"}, "invalid_request", "tool_choice", "Invalid value for `tool_choice`"),
        ({"tool_choice": "required", "tools": "weather"}, "invalid_request", "tools", "must be an array"),
        ({"tool_choice": "required", "tools": [{"x": 1}]}, "invalid_request", "tools.0", "must be {"),
        ({"tool_choice": "required", "tools": [_tool("", None)]}, "invalid_request",
         "tools.0.function.name", "non-empty string"),
        ({"tool_choice": "required", "tools": [_tool("f", "object")]}, "invalid_request",
         "tools.0.function.parameters", "must be a JSON schema object"),
        ({"tool_choice": "required", "tools": [_tool("f", None), _tool("f", None)]}, "invalid_request",
         "tools.1.function.name", "given twice"),
        ({"tool_choice": "required", "tools": [_tool("f", None), _tool("g", _deep(70))]}, "invalid_request",
         "tools.1.function.parameters", "nested too deeply"),
        ({"tool_choice": "required", "tools": [_tool("f", {"$defs": {"a": {"type": "string"}}}),
                                              _tool("g", {"$defs": {"a": {"type": "integer"}}})]},
         "invalid_request", "tools", "'a' has multiple schemas"),
        ({"tool_choice": "required", "tools": [_tool("f", {"$defs": 5})]}, "invalid_request",
         "tools.0.function.parameters", "not a valid JSON Schema (at $defs)"),
        ({"tool_choice": "required", "tools": [_tool("f", {"type": "object", "properties": {"a": {"type": 5}}})]},
         "invalid_request", "tools.0.function.parameters", "not a valid JSON Schema (at properties.a.type)"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}, "tools": [_tool("f", {"required": "a"})]},
         "invalid_request", "tools.0.function.parameters", "not a valid JSON Schema (at required)"),
        ({"tool_choice": NAMED, "response_format": {"type": "json_object"}}, "invalid_request",
         "response_format", "cannot be combined with a forced tool call"),
        ({"tool_choice": "required", "structured_outputs": {"regex": "a+"}}, "invalid_request",
         "structured_outputs", "cannot be combined with a forced tool call"),
        ({"tool_choice": "auto"}, "unsupported_parameter", "tool_choice", "names none"),
        ({}, "unsupported_parameter", "tool_choice", "needs a tool-call parser"),  # tools alone: auto
    ],
)  # fmt: skip
def test_bad_tool_requests_name_the_field(fields: dict, code: str, param: str, message: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_body(CHAT, body(**fields))
    assert (info.value.code, info.value.param) == (code, param), info.value
    assert message in info.value.message


def test_auto_passes_where_the_model_has_a_parser_and_none_stays_as_it_was() -> None:
    # only forced calls compile the schema: under auto and none it is only rendered into the prompt
    loose = [_tool("f", {"type": 5})]
    assert parse_body(CHAT, body(tools=loose, tool_choice="none")).request.tools
    assert parse_body(CHAT, body(tools=loose), auto_tools=True).request.tools
    request = parse_body(CHAT, body(), auto_tools=True).request
    assert request.tool_choice == "auto" and request.structured_outputs is None
    with pytest.raises(RequestError, match="temperature"):  # the rest is still checked
        parse_body(CHAT, body(temperature=-1), auto_tools=True)
    plain = parse_body(CHAT, body(tool_choice="none")).request
    assert plain.tools and plain.structured_outputs is None
    assert shape_choice(plain, "text", "stop") is None  # no tool calling: the text is the content


def test_forced_calls_are_read_back_in_openais_shape() -> None:
    required = parse_body(CHAT, body(tool_choice="required")).request
    text = '[{"name": "weather", "parameters": {"city": "Oslo", "unit": "c"}}, {"name": "clock", "parameters": {}}]'
    shaped = shape_choice(required, text, "stop")
    assert shaped is not None and shaped.content is None and shaped.finish_reason == "tool_calls"
    assert [c["function"]["name"] for c in shaped.tool_calls] == ["weather", "clock"]
    for call in shaped.tool_calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    jsonschema.validate(json.loads(shaped.tool_calls[0]["function"]["arguments"]), WEATHER)
    assert len({c["id"] for c in shaped.tool_calls}) == 2

    named = parse_body(CHAT, body(tool_choice=NAMED)).request
    shaped = shape_choice(named, ' {"city": "Paris", "unit": "f"}', "stop")
    assert shaped is not None and shaped.finish_reason == "stop"  # vLLM's (and OpenAI's) for a named call
    (call,) = shaped.tool_calls
    assert call["function"]["name"] == "weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)


def test_a_cut_short_forced_call_keeps_its_text_and_hands_out_no_arguments() -> None:
    named = parse_body(CHAT, body(tool_choice=NAMED)).request
    shaped = shape_choice(named, '{"city": "Par', "length")
    assert shaped is not None and shaped.tool_calls == [] and shaped.content == '{"city": "Par'
    assert shaped.finish_reason == "length"
    required = parse_body(CHAT, body(tool_choice="required")).request
    for text in ("[", "[]", '[{"name": "weather"}]', '{"name": "weather", "parameters": {}}'):
        shaped = shape_choice(required, text, "length")
        assert shaped is not None and shaped.tool_calls == [] and shaped.content == text


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    required = parse_body(CHAT, body(tool_choice="required", parallel_tool_calls=False)).request
    text = '[{"name": "clock", "parameters": {}}, {"name": "clock", "parameters": {}}]'
    shaped = shape_choice(required, text, "stop")
    assert shaped is not None and len(shaped.tool_calls) == 1


@pytest.fixture(scope="module")
def hermes() -> ModelParsers:
    from vllm.config import ModelConfig
    from vllm.tokenizers import get_tokenizer

    parsers = ModelParsers.load(
        "hermes", None, get_tokenizer(str(DEMO_MODEL)), ModelConfig(model=str(DEMO_MODEL))
    )
    assert parsers is not None
    return parsers


def test_auto_reads_calls_with_vllms_hermes_parser(hermes: ModelParsers) -> None:
    request = parse_body(CHAT, body(), auto_tools=True).request
    hermes.adjust(request)
    assert request.skip_special_tokens is False  # hermes reads its <tool_call> tags back
    assert request.structured_outputs is None  # auto: nothing forced
    text = (
        'Checking.<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    )
    shaped = shape_choice(request, text, "stop", hermes.new(request))
    assert shaped is not None and shaped.content == "Checking." and shaped.finish_reason == "tool_calls"
    (call,) = shaped.tool_calls
    assert call["id"].startswith("call_") and call["function"]["name"] == "weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    plain = shape_choice(request, "No tool needed.", "stop", hermes.new(request))
    assert plain is not None and (plain.content, plain.tool_calls, plain.finish_reason) == (
        "No tool needed.",
        [],
        "stop",
    )


def test_a_forced_call_keeps_freights_schema_under_a_parser(hermes: ModelParsers) -> None:
    request = parse_body(CHAT, body(tool_choice="required"), auto_tools=True).request
    schema = request.structured_outputs.json
    hermes.adjust(request)
    assert request.structured_outputs.json == schema
    assert request.tools[0].function.parameters["$defs"] == WEATHER["$defs"]  # not popped by vLLM
    text = '[{"name": "weather", "parameters": {"city": "Oslo", "unit": "c"}}]'
    shaped = shape_choice(request, text, "stop", hermes.new(request))
    assert shaped is not None and shaped.finish_reason == "tool_calls" and len(shaped.tool_calls) == 1


def test_parser_names_are_checked_against_vllms_registries() -> None:
    check_parser_names("hermes", "qwen3")
    check_parser_names(None, None)
    with pytest.raises(
        ValueError,
        match=r"--tool-call-parser: vLLM has no tool-call parser 'hermez' \(did you mean hermes\?\)",
    ):
        check_parser_names("hermez")
    with pytest.raises(ValueError, match="engine arg reasoning_parser: vLLM has no reasoning parser 'nope'"):
        check_parser_names("hermes", "nope")


def test_validation_fails_a_bad_tool_line_and_runs_auto_where_the_model_has_a_parser() -> None:
    from tests.factories import chat_line
    from workers.validation import FileRules, LineError, check_line

    rules = FileRules(CHAT, frozenset({"demo", "qwen"}), 50, 1 << 16, auto_tool_models=frozenset({"qwen"}))

    def line(model: str, **fields: object) -> bytes:
        return json.dumps(chat_line("r1", "hi", model=model, tools=TOOLS, **fields)).encode()

    bad = check_line(line("demo", tool_choice={"type": "function", "function": {"name": "nope"}}), 4, rules)
    assert isinstance(bad, LineError) and (bad.line, bad.code) == (4, "invalid_request")
    assert bad.param == "body.tool_choice.function.name" and "'nope' is not a function" in bad.message
    # well formed: "auto" without a parser is that request's 400 at run time, not a failed file
    assert not isinstance(check_line(line("demo"), 5, rules), LineError)
    # with a parser it is checked in full here: a bad field in it fails the file
    wrong = check_line(line("qwen", temperature=-1), 6, rules)
    assert isinstance(wrong, LineError) and wrong.param == "body.temperature"
    assert not isinstance(check_line(line("qwen"), 7, rules), LineError)


def test_a_reasoning_parser_alone_splits_message_reasoning_out_and_serves_no_auto() -> None:
    """A model registered with only a `reasoning_parser` engine arg: its answers' reasoning goes to
    `message.reasoning` as `vllm serve` puts it there, and "auto" stays a per-line 400."""
    from vllm.config import ModelConfig
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import SamplingParams
    from vllm.tokenizers import get_tokenizer

    from workers.rendering import RenderedRequest, build_response_body

    tokenizer = get_tokenizer(str(DEMO_MODEL))
    parsers = ModelParsers.load(None, "qwen3", tokenizer, ModelConfig(model=str(DEMO_MODEL)))
    assert parsers is not None and (parsers.auto_tools, parsers.reasoning) == (False, True)
    with pytest.raises(RequestError, match="tool-call parser"):
        parse_body(CHAT, body(tool_choice="auto"), auto_tools=parsers.auto_tools)
    asked = {"model": "demo", "messages": [{"role": "user", "content": "Capital of Norway?"}]}
    parsed = parse_body(CHAT, asked, reasoning=parsers.reasoning)
    parsers.adjust(parsed.request)
    text = "<think>Norway's capital.</think>Oslo."
    answer = CompletionOutput(
        0, text, tokenizer.encode(text, add_special_tokens=False), None, None, finish_reason="stop"
    )
    body_out = build_response_body(
        RenderedRequest(parsed, {}, [1, 2, 3], SamplingParams()),
        RequestOutput("r1", None, [1, 2, 3], None, [answer], True),
        model="demo",
        tokenizer=tokenizer,
        parsers=parsers,
    )
    (choice,) = body_out["choices"]
    message = choice["message"]
    assert (message["reasoning"], message["content"]) == ("Norway's capital.", "Oslo.")
    assert not message.get("tool_calls")
    assert choice["finish_reason"] == "stop"
    assert ModelParsers.load(None, None, tokenizer, None) is None  # neither parser: text as it is
