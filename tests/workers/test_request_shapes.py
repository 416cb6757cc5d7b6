"""The shape cache (workers/request_shapes.py) agrees with the full path on every body: same
acceptance, same output budget, same error code, message and param, whatever bodies of the same
or another shape came before it (issue #21, section 1)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.request_bodies import CHAT, COMPLETIONS, RequestError, parse_body, sampling_params_of
from workers.request_shapes import MAX_KEY_CHARS, ParsedShapes, RequestShapes, shape_key
from workers.responses import RESPONSES
from workers.validation import FileRules, check_line

TEXT = st.text(max_size=12)
WORDS = st.text(min_size=1, max_size=12)
FLOAT = st.floats(-3, 3, allow_nan=False)
PARAMS: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.one_of(FLOAT, st.just("hot")),
    "top_p": st.one_of(st.floats(-0.5, 1.5, allow_nan=False), st.just([])),
    "max_tokens": st.one_of(st.integers(-5, 3_000_000), st.just("4"), st.just(2.5)),
    "max_completion_tokens": st.integers(-1, 64),
    "n": st.integers(-1, 200),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=5), st.just(7)),
    "seed": st.integers(-(2**64), 2**64),
    "stream": st.sampled_from([False, True, "true"]),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 30)),
    "top_logprobs": st.integers(-1, 30),
    "presence_penalty": FLOAT,
    "min_tokens": st.integers(-1, 20),
    "response_format": st.sampled_from(
        [{"type": "json_object"}, {"type": "text"}, "json", {"type": "json_schema"}]
    ),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
    "priority": st.sampled_from([0, 1]),
    "cache_salt": TEXT,
    "misspelt_parameter": st.integers(),
}


RESPONSES_PARAMS: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.one_of(FLOAT, st.just("hot")),
    "max_output_tokens": st.one_of(st.integers(-1, 3_000_000), st.just("4")),
    "text": st.sampled_from(
        [
            {"format": {"type": "json_object"}},
            {"format": {"type": "text"}},
            "json",
            {"format": {"type": "json_schema"}},
        ]
    ),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
    "store": st.sampled_from([False, True, "no"]),
    "stream": st.sampled_from([False, True]),
    "metadata": st.sampled_from([{"k": "v"}, {"k": 1}]),
    "seed": st.integers(0, 9),  # not a Responses field
}


@st.composite
def responses_pair(draw: st.DrawFn) -> tuple[dict, dict]:
    """Two Responses bodies alike in everything but their texts (instructions, input, messages)."""
    fields = draw(
        st.one_of(
            st.just({}), st.dictionaries(st.sampled_from(sorted(RESPONSES_PARAMS)), st.none(), max_size=3)
        )
    )
    params = {name: draw(RESPONSES_PARAMS[name]) for name in fields}
    if draw(st.booleans()):
        params["instructions"], other_instructions = draw(text_pair())
    bodies: list[dict] = [{"model": "demo", **params}, {"model": "demo", **params}]
    if "instructions" in params:
        bodies[1]["instructions"] = other_instructions
    if draw(st.booleans()):
        bodies[0]["input"], bodies[1]["input"] = draw(text_pair())
        return bodies[0], bodies[1]
    items: tuple[list[Any], list[Any]] = ([], [])
    for _ in range(draw(st.integers(0, 3))):
        role = draw(st.sampled_from(["system", "user", "developer", "assistant", "tool"]))
        kind = draw(st.sampled_from(["text", "parts", "call", "number"]))
        typed = {"type": "message"} if draw(st.booleans()) else {}
        part_type = draw(
            st.sampled_from(["output_text" if role == "assistant" else "input_text", "input_image"])
        )
        for item_list, text in zip(items, draw(text_pair()), strict=True):
            if kind == "text":
                item_list.append({**typed, "role": role, "content": text})
            elif kind == "parts":
                item_list.append({**typed, "role": role, "content": [{"type": part_type, "text": text}]})
            elif kind == "call":
                item_list.append({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"})
            else:
                item_list.append({**typed, "role": role, "content": 5})
    return {**bodies[0], "input": items[0]}, {**bodies[1], "input": items[1]}


@st.composite
def text_pair(draw: st.DrawFn) -> tuple[str, str]:
    """Two texts for one slot, empty ones often: empty and non-empty meet in every combination."""
    maybe_empty = st.one_of(st.just(""), TEXT)
    return draw(maybe_empty), draw(maybe_empty)


@st.composite
def body_pair(draw: st.DrawFn, endpoint: str) -> tuple[dict, dict]:
    """Two bodies alike in everything but their texts."""
    # half the bodies have no parameter beyond the text: most of those are valid requests
    fields = draw(
        st.one_of(st.just({}), st.dictionaries(st.sampled_from(sorted(PARAMS)), st.none(), max_size=3))
    )
    params = {name: draw(PARAMS[name]) for name in fields}
    model = draw(st.sampled_from(["demo", "demo", "demo", "", 3]))
    if endpoint == RESPONSES:
        return draw(responses_pair())
    if endpoint == CHAT:
        first: list[Any] = []
        second: list[Any] = []
        for _ in range(draw(st.integers(0, 3))):
            role = draw(st.sampled_from(["system", "user", "assistant", "tool", "robot"]))
            kind = draw(st.sampled_from(["text", "text", "parts", "none", "number"]))
            a, b = draw(text_pair())
            extra = {"name": draw(TEXT)} if draw(st.booleans()) else {}
            if kind == "text":
                first.append({"role": role, "content": a, **extra})
                second.append({"role": role, "content": b, **extra})
            elif kind == "parts":
                part_type = draw(st.sampled_from(["text", "text", "image_url"]))
                first.append({"role": role, "content": [{"type": part_type, "text": a}], **extra})
                second.append({"role": role, "content": [{"type": part_type, "text": b}], **extra})
            else:
                content = None if kind == "none" else 5
                first.append({"role": role, "content": content, **extra})
                second.append({"role": role, "content": content, **extra})
        return {"model": model, "messages": first, **params}, {"model": model, "messages": second, **params}
    kind = draw(st.sampled_from(["text", "text", "ids", "listed"]))
    a, b = draw(text_pair())
    if kind == "ids":
        ids = draw(st.lists(st.integers(-1, 50_000), max_size=6))
        a_prompt: Any = ids
        b_prompt: Any = ids
    elif kind == "listed":
        a_prompt, b_prompt = [a], [b]
    else:
        a_prompt, b_prompt = a, b
    return {"model": model, "prompt": a_prompt, **params}, {"model": model, "prompt": b_prompt, **params}


def full(endpoint: str, body: dict) -> tuple:
    try:
        return ("accepted", parse_body(endpoint, body).max_tokens)
    except RequestError as exc:
        return ("refused", exc.code, exc.message, exc.param)


def fast(shapes: RequestShapes, endpoint: str, body: dict) -> tuple:
    try:
        return ("accepted", shapes.max_tokens(endpoint, body))
    except RequestError as exc:
        return ("refused", exc.code, exc.message, exc.param)


SHARED = RequestShapes(max_shapes=64)  # lives across examples: earlier bodies' shapes are in it
# the fast and full paths compared on 300 generated examples, the same ones every run
AGREEMENT = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@AGREEMENT
@given(endpoint=st.sampled_from([CHAT, COMPLETIONS, RESPONSES]), data=st.data())
def test_the_shape_cache_and_the_full_path_agree(endpoint: str, data: st.DataObject) -> None:
    first, second = data.draw(body_pair(endpoint))
    shapes = RequestShapes()
    assert fast(shapes, endpoint, first) == full(endpoint, first)
    assert fast(shapes, endpoint, second) == full(endpoint, second)  # after its shape-mate
    assert fast(SHARED, endpoint, second) == full(endpoint, second)
    assert fast(SHARED, endpoint, first) == full(endpoint, first)


def test_lines_of_one_shape_are_parsed_once_and_texts_do_not_matter() -> None:
    shapes = RequestShapes()
    for i in range(50):
        body = {"model": "demo", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 7}
        assert shapes.max_tokens(CHAT, body) == 7
    assert (shapes.misses, shapes.hits) == (1, 49)
    # an empty text is another shape: the full path decides it
    prompt = {"model": "demo", "prompt": "a prompt", "max_tokens": 7}
    empty = {**prompt, "prompt": ""}
    assert fast(shapes, COMPLETIONS, prompt) == ("accepted", 7)
    for _ in range(2):
        assert fast(shapes, COMPLETIONS, empty) == full(COMPLETIONS, empty)
        assert full(COMPLETIONS, empty)[:2] == ("refused", "invalid_request")
    assert shapes.misses == 4  # a refused shape is never remembered


def test_responses_lines_of_one_shape_are_parsed_once() -> None:
    shapes = RequestShapes()
    for i in range(20):
        body = {
            "model": "demo",
            "instructions": f"Document {i}",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": f"question {i}"}]}],
            "max_output_tokens": 5,
        }
        assert shapes.max_tokens(RESPONSES, body) == 5
    assert (shapes.misses, shapes.hits) == (1, 19)
    empty = {"model": "demo", "instructions": "", "input": "q", "max_output_tokens": 5}
    assert fast(shapes, RESPONSES, empty) == full(RESPONSES, empty) == ("accepted", 5)
    assert shapes.misses == 2  # no instructions: one message fewer, another shape


def test_shapes_that_are_long_or_unwritable_are_not_remembered() -> None:
    long_ids = {"model": "demo", "prompt": list(range(MAX_KEY_CHARS)), "max_tokens": 1}
    assert shape_key(COMPLETIONS, long_ids) is None
    huge = {"model": "demo", "prompt": "x", "seed": 10**5000}
    assert shape_key(COMPLETIONS, huge) is None  # more digits than int -> str allows
    shapes = RequestShapes(max_shapes=2)
    for n in range(1, 5):
        shapes.max_tokens(COMPLETIONS, {"model": "demo", "prompt": "p", "max_tokens": n})
    assert len(shapes._accepted) == 2  # least recently used went first


def test_a_file_validates_with_its_own_shape_cache() -> None:
    """check_line goes through the file's cache: the second line of a shape is a hit, and an error
    line is the full path's (here: the line's own number and message)."""
    rules = FileRules(CHAT, frozenset({"demo"}), max_requests=10, max_line_bytes=10_000)
    good = b'{"custom_id":"a%d","method":"POST","url":"/v1/chat/completions","body":{"model":"demo","messages":[{"role":"user","content":"q%d"}],"max_tokens":3}}'
    bad = b'{"custom_id":"b","method":"POST","url":"/v1/chat/completions","body":{"model":"demo","messages":[{"role":"user","content":"q"}],"max_tokens":3,"temperature":-1}}'
    first, second = check_line(good % (1, 1), 1, rules), check_line(good % (2, 2), 2, rules)
    assert first.row.max_tokens == second.row.max_tokens == 3  # type: ignore[union-attr]
    assert (rules.shapes.misses, rules.shapes.hits) == (1, 1)
    refused = check_line(bad, 3, rules)
    assert refused.line == 3 and refused.code == "invalid_request" and "temperature" in refused.message  # type: ignore[union-attr]
    assert FileRules(CHAT, frozenset({"demo"}), 10, 10_000).shapes is not rules.shapes


# ------------------------------------------------------------------ the engine's parse (ParsedShapes)


def fresh(body: dict) -> dict:
    """The body as the engine gets it: decoded afresh from the request store."""
    return json.loads(json.dumps(body))


def parsed_view(parse: Any) -> tuple:
    """Everything of a parse the engine uses, but the request id (unique per parse)."""
    try:
        parsed = parse()
    except RequestError as exc:
        return ("refused", exc.code, exc.message, exc.param)
    request = parsed.request
    try:
        sampling = repr(sampling_params_of(request, parsed.max_tokens or 16, {"temperature": 0.7}))
    except RequestError as exc:
        sampling = ("refused", exc.code, exc.message, exc.param)
    dump = request.model_dump(exclude={"request_id"})
    return ("accepted", parsed.endpoint, parsed.model, parsed.max_tokens, parsed.responses, dump, sampling)


@st.composite
def reusable_pair(draw: st.DrawFn) -> tuple[dict, dict]:
    """Two chat bodies alike but for their texts, mostly valid (so most second bodies reuse the
    first's parse), of fields a reused parse may hold and now and then one it may not."""
    messages: tuple[list[dict], list[dict]] = ([], [])
    for _ in range(draw(st.integers(1, 3))):
        role = draw(st.sampled_from(["system", "user", "user", "assistant", "developer"]))
        parts = draw(st.booleans())
        extra = {"name": draw(TEXT)} if draw(st.integers(0, 4)) == 0 else {}
        texts = draw(st.one_of(text_pair(), st.tuples(WORDS, WORDS), st.tuples(WORDS, WORDS)))
        for message_list, text in zip(messages, texts, strict=True):
            content: Any = [{"type": "text", "text": text}] if parts else text
            message_list.append({"role": role, "content": content, **extra})
    scalars = {
        "max_tokens": st.integers(1, 64),
        "temperature": st.floats(0, 2, allow_nan=False),
        "top_p": st.floats(0.1, 1, allow_nan=False),
        "top_k": st.integers(-1, 50),
        "seed": st.integers(0, 2**31),
        "n": st.integers(1, 3),
        "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)),
        "logprobs": st.booleans(),
        "echo": st.booleans(),
        "min_tokens": st.integers(0, 4),
        "user": TEXT,
        "logit_bias": st.just({"5": 1}),  # not reusable: parsed every time
    }
    names = draw(st.lists(st.sampled_from(sorted(scalars)), max_size=4, unique=True))
    params = {name: draw(scalars[name]) for name in names}
    return (
        {"model": "demo", "messages": messages[0], **params},
        {"model": "demo", "messages": messages[1], **params},
    )


@AGREEMENT
@given(pair=reusable_pair())
def test_a_reused_parse_equals_the_full_parse(pair: tuple[dict, dict]) -> None:
    first, second = pair
    shapes = ParsedShapes()
    for body in (first, second, first):
        full_view = parsed_view(lambda b=body: parse_body(CHAT, fresh(b), validated=True))
        assert parsed_view(lambda b=body: shapes.parse(CHAT, fresh(b), validated=True)) == full_view


@AGREEMENT
@given(pair=reusable_pair(), budget=st.integers(1, 64))
def test_shared_sampling_params_equal_the_ones_built_for_each_line(
    pair: tuple[dict, dict], budget: int
) -> None:
    """The SamplingParams a line gets from its shape's cache are those built for it alone."""
    shapes = ParsedShapes()
    defaults = {"temperature": 0.7}
    for body in (*pair, pair[0]):
        try:
            parsed = shapes.parse(CHAT, fresh(body), validated=True)
            own = repr(sampling_params_of(parsed.request, budget, defaults))
        except RequestError:
            continue
        shared = shapes.sampling_params(
            parsed, budget, lambda p=parsed: sampling_params_of(p.request, budget, defaults)
        )
        assert repr(shared) == own


def test_lines_of_one_shape_and_budget_share_one_sampling_params() -> None:
    shapes = ParsedShapes()
    built: list[int] = []

    def params_for(body: dict, budget: int) -> Any:
        parsed = shapes.parse(CHAT, fresh(body), validated=True)

        def build() -> Any:
            built.append(budget)
            return sampling_params_of(parsed.request, budget, {})

        return shapes.sampling_params(parsed, budget, build)

    def line(text: str, **fields: Any) -> dict:
        return {"model": "demo", "messages": [{"role": "user", "content": text}], "temperature": 0, **fields}

    first = params_for(line("a"), 8)
    assert params_for(line("b"), 8) is first  # another text, the same shape and budget
    assert params_for(line("c"), 9) is not first  # a prompt near the context: a smaller budget
    assert params_for(line("d", seed=3), 8) is not first  # another shape
    assert built == [8, 9, 8] and shapes.sampling_hits == 1
    # a body whose shape is not remembered (a field outside the list) builds its own every time
    assert params_for(line("e", logit_bias={"5": 1}), 8) is not params_for(line("e", logit_bias={"5": 1}), 8)

    def refused() -> Any:
        raise RequestError("invalid_request", "no", "temperature")

    parsed = shapes.parse(CHAT, fresh(line("f", top_p=0.5)), validated=True)
    with pytest.raises(RequestError):
        shapes.sampling_params(parsed, 8, refused)
    builds = len(built)
    params_for(line("g", top_p=0.5), 8)
    assert len(built) == builds + 1  # nothing was left by the refusal: the next line builds


def test_lines_of_one_shape_are_parsed_once_each_with_its_own_messages_and_id() -> None:
    shapes = ParsedShapes()
    got = []
    for i in range(20):
        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": f"q{i}"}],
            "max_tokens": 3,
            "temperature": 0,
        }
        got.append(shapes.parse(CHAT, fresh(body), validated=True))
    assert (shapes.misses, shapes.hits) == (1, 19)
    assert [p.request.messages[0]["content"] for p in got] == [f"q{i}" for i in range(20)]
    assert len({p.request.request_id for p in got}) == 20  # the response id of each line
    assert got[0].request.bad_words is not got[1].request.bad_words
    assert all(p.request.messages == [] for p in shapes._parsed.values())  # no line's text kept
    # not reused: another tenant's salt, a body not from the store, a field outside the list
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "q"}],
        "max_tokens": 3,
        "temperature": 0,
    }
    shapes.parse(CHAT, fresh(body), validated=True, scope="tenant-b")
    shapes.parse(CHAT, fresh(body), validated=False)
    shapes.parse(CHAT, fresh({**body, "logit_bias": {"5": 1}}), validated=True)
    shapes.parse(CHAT, fresh({**body, "logit_bias": {"5": 1}}), validated=True)
    assert (shapes.misses, shapes.hits) == (5, 19)


def test_image_lines_share_a_shape_whatever_their_urls_but_references_keep_theirs() -> None:
    """A data: URL is most of an image line: reduced to "empty or not" like a text, so a file of
    image lines is parsed once per shape, not once a line (a 40 KB URL alone made every key too
    long to remember); the references validation stores are kept whole."""

    def line(url: str) -> dict:
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
        return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": parts}]}

    big = "data:image/png;base64," + "A" * 50_000
    assert shape_key(CHAT, line(big)) == shape_key(CHAT, line("https://example.com/a.png")) is not None
    shapes = RequestShapes()
    for url in (big, "data:image/png;base64,QUJD", "https://example.com/b.png"):
        assert shapes.max_tokens(CHAT, line(url)) == 4
    assert (shapes.misses, shapes.hits) == (1, 2)
    with_ref = shape_key(CHAT, line("freight-image:" + "a" * 64))
    assert with_ref is not None and "freight-image:" + "a" * 64 in with_ref
    assert with_ref != shape_key(CHAT, line("freight-image:" + "b" * 64))
    responses = {
        "model": "m",
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": big}]}],
    }
    key = shape_key(RESPONSES, responses)
    assert key is not None and big not in key
