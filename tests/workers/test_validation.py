"""Line and file rules of the validating step (pure: no database, no engine)."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from tests.factories import chat_line, embedding_line, responses_line
from workers.request_bodies import RequestError, parse_body
from workers.validation import (
    FileRules,
    LineError,
    ScanResult,
    _payload,
    _row,
    check_line,
    is_refused,
    scan_lines,
)

RULES = FileRules("/v1/chat/completions", frozenset({"demo"}), max_requests=50, max_line_bytes=4096)


def good(custom_id: str = "r1", **body: object) -> dict:
    return chat_line(custom_id, "héllo ✓", **{"max_tokens": 8, **body})


def raw(obj: object) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode()


def scan(lines: list[bytes], rules: FileRules = RULES, max_listed: int = 100) -> tuple[list, ScanResult]:
    out = list(scan_lines(lines, rules, max_listed))
    assert isinstance(out[-1], ScanResult)
    return out[:-1], out[-1]


@pytest.mark.parametrize(
    ("line", "code", "param"),
    [
        (b"{not json", "invalid_json_line", None),
        (b"\xff\xfe garbage", "invalid_json_line", None),
        (b"[1, 2]", "invalid_json_line", None),
        (raw({**good(), "custom_id": 7}), "missing_custom_id", "custom_id"),
        (raw({k: v for k, v in good().items() if k != "custom_id"}), "missing_custom_id", "custom_id"),
        (raw({**good(), "method": "GET"}), "invalid_method", "method"),
        (raw({**good(), "url": "/v1/completions"}), "mismatched_url", "url"),
        (raw({**good(), "body": "text"}), "invalid_body", "body"),
        (raw({**good(), "extra": 1}), "invalid_request", None),
        (raw(good(model="gpt-9")), "model_not_found", "body.model"),
        (raw(good(temperature="hot")), "invalid_request", "body.temperature"),
        (raw(good(max_tokens=-1)), "invalid_request", "body.max_tokens"),
        (raw(good(messages=[])), "invalid_request", "body.messages"),
        (raw(good(temprature=0.5)), "invalid_request", "body.temprature"),
        (b"x" * 5000, "line_too_large", None),
    ],
)
def test_each_bad_line_kind_is_named(line, code, param):
    result = check_line(line, 7, RULES)
    assert isinstance(result, LineError), result
    assert (result.line, result.code) == (7, code)
    if param:
        assert result.param == param
    assert result.message


@pytest.mark.parametrize(
    "body", [{"stream": True}, {"tools": [{"type": "function", "function": {"name": "f"}}]}]
)
def test_unsupported_but_well_formed_requests_pass_to_run_time(body):
    # they become that request's 400 error line when the unit runs, not a failed file
    assert not isinstance(check_line(raw(good(**body)), 1, RULES), LineError)


def test_good_line_keeps_the_body():
    checked = check_line(raw(good("id-1")), 3, RULES)
    assert not isinstance(checked, LineError)
    row = checked.row
    assert checked.model == "demo"
    assert row.line == 3 and row.custom_id == "id-1" and row.body["messages"][0]["content"] == "héllo ✓"


def test_bom_crlf_and_trailing_blank_lines_are_fine():
    lines = [b"\xef\xbb\xbf" + raw(good("a")) + b"\r", raw(good("b")) + b"\r", b"", b"  ", b"\r"]
    rows, result = scan(lines)
    assert [r.custom_id for r in rows] == ["a", "b"]
    assert result.error_count == 0 and result.rows == 2 and result.model == "demo"


def test_file_level_errors_carry_line_numbers():
    lines = [raw(good("a")), b"", raw(good("b")), raw(good("a")), b"{bad", raw(good("c"))]
    _, result = scan(lines)
    got = [(e.line, e.code) for e in result.errors or []]
    assert got == [(2, "empty_line"), (4, "duplicate_custom_id"), (5, "invalid_json_line")]
    assert result.error_count == 3


def test_mixed_models_and_request_limit():
    rules = FileRules(
        "/v1/chat/completions", frozenset({"demo", "other"}), max_requests=2, max_line_bytes=4096
    )
    _, result = scan([raw(good("a")), raw(good("b", model="other"))], rules)
    assert [(e.line, e.code) for e in result.errors or []] == [(2, "mixed_models")]
    _, result = scan([raw(good(str(i))) for i in range(5)], rules)
    assert [(e.line, e.code) for e in result.errors or []] == [(3, "too_many_requests")]


def test_error_list_is_capped_but_counted():
    _, result = scan([b"{bad"] * 30, max_listed=5)
    assert result.error_count == 30 and len(result.errors or []) == 5


def test_empty_file():
    _, result = scan([b"", b""])
    assert [e.code for e in result.errors or []] == ["empty_file"]


def test_completions_endpoint_lines():
    rules = FileRules("/v1/completions", frozenset({"demo"}), 10, 4096)
    line = {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "demo", "prompt": "Once", "max_tokens": 3},
    }
    assert not isinstance(check_line(raw(line), 1, rules), LineError)
    line["body"] = {"model": "demo", "max_tokens": 3}
    assert isinstance(check_line(raw(line), 1, rules), LineError)


def test_a_line_may_name_an_adapter_of_the_files_model() -> None:
    """LoRA adapters (storage/adapters.py): a line naming one the tenant may use is a line of its
    base (one base per file, so base and adapters mix); its body keeps the adapter's name, which
    the engine serves it with. An adapter the tenant may not use is not in ``adapters`` at all:
    its line gets an unknown model's error, word for word."""
    rules = FileRules(
        "/v1/chat/completions",
        frozenset({"demo", "other"}),
        max_requests=50,
        max_line_bytes=4096,
        adapters={"demo-a": "demo", "demo-b": "demo", "other-a": "other"},
    )
    rows, result = scan(
        [raw(good("1")), raw(good("2", model="demo-a")), raw(good("3", model="demo-b"))], rules
    )
    assert (result.model, result.rows, result.errors) == ("demo", 3, [])
    assert [json.loads(r.body_json)["model"] for r in rows] == ["demo", "demo-a", "demo-b"]
    # an adapter of another base in the same file: refused alone (adapter_base_mismatch below)
    rows, alone = scan([raw(good("1", model="demo-a")), raw(good("2", model="other-a"))], rules)
    assert (alone.model, alone.rows, alone.errors) == ("demo", 2, []) and is_refused(rows[1])
    unknown, hidden = (check_line(raw(good(model=m)), 1, rules) for m in ("demo-z", "restricted"))
    assert isinstance(unknown, LineError) and isinstance(hidden, LineError)
    assert (unknown.code, unknown.param) == (hidden.code, hidden.param) == ("model_not_found", "body.model")
    assert unknown.message.replace("demo-z", "X") == hidden.message.replace("restricted", "X")


