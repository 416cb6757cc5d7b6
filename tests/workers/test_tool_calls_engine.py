"""Tool calls on the session's real vLLM engine (the demo model with vLLM's hermes parser): every
tool_choice from request body to OpenAI response body, without a stack.

The demo model was never taught hermes-style calls, so "auto" is steered: a regex (structured outputs, which vLLM
allows beside "auto") makes the model write a hermes-style call, which the parser must then read.
"""

from __future__ import annotations

import json

import jsonschema

from tests.workers.test_engine import chat_req, run
from workers.engine import Engine, EngineRequest

CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Lima"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": CITY}}]
HERMES_CALL = r'<tool_call>\{"name": "weather", "arguments": \{"city": "(Oslo|Lima)"\}\}</tool_call>'


def test_every_tool_choice_on_a_model_with_a_parser(vllm_engine: Engine) -> None:
    named = {"type": "function", "function": {"name": "weather"}}
    forced = [  # a tiny model may spend a budget on the whitespace JSON allows: three tries each
        chat_req(f"{kind}-{seed}", tools=TOOLS, tool_choice=choice, max_tokens=120, seed=seed)
        for kind, choice in (("required", "required"), ("named", named))
        for seed in range(3)
    ]
    out = run(
        vllm_engine,
        # the call is 73 characters: room for any tokenization of it, down to one byte a token
        chat_req("auto", tools=TOOLS, structured_outputs={"regex": HERMES_CALL}, max_tokens=96, seed=1),
        chat_req("auto-text", tools=TOOLS, max_tokens=6, ignore_eos=True, seed=2),
        *forced,
        chat_req("none", tools=TOOLS, tool_choice="none", max_tokens=5, ignore_eos=True),
    )
    assert all(result.ok for result in out.values()), {k: r.error for k, r in out.items()}
    choices = {key: result.body["choices"][0] for key, result in out.items()}  # type: ignore[index]

    auto = choices["auto"]
    assert auto["finish_reason"] == "tool_calls" and not auto["message"]["content"], auto
    (call,) = auto["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["function"]["name"] == "weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)

    text = choices["auto-text"]  # no call in the text: it is the content, as without tools
    assert (
        "tool_calls" not in text["message"]
        and text["message"]["content"]
        and text["finish_reason"] == "length"
    )

    for kind, finish in (("required", "tool_calls"), ("named", "stop")):
        called = 0
        for seed in range(3):
            choice = choices[f"{kind}-{seed}"]
            if choice["finish_reason"] == "length":  # cut short: its text stays content, no call
                assert "tool_calls" not in choice["message"] and choice["message"]["content"], choice
                continue
            assert choice["finish_reason"] == finish and choice["message"]["content"] is None, choice
            for call in choice["message"]["tool_calls"]:
                assert call["function"]["name"] == "weather"
                jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)
            called += 1
        assert called, f"no {kind} line finished its call in 120 tokens"

    plain = choices["none"]
    assert "tool_calls" not in plain["message"] and plain["message"]["content"] is not None
    assert out["none"].completion_tokens == 5


def test_responses_lines_on_the_engine_are_response_objects(vllm_engine: Engine) -> None:
    """/v1/responses through the engine: "auto" with the model's parser (text stays the message),
    a forced call as function_call items, the engine's token counts the Response's usage."""
    from openai.types.responses import Response

    tool = {"type": "function", "name": "weather", "parameters": CITY}
    forced = [
        EngineRequest(f"required-{i}", "/v1/responses", {"model": "demo", "input": "Weather?", "tools": [tool],
                      "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 120})
        for i in range(3)
    ]  # fmt: skip
    out = run(
        vllm_engine,
        EngineRequest(
            "auto", "/v1/responses", {"input": "Weather?", "tools": [tool], "max_output_tokens": 6}
        ),
        *forced,
    )
    assert all(result.ok for result in out.values()), {k: r.error for k, r in out.items()}
    responses = {key: Response.model_validate(result.body) for key, result in out.items()}
    for key, response in responses.items():
        usage, result = response.usage, out[key]
        assert usage is not None
        assert (result.prompt_tokens, result.cached_tokens, result.completion_tokens) == (
            usage.input_tokens,
            usage.input_tokens_details.cached_tokens,
            usage.output_tokens,
        )
    auto = responses["auto"]
    assert [item.type for item in auto.output] == ["message"] and auto.tool_choice == "auto"
    assert auto.status in ("completed", "incomplete")
    if auto.status == "incomplete":  # cut by max_output_tokens
        assert auto.incomplete_details.reason == "max_output_tokens" and auto.usage.output_tokens == 6  # type: ignore[union-attr]
    called = [r for key, r in responses.items() if key.startswith("required") and r.status == "completed"]
    assert called, "no forced call finished in 120 tokens"
    for response in called:
        (call,) = response.output
        assert call.type == "function_call" and call.name == "weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), CITY)
