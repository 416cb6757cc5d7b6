"""parse_body: OpenAI bodies validated with vLLM's own request models (pure: no engine)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.request_bodies import ENDPOINTS, ParsedRequest, RequestError, parse_body

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo ✓"}]


def chat(**fields: object) -> dict:
    return {"model": "demo", "messages": copy.deepcopy(MESSAGES), **fields}


def completion(**fields: object) -> dict:
    return {"model": "demo", "prompt": "Once upon a time", **fields}


def test_endpoints() -> None:
    assert ENDPOINTS == (
        CHAT,
        COMPLETIONS,
        EMBEDDINGS,
        "/v1/responses",
        "/v1/score",
        "/v1/rerank",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
    )


def test_valid_chat_body_parses() -> None:
    parsed = parse_body(CHAT, chat(max_tokens=8, temperature=0.2, top_p=0.9, n=2, seed=7, stop=["\n"]))
    assert isinstance(parsed, ParsedRequest)
    assert (parsed.endpoint, parsed.model, parsed.max_tokens, parsed.n) == (CHAT, "demo", 8, 2)
    assert parsed.is_chat
    assert parsed.request.temperature == 0.2
    assert [m["role"] for m in parsed.request.messages] == ["system", "user"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.model = "other"  # type: ignore[misc]


def test_max_completion_tokens_wins_and_absent_means_default() -> None:
    assert parse_body(CHAT, chat(max_tokens=8, max_completion_tokens=5)).max_tokens == 5
    assert parse_body(CHAT, chat()).max_tokens is None
    # CompletionRequest defaults max_tokens to 16; Freight uses its own default instead
    assert parse_body(COMPLETIONS, completion()).max_tokens is None
    assert parse_body(COMPLETIONS, completion(max_tokens=None)).max_tokens is None
    assert parse_body(COMPLETIONS, completion(max_tokens=3)).max_tokens == 3


@pytest.mark.parametrize(
    "prompt, expected",
    [("text", "text"), (["text"], "text"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5])],
)
def test_completion_prompt_forms(prompt: object, expected: object) -> None:
    assert parse_body(COMPLETIONS, completion(prompt=prompt)).request.prompt == expected


def test_vllm_extras_and_structured_outputs_parse() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    parsed = parse_body(
        CHAT,
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
            ignore_eos=True,
            min_tokens=2,
            max_tokens=4,
            logprobs=True,
            top_logprobs=3,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
        ),
    )
    assert parsed.request.ignore_eos and parsed.request.min_tokens == 2
    params = parsed.request.to_sampling_params(4, {})
    assert params.structured_outputs is not None and params.logprobs == 3
    assert parse_body(CHAT, chat(response_format={"type": "json_object"})).request.response_format


def test_tools_with_tool_choice_none_reach_the_template() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    assert parse_body(CHAT, chat(tools=tools, tool_choice="none")).request.tools


def test_parse_does_not_mutate_the_body() -> None:
    body = chat(messages=[{"role": "assistant", "content": "x", "reasoning_content": "r"}, *MESSAGES])
    before = copy.deepcopy(body)
    parse_body(CHAT, body)
    assert body == before


def test_false_spellings_of_stream_are_accepted() -> None:
    assert parse_body(CHAT, chat(stream=False)).request.stream is False
    assert parse_body(CHAT, chat(stream="false")).request.stream is False


def test_text_content_parts_are_accepted() -> None:
    body = chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    assert parse_body(CHAT, body).request.messages


@pytest.mark.parametrize(
    "endpoint, body, code, param",
    [
        (CHAT, chat(temperature="hot"), "invalid_request", "temperature"),
        (CHAT, chat(temperature=5), "invalid_request", "temperature"),
        (CHAT, chat(top_p=0), "invalid_request", "top_p"),
        (CHAT, chat(presence_penalty=3), "invalid_request", "presence_penalty"),
        (CHAT, chat(n=0), "invalid_request", "n"),
        (CHAT, chat(n=1000), "invalid_request", "n"),
        (CHAT, chat(max_tokens=-1), "invalid_request", "max_tokens"),
        (CHAT, chat(max_completion_tokens=0), "invalid_request", "max_tokens"),
        (CHAT, chat(max_tokens="many"), "invalid_request", "max_tokens"),
        (CHAT, chat(min_tokens=10, max_tokens=5), "invalid_request", "min_tokens"),
        (CHAT, chat(stop=5), "invalid_request", "stop"),
        (CHAT, chat(stop=[""]), "invalid_request", "stop"),
        (CHAT, chat(seed=2**70), "invalid_request", "seed"),
        (CHAT, chat(top_logprobs=3), "invalid_request", "top_logprobs"),
        (CHAT, chat(logit_bias={"1": "x"}), "invalid_request", "logit_bias.1"),
        (CHAT, chat(response_format={"type": "json_schema"}), "invalid_request", "response_format"),
        (CHAT, chat(response_format={"type": "xml"}), "invalid_request", "response_format.type"),
        (CHAT, chat(model=5), "invalid_request", "model"),
        (CHAT, {"model": "demo"}, "invalid_request", "messages"),
        (CHAT, chat(messages=[]), "invalid_request", "messages"),
        (CHAT, chat(messages="hi"), "invalid_request", "messages"),
        (CHAT, chat(messages=["hi"]), "invalid_request", "messages.0"),
        (CHAT, chat(messages=[{"role": "user"}]), "invalid_request", "messages.0.content"),
        (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), "invalid_request", "messages.0.role"),
        (CHAT, chat(messages=[{"role": "user", "content": 5}]), "invalid_request", "messages.0.content"),
        (
            CHAT,
            chat(
                messages=[
                    {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}
                ]
            ),
            "unsupported_parameter",
            "messages.0.content.0",
        ),
        (  # image parts are workers/images.py's (tests/workers/test_images.py); their shape is checked here
            CHAT,
            chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}]),
            "invalid_request",
            "messages.0.content.0.image_url",
        ),
        (CHAT, chat(stream=True), "unsupported_parameter", "stream"),
        (CHAT, chat(stream="true"), "unsupported_parameter", "stream"),
        (CHAT, chat(use_beam_search=True), "unsupported_parameter", "use_beam_search"),
        (CHAT, chat(chat_template="{{ 1 }}"), "unsupported_parameter", "chat_template"),
        (
            CHAT,
            chat(chat_template_kwargs={"chat_template": "{{ 1 }}"}),
            "unsupported_parameter",
            "chat_template_kwargs.chat_template",
        ),
        (CHAT, chat(priority=1), "unsupported_parameter", "priority"),
        (
            CHAT,
            chat(tools=[{"type": "function", "function": {"name": "f"}}]),
            "unsupported_parameter",
            "tool_choice",
        ),
        (CHAT, chat(tool_choice={"function": {"name": "f"}}, tools=[{"x": 1}]), "invalid_request", "tools.0"),
        (CHAT, chat(kv_transfer_params={"a": 1}), "unsupported_parameter", "kv_transfer_params"),
        (COMPLETIONS, {"model": "demo"}, "invalid_request", "prompt"),
        (COMPLETIONS, completion(prompt=""), "invalid_request", "prompt"),
        (COMPLETIONS, completion(prompt=[]), "invalid_request", "prompt"),
        (COMPLETIONS, completion(prompt=["a", "b"]), "unsupported_parameter", "prompt"),
        (COMPLETIONS, completion(prompt=[-1, 2]), "invalid_request", "prompt"),
        (COMPLETIONS, completion(prompt=[1, "a"]), "invalid_request", "prompt"),
        (COMPLETIONS, completion(suffix="end"), "unsupported_parameter", "suffix"),
        (COMPLETIONS, completion(logprobs=-5), "invalid_request", "logprobs"),
        (COMPLETIONS, completion(prompt_embeds="AAAA"), "unsupported_parameter", "prompt_embeds"),
        (COMPLETIONS, completion(stream=True), "unsupported_parameter", "stream"),
        ("/v1/moderations", {"model": "demo", "input": "x"}, "invalid_request", "url"),
        (CHAT, ["not", "a", "dict"], "invalid_request", "body"),
        (CHAT, chat(temperature=float("nan")), "invalid_request", "body"),
    ],
)
def test_bad_bodies_name_the_parameter(endpoint: str, body: object, code: str, param: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_body(endpoint, body)  # type: ignore[arg-type]
    err = info.value
    assert (err.code, err.param, err.status_code) == (code, param, 400)
    assert err.message and len(err.message) <= 1010
    assert err.to_dict() == {"code": code, "message": err.message, "param": param}


def test_request_error_defaults() -> None:
    err = RequestError("invalid_request", "nope")
    assert (err.code, err.message, err.param, err.status_code, str(err)) == (
        "invalid_request",
        "nope",
        None,
        400,
        "nope",
    )


# JSON-like values, biased towards the fields the request models know about.
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_fields = st.sampled_from(
    [
        "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
        "stop", "seed", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "stream",
        "stream_options", "echo", "logit_bias", "min_tokens", "ignore_eos", "structured_outputs",
        "chat_template_kwargs", "prompt_logprobs", "truncate_prompt_tokens", "cache_salt", "suffix",
        "add_generation_prompt", "continue_final_message", "bad_words", "allowed_token_ids", "priority",
        "input", "instructions", "max_output_tokens", "text", "reasoning", "store", "include",
    ]
)  # fmt: skip
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | _json},
    optional={"content": st.text(max_size=10) | _json, "tool_calls": _json, "name": _json},
)
_bodies = st.dictionaries(_fields | st.text(max_size=5), _json, max_size=6) | st.builds(
    lambda base, extra: {**base, **extra},
    st.fixed_dictionaries(
        {"messages": st.lists(_message, max_size=3), "prompt": st.text(max_size=10) | _json}
    ),
    st.dictionaries(_fields, _json, max_size=5),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(endpoint=st.sampled_from([*ENDPOINTS, "/v1/other"]), body=_bodies | _json)
def test_parse_body_raises_only_request_error(endpoint: str, body: object) -> None:
    try:
        parsed = parse_body(endpoint, body)  # type: ignore[arg-type]
    except RequestError as err:
        assert isinstance(err.code, str) and isinstance(err.message, str)
        assert err.param is None or isinstance(err.param, str)
    else:
        assert isinstance(parsed, ParsedRequest) and parsed.endpoint == endpoint


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (CHAT, chat(max_tokens=8, temperature=0.2, top_p=0.9, n=2, seed=7, stop=["\n"])),
        (
            CHAT,
            chat(
                max_completion_tokens=5,
                logprobs=True,
                top_logprobs=2,
                response_format={"type": "json_object"},
            ),
        ),
        (COMPLETIONS, completion(prompt=["Once upon"], max_tokens=4, echo=True, logprobs=1)),
        (COMPLETIONS, completion(prompt=[5, 6, 7])),
    ],
)
def test_a_validated_body_parses_to_the_same_request(endpoint: str, body: dict) -> None:
    # the worker's path (validated=True) must see exactly what validation saw
    full = parse_body(endpoint, copy.deepcopy(body))
    fast = parse_body(endpoint, copy.deepcopy(body), validated=True)
    assert (fast.endpoint, fast.model, fast.max_tokens, fast.n) == (
        full.endpoint,
        full.model,
        full.max_tokens,
        full.n,
    )
    assert fast.request.model_dump(exclude={"request_id"}) == full.request.model_dump(exclude={"request_id"})


def test_a_validated_body_leaves_the_sampling_check_to_rendering() -> None:
    body = chat(max_tokens=4, min_tokens=9)  # vLLM's SamplingParams refuses min_tokens > max_tokens
    with pytest.raises(RequestError) as err:
        parse_body(CHAT, copy.deepcopy(body))
    assert err.value.code == "invalid_request"
    # a body that reached the worker passed that check at validation; render_request repeats it
    assert parse_body(CHAT, body, validated=True).max_tokens == 4


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_refused_lines_stored_body_raises_its_error_on_every_endpoint(endpoint: str) -> None:
    """What validation stores for a line it refused alone (a model not served here) is that
    line's error when it runs: on each endpoint's path (parse_body for embeddings, scoring and
    audio; ParsedShapes for chat, completions and Responses), never a request."""
    from workers.request_bodies import refused_line_json
    from workers.request_shapes import ParsedShapes

    stored = refused_line_json("model_not_found", "model 'gpt-9' is not served here", "model")
    for parse in (parse_body, ParsedShapes().parse):
        with pytest.raises(RequestError) as raised:
            parse(endpoint, json.loads(stored), validated=True)
        error = raised.value
        assert (error.code, error.param, error.status_code) == ("model_not_found", "model", 400)
        assert error.message == "model 'gpt-9' is not served here"
    # a tenant's body holding the field is an unknown field, as any misspelt parameter
    with pytest.raises(RequestError) as tenants:
        parse_body(CHAT, chat(**json.loads(stored)))
    assert (tenants.value.code, tenants.value.param) == ("invalid_request", "x_freight_refused")