def test_an_adapters_lines_sort_together_and_share_no_prefix_with_others() -> None:
    """vLLM's prefix cache is per adapter: the prompt key of an adapter's line starts with its
    adapter's marker (scheduler.ordering.adapter_key), so sorted, the base's lines come first and
    each adapter's run together in prompt order; the predicted cache hit of a line after another
    adapter's is nothing."""
    from scheduler.ordering import common_prefix_tokens, prompt_key
    from workers.prompt_tokens import RenderedPrompt

    def render(model: str, endpoint: str, body: dict) -> RenderedPrompt:
        ids = [7, 8, 9, len(body["messages"][0]["content"])]  # a shared prefix, then the text
        return RenderedPrompt(prompt_key(ids, 64), True, 4)

    rules = FileRules(
        "/v1/chat/completions", frozenset({"demo"}), max_requests=50, max_line_bytes=4096, render=render,
        adapters={"demo-a": "demo", "demo-b": "demo"},
    )  # fmt: skip
    models = ["demo-b", "demo", "demo-a", "demo-b", "demo", "demo-a"]
    lines = [raw(chat_line(str(i), "x" * (i + 1), model=m)) for i, m in enumerate(models)]
    rows, result = scan(lines, rules)
    assert result.rows == 6 and [r.prompt_token_ids for r in rows] == [
        prompt_key([7, 8, 9, i + 1], 64) for i in range(6)
    ]
    ordered = sorted(rows, key=lambda r: (r.key, r.line))
    groups = [m for m, _ in itertools.groupby(json.loads(r.body_json)["model"] for r in ordered)]
    # each model's lines together, the base's first
    assert groups[0] == "demo" and sorted(groups) == ["demo", "demo-a", "demo-b"]
    shared = [common_prefix_tokens(a.key, b.key) for a, b in itertools.pairwise(ordered)]
    assert shared == [3, 0, 3, 0, 3]  # the prefix within the base and each adapter; nothing across


# -- a line naming a model not served here is refused alone --------------------------------------

ADAPTER_RULES = FileRules(
    "/v1/chat/completions", frozenset({"demo", "other"}), max_requests=50, max_line_bytes=4096,
    adapters={"demo-a": "demo", "other-a": "other"},
)  # fmt: skip


def _run_time_error(row) -> RequestError:
    """What the engine worker's parse of a stored row raises (request_bodies.parse_body)."""
    with pytest.raises(RequestError) as raised:
        parse_body("/v1/chat/completions", json.loads(row.body_json), validated=True)
    return raised.value


