"""Prompt keys on the real demo model's tokenizer and ChatML template."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.ordering import KEY_TOKEN_BYTES, common_prefix_tokens, prompt_key
from workers.prompts import PromptKeyer, keyer_for

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SYSTEM = " ".join(f"Rule {i}: answer briefly, cite the source, and never guess." for i in range(40))


@pytest.fixture(scope="module")
def keyer(demo_model: Path) -> PromptKeyer:
    return keyer_for(str(demo_model), 2048)


def template_ids(tokenizer, messages) -> list[int]:
    result = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return result if isinstance(result, list) else list(result["input_ids"])


def chat(*messages: tuple[str, object]) -> dict:
    return {"model": "demo", "messages": [{"role": r, "content": c} for r, c in messages]}


def test_keyer_is_cached_per_path_and_max_tokens(demo_model: Path, keyer: PromptKeyer):
    assert keyer_for(str(demo_model), 2048) is keyer
    assert keyer_for(str(demo_model), 16) is not keyer


def test_shared_system_prompt_gives_a_long_shared_prefix(keyer: PromptKeyer):
    a = keyer.key(CHAT, chat(("system", SYSTEM), ("user", "What is the capital of France?")))
    b = keyer.key(CHAT, chat(("system", SYSTEM), ("user", "Summarise this paragraph.")))
    other = keyer.key(CHAT, chat(("system", "Be terse."), ("user", "What is the capital of France?")))
    system_tokens = len(keyer.tokenizer.encode(SYSTEM, add_special_tokens=False))
    assert system_tokens > 300
    assert common_prefix_tokens(a, b) >= system_tokens - 3
    assert common_prefix_tokens(a, other) < 10


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hello there"}],
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "naïve café <|im_end|> ok"}],
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "  and\n\n3+3?\t"},
        ],
    ],
)
def test_chat_key_equals_template_token_ids(keyer: PromptKeyer, messages):
    expected = prompt_key(template_ids(keyer.tokenizer, messages), 2048)
    assert keyer.key(CHAT, {"messages": messages}) == expected
    assert keyer.key(CHAT, {"messages": messages}) == expected  # again, now from the piece cache


def test_text_parts_are_joined_into_one_string(keyer: PromptKeyer):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    joined = keyer.key(CHAT, chat(("user", "first\nsecond")))
    assert keyer.key(CHAT, chat(("user", parts))) == joined
    assert joined == prompt_key(
        template_ids(keyer.tokenizer, [{"role": "user", "content": "first\nsecond"}]), 2048
    )


def test_messages_the_template_rejects_still_get_a_key(keyer: PromptKeyer):
    body = {"messages": ["not a message", {"role": "user", "content": "hi"}]}
    key = keyer.key(CHAT, body)
    assert key == prompt_key(keyer.tokenizer.encode("user\nhi", add_special_tokens=False), 2048)
    assert isinstance(keyer.key(CHAT, {"messages": [{"content": 5}, 7, None]}), bytes)
    assert keyer.key(CHAT, {"messages": []}) == b""  # transformers refuses an empty conversation


def test_completions_prompts(keyer: PromptKeyer):
    tok = keyer.tokenizer
    text = "Once upon a time"
    assert keyer.key(COMPLETIONS, {"prompt": text}) == prompt_key(
        tok.encode(text, add_special_tokens=True), 2048
    )
    assert keyer.key(COMPLETIONS, {"prompt": [5, 300, 70_000]}) == prompt_key([5, 300, 70_000], 2048)
    assert keyer.key(COMPLETIONS, {"prompt": [text, "other"]}) == keyer.key(COMPLETIONS, {"prompt": text})
    assert keyer.key(COMPLETIONS, {"prompt": [[9, 8], [1]]}) == prompt_key([9, 8], 2048)


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (CHAT, {}),
        (CHAT, {"messages": "hello"}),
        (CHAT, None),
        (CHAT, ["messages"]),
        (COMPLETIONS, {"prompt": None}),
        (COMPLETIONS, {"prompt": {"text": "x"}}),
        (COMPLETIONS, {"prompt": [1, "a"]}),
        (COMPLETIONS, {"prompt": [-1, 2]}),
        (COMPLETIONS, {"prompt": [True]}),
        (COMPLETIONS, {"prompt": []}),
        ("/v1/moderations", {"input": "x"}),
    ],
)
def test_malformed_bodies_give_empty_key(keyer: PromptKeyer, endpoint, body):
    assert keyer.key(endpoint, body) == b""


def test_max_tokens_truncates(demo_model: Path, keyer: PromptKeyer):
    short = keyer_for(str(demo_model), 16)
    body = chat(("system", SYSTEM), ("user", "hi"))
    full = keyer.key(CHAT, body)
    assert len(full) > 16 * KEY_TOKEN_BYTES
    assert short.key(CHAT, body) == full[: 16 * KEY_TOKEN_BYTES]
    long_prompt = {"prompt": list(range(100))}
    assert short.key(COMPLETIONS, long_prompt) == prompt_key(range(16), 16)
    assert short.key(COMPLETIONS, {"prompt": SYSTEM}) == keyer.key(COMPLETIONS, {"prompt": SYSTEM})[:64]


def test_without_the_piece_cache_keys_are_the_same(demo_model: Path, keyer: PromptKeyer):
    plain = PromptKeyer(keyer.tokenizer, 2048)
    plain._split = None  # the path for tokenizers whose added-token split is not exact
    for body in [chat(("system", SYSTEM), ("user", "a <|im_start|> b")), chat(("user", "x"))]:
        assert plain.key(CHAT, body) == keyer.key(CHAT, body)


TEXTS = st.lists(
    st.one_of(
        st.text(max_size=60),
        st.sampled_from(["<|im_start|>user\n", "<|im_end|>\n", "<s>", " \n\n ", SYSTEM[:200]]),
    ),
    min_size=1,
    max_size=12,
).map(lambda parts: "".join(parts))


@pytest.mark.parametrize("max_tokens", [16, 2048])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(TEXTS, min_size=1, max_size=20), special=st.booleans())
def test_a_block_of_texts_tokenized_at_once_gives_each_texts_key(
    demo_model: Path, max_tokens, texts, special
):
    """The batch API (``text_keys``) and one text at a time (``text_key``) agree, cached or not,
    with and without the piece split, with and without special tokens added."""
    batched = PromptKeyer(keyer_for(str(demo_model), 2048).tokenizer, max_tokens)
    single = PromptKeyer(batched.tokenizer, max_tokens)
    assert batched.text_keys(texts, special) == [single.text_key(t, special) for t in texts]
    assert batched.text_keys(texts, special) == [single.text_key(t, special) for t in texts]  # cached now
    batched._split = None
    assert batched.text_keys(texts, special) == [single.text_key(t, special) for t in texts]
