"""/v1/embeddings lines at validation: a line reaches only a model of the right task, a malformed
body is its line's error naming the field, and a one-text line is tokenized once, exactly as the
engine would (its ids go to the engine; other lines are keyed by their first input)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.factories import chat_line, embedding_line
from workers.prompt_tokens import PromptRenderer
from workers.validation import FileRules, LineError, ValidLine, check_line

EMBEDDINGS = "/v1/embeddings"
SERVED = frozenset({"demo", "embed"})
EMBED_RULES = FileRules(
    EMBEDDINGS, SERVED, max_requests=10, max_line_bytes=1 << 16, embed_models=frozenset({"embed"})
)
CHAT_RULES = FileRules("/v1/chat/completions", SERVED, 10, 1 << 16, embed_models=frozenset({"embed"}))


def raw(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_embedding_lines_of_every_input_shape_pass_with_no_output_budget() -> None:
    for value in ("a text", ["one", "two"], [1, 2, 3], [[1, 2], [3]]):
        result = check_line(raw(embedding_line("e", value, encoding_format="base64")), 1, EMBED_RULES)
        assert isinstance(result, ValidLine), result
        assert result.model == "embed" and result.row.max_tokens == 0


def test_a_line_for_a_model_of_the_other_task_is_refused_naming_both() -> None:
    to_chat_model = check_line(raw(embedding_line("e", "x", model="demo")), 3, EMBED_RULES)
    assert isinstance(to_chat_model, LineError)
    assert (to_chat_model.line, to_chat_model.code, to_chat_model.param) == (3, "invalid_model", "body.model")
    assert "'demo' generates text; it does not serve /v1/embeddings" in to_chat_model.message
    to_embed_model = check_line(raw(chat_line("c", model="embed")), 4, CHAT_RULES)
    assert isinstance(to_embed_model, LineError) and to_embed_model.code == "invalid_model"
    assert (
        "'embed' is an embedding model; it serves /v1/embeddings, /v1/score and /v1/rerank only"
        in to_embed_model.message
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "body.input"),
        ({"input": ["ok", ""]}, "body.input.1"),
        ({"input": ["ok", [1]]}, "body.input.1"),
        ({"input": [[1], [-1]]}, "body.input.1"),
        ({"input": None}, "body.input"),
        ({"input": "x", "encoding_format": "int8"}, "body.encoding_format"),
        ({"input": "x", "dimensions": -3}, "body.dimensions"),
        ({"input": "x", "max_tokens": 3}, "body.max_tokens"),
    ],
)
def test_each_malformed_embedding_body_is_its_lines_error(body: dict, param: str) -> None:
    line = {"custom_id": "e", "method": "POST", "url": EMBEDDINGS, "body": {"model": "embed", **body}}
    result = check_line(raw(line), 9, EMBED_RULES)
    assert isinstance(result, LineError), result
    assert (result.line, result.param) == (9, param) and result.message, result


def test_one_text_is_tokenized_exactly_and_several_are_keyed_by_the_first(embed_model: Path) -> None:
    renderer = PromptRenderer.load(embed_model, 64)
    text = "The batch of documents to embed, one line each."
    expected = renderer.tokenizer.encode(text, add_special_tokens=True)
    for body in ({"model": "embed", "input": text}, {"model": "embed", "input": [text], "user": "u"}):
        one = renderer.render(EMBEDDINGS, body)
        assert one.exact and one.token_ids() == expected and one.prompt_len == len(expected)
    ids = renderer.render(EMBEDDINGS, {"input": [[7, 8, 9]]})
    assert ids.exact and ids.token_ids() == [7, 8, 9]
    several = renderer.render(EMBEDDINGS, {"input": [text, "another text"]})
    assert not several.exact and several.token_ids() is None
    assert several.key == one.key  # sorted next to lines that start with the same text