def test_a_line_naming_an_unknown_model_is_a_row_that_runs_as_its_error() -> None:
    """An unknown model, or an adapter the tenant may not use (restricted to others: not in its
    ``adapters``), is that line's 400 ``model_not_found`` at run time, with the message validation
    gave, while the file's other lines run; its body is not kept and its row has no prompt."""
    lines = [raw(good("1")), raw(good("2", model="gpt-9")), raw(good("3", model="demo-a")), raw(good("4"))]
    rows, result = scan(lines, ADAPTER_RULES)
    assert (result.model, result.rows, result.errors, result.error_count) == ("demo", 4, [], 0)
    refused = next(r for r in rows if r.custom_id == "2")
    assert is_refused(refused) and not any(is_refused(r) for r in rows if r is not refused)
    assert (refused.line, refused.key, refused.prompt_token_ids, refused.prompt_len, refused.max_tokens) == (
        2, b"", None, 0, None,
    )  # fmt: skip
    assert "héllo" not in refused.body_json  # the body never runs: not stored
    error = _run_time_error(refused)
    assert (error.code, error.param, error.status_code) == ("model_not_found", "model", 400)
    assert error.message == "model 'gpt-9' is not served here"  # validation's own message
    # the row survives the sort payload's round trip as validation stores it
    again = _row(refused.key, refused.line, _payload(refused))
    assert (again.body_json, again.prompt_len, again.max_tokens) == (refused.body_json, 0, None)


def test_an_adapter_restricted_to_others_reads_as_an_unknown_model() -> None:
    """Another tenant's adapter and a name no one registered: the same code, param and message
    (but for the name) at validation and at run time, so nothing says the adapter exists."""
    lines = [raw(good("a")), raw(good("b", model="theirs")), raw(good("c", model="nobody"))]
    rows, result = scan(lines, ADAPTER_RULES)  # "theirs" is registered, for another tenant
    assert (result.rows, result.errors) == (3, [])
    theirs, nobody = (_run_time_error(r) for r in rows if r.custom_id in "bc")
    assert (theirs.code, theirs.param) == (nobody.code, nobody.param) == ("model_not_found", "model")
    assert theirs.message.replace("theirs", "X") == nobody.message.replace("nobody", "X")


def test_an_adapter_of_another_base_is_refused_alone_not_mixed() -> None:
    """The file's model is its first line's to pass naming a served model (a base, or an
    adapter's base). In a file of ``demo``, a line naming ``other-a``, an adapter of the served
    base ``other``, is that line's 400 ``adapter_base_mismatch`` at run time, naming the adapter,
    its base and the file's model, while the other lines run; it still counts as a row (unique
    custom_id, the request limit). A line naming another base itself still fails the file
    (``mixed_models``: one model per file). An adapter of a base not served at all is an unknown
    model, refused alone."""
    lines = [raw(good("1")), raw(good("2", model="other-a")), raw(good("3", model="demo-a")), raw(good("4"))]
    rows, result = scan(lines, ADAPTER_RULES)
    assert (result.model, result.rows, result.errors, result.error_count) == ("demo", 4, [], 0)
    refused = [r for r in rows if is_refused(r)]
    assert [(r.custom_id, r.line, r.key, r.prompt_len) for r in refused] == [("2", 2, b"", 0)]
    assert "héllo" not in refused[0].body_json
    error = _run_time_error(refused[0])
    assert (error.code, error.param, error.status_code) == ("adapter_base_mismatch", "model", 400)
    assert error.message.startswith(
        "model 'other-a' is a LoRA adapter of 'other', not of 'demo', this file's model"
    )
    # the first line names the adapter: the file is of its base, and the base's own lines mix in
    rows, first = scan([raw(good("1", model="other-a")), raw(good("2", model="demo-a"))], ADAPTER_RULES)
    assert (first.model, first.rows, first.errors) == ("other", 2, []) and is_refused(rows[1])
    assert "'demo-a' is a LoRA adapter of 'demo', not of 'other'" in _run_time_error(rows[1]).message
    # a base of its own is not an adapter: the file fails as before
    _, mixed = scan([raw(good("1")), raw(good("2", model="other"))], ADAPTER_RULES)
    assert [(e.line, e.code) for e in mixed.errors] == [(2, "mixed_models")]
    assert "'other' differs from 'demo'" in mixed.errors[0].message
    # the refused adapter line is a row for the file's rules: duplicate ids, the request limit
    _, dup = scan([raw(good("a")), raw(good("a", model="other-a"))], ADAPTER_RULES)
    assert [(e.line, e.code) for e in dup.errors] == [(2, "duplicate_custom_id")]
    limited = replace(ADAPTER_RULES, max_requests=1)
    _, over = scan([raw(good("a")), raw(good("b", model="other-a"))], limited)
    assert [(e.line, e.code) for e in over.errors] == [(2, "too_many_requests")]
    rules = FileRules("/v1/chat/completions", frozenset({"demo"}), 50, 4096, adapters={"demo-a": "demo"})
    rows, result = scan([raw(good("1")), raw(good("2", model="other-a"))], rules)
    assert (result.rows, result.errors) == (2, []) and is_refused(rows[1])
    assert _run_time_error(rows[1]).code == "model_not_found"


def test_a_line_for_a_model_of_another_task_is_refused_alone() -> None:
    """A rerank line naming a text model, a chat line naming an embedding model: that line's 400
    ``invalid_model`` with the message validation always gave, while the file's other lines run;
    a file with no line for a model of the endpoint fails as before, each line listed."""

    def rerank_line(custom_id: str, model: str) -> dict:
        body = {"model": model, "query": "q", "documents": ["a", "b"]}
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/rerank", "body": body}

    rules = FileRules(
        "/v1/rerank", frozenset({"demo", "rank"}), 50, 4096, score_models=frozenset({"rank"})
    )  # fmt: skip
    lines = [raw(rerank_line("r1", model="rank")), raw(rerank_line("r2", model="demo")),
             raw(rerank_line("r3", model="rank"))]  # fmt: skip
    rows, result = scan(lines, rules)
    assert (result.model, result.rows, result.errors) == ("rank", 3, [])
    refused = [r for r in rows if is_refused(r)]
    assert [r.custom_id for r in refused] == ["r2"]
    with pytest.raises(RequestError) as raised:
        parse_body("/v1/rerank", json.loads(refused[0].body_json), validated=True)
    assert (raised.value.code, raised.value.param, raised.value.status_code) == (
        "invalid_model",
        "model",
        400,
    )
    assert "'demo' generates text; it does not serve /v1/rerank" in raised.value.message
    _, alone = scan([raw(rerank_line("x", model="demo"))], rules)
    assert [(e.line, e.code, e.param) for e in alone.errors] == [(1, "invalid_model", "body.model")]
    embed = FileRules(
        RULES.endpoint, frozenset({"demo", "embed"}), 50, 4096, embed_models=frozenset({"embed"})
    )
    rows, chat = scan([raw(good("1")), raw(good("2", model="embed"))], embed)
    assert (chat.model, chat.rows, chat.errors) == ("demo", 2, []) and is_refused(rows[1])
    assert "'embed' is an embedding model" in _run_time_error(rows[1]).message


VISION_RULES = FileRules(
    "/v1/chat/completions", frozenset({"vlm", "demo"}), 50, 4096,
    image_tokens=lambda model: ("<fake_token_around_image>", "<image>") if model == "vlm" else (),
)  # fmt: skip


@pytest.mark.parametrize(
    ("content", "param"),
    [
        ("look: <image> what is it?", "messages.0.content"),
        ([{"type": "text", "text": "a"}, {"type": "text", "text": "b <image>"}], "messages.0.content.1.text"),
        ([{"type": "text", "text": "a <ima"}, {"type": "text", "text": "ge> b"}], "messages.0.content"),
        ("\\u003cfake_token_around_image>", "messages.0.content"),  # escaped in the JSON line
    ],
    ids=["string", "part", "split-across-parts", "escaped"],
)
def test_a_vision_models_image_token_as_text_is_refused_alone(content, param) -> None:
    """Text holding one of a vision model's image tokens would stand for an image the line does
    not have: that line's 400 ``image_token_in_text`` naming where, the file's other lines run.
    A text model's line may say ``<image>``: it has no such token."""
    text = content if isinstance(content, list) else "CONTENT"
    bad = raw(chat_line("2", text, model="vlm"))  # type: ignore[arg-type]
    if not isinstance(content, list):  # written into the line as it is (an escape stays one)
        bad = bad.replace(b"CONTENT", content.encode())
    rows, result = scan([raw(chat_line("1", "plain", model="vlm")), bad], VISION_RULES)
    assert (result.model, result.rows, result.errors) == ("vlm", 2, [])
    assert [r.custom_id for r in rows if is_refused(r)] == ["2"]
    error = _run_time_error(rows[1])
    assert (error.code, error.param, error.status_code) == ("image_token_in_text", param, 400)
    assert (
        error.message.startswith(f"`{param}` holds '<") and "an image token of model 'vlm'" in error.message
    )
    rows, text_model = scan([raw(chat_line("1", "say <image>"))], VISION_RULES)
    assert (text_model.rows, text_model.errors) == (1, []) and not is_refused(rows[0])


def test_a_file_naming_no_served_model_fails_as_before() -> None:
    """Every line unknown: the file fails at validation, each line listed as model_not_found with
    the other bad lines in line order, capped and counted as before; duplicate custom_ids among
    them are not what it says (they are not rows)."""
    lines = [raw(good("a", model="x")), b"{bad", raw(good("a", model="y")), b"", raw(good("c", model="z"))]
    _, result = scan(lines)
    assert result.rows == 0 and result.model is None
    assert [(e.line, e.code, e.param) for e in result.errors] == [
        (1, "model_not_found", "body.model"), (2, "invalid_json_line", None), (3, "model_not_found", "body.model"),
        (4, "empty_line", None), (5, "model_not_found", "body.model"),
    ]  # fmt: skip
    assert result.errors[0].message == "model 'x' is not served here"
    _, capped = scan([raw(good(str(i), model="typo")) for i in range(30)], max_listed=5)
    assert capped.error_count == 30 and [e.line for e in capped.errors] == [1, 2, 3, 4, 5]
    # past the request limit too, every line is listed as what it is
    rules = FileRules("/v1/chat/completions", frozenset({"demo"}), max_requests=2, max_line_bytes=4096)
    _, over = scan([raw(good(str(i), model="typo")) for i in range(4)], rules)
    assert [e.code for e in over.errors] == ["model_not_found"] * 4
    # a line naming no model, or not a string, is malformed: it fails the file as before
    for model in (None, 7):
        _, result = scan([raw(good("1")), raw(good("2", model=model))])
        assert [(e.line, e.code) for e in result.errors] == [(2, "model_not_found")]


def test_a_refused_line_is_a_row_for_the_files_rules() -> None:
    """Its custom_id is unique with the others' and it counts in the request limit, wherever it
    stands before the first line naming a served model."""
    rules = FileRules("/v1/chat/completions", frozenset({"demo"}), max_requests=2, max_line_bytes=4096)
    _, dup = scan([raw(good("a", model="x")), raw(good("a", model="y")), raw(good("b"))], rules)
    assert [(e.line, e.code) for e in dup.errors] == [(2, "duplicate_custom_id")]
    _, dup = scan([raw(good("a", model="x")), raw(good("a"))], rules)
    assert [(e.line, e.code) for e in dup.errors] == [(2, "duplicate_custom_id")]
    _, over = scan([raw(good("a", model="x")), raw(good("b")), raw(good("c", model="y"))], rules)
    assert [(e.line, e.code) for e in over.errors] == [(3, "too_many_requests")]
    _, over = scan([raw(good(str(i), model="x")) for i in range(3)] + [raw(good("d"))], rules)
    assert [(e.line, e.code) for e in over.errors] == [(4, "too_many_requests")]


def test_a_refused_line_is_not_rendered_and_sorts_first() -> None:
    """No prompt is rendered for it (its model has no tokenizer here): its key is empty."""
    from scheduler.ordering import prompt_key
    from workers.prompt_tokens import RenderedPrompt

    def render(model: str, endpoint: str, body: dict) -> RenderedPrompt:
        assert model == "demo", model
        return RenderedPrompt(prompt_key([5, len(body["messages"][0]["content"])], 64), True, 2)

    rules = FileRules("/v1/chat/completions", frozenset({"demo"}), 50, 4096, render=render)
    rows, result = scan([raw(good("1")), raw(good("2", model="gpt-9")), raw(good("3"))], rules)
    assert (result.rows, result.errors) == (3, [])
    assert sorted(rows, key=lambda r: (r.key, r.line))[0].custom_id == "2"


@pytest.mark.parametrize(
    "line",
    [good(x_freight_refused={"code": "model_not_found", "message": "m", "param": "model"}),
     responses_line("p", x_freight_refused={}), embedding_line("e", model="demo", x_freight_refused={})],
    ids=["chat", "responses", "embeddings"],
)  # fmt: skip
def test_a_tenants_body_cannot_pass_as_a_refusal(line) -> None:
    """The refusal's field in a tenant's own body is an unknown field, failing its file as before."""
    embed = frozenset({"demo"}) if line["url"] == "/v1/embeddings" else frozenset()
    rules = FileRules(line["url"], frozenset({"demo"}), 50, 4096, embed_models=embed)
    error = check_line(raw(line), 1, rules)
    assert isinstance(error, LineError)
    assert (error.code, error.param) == ("invalid_request", "body.x_freight_refused")
