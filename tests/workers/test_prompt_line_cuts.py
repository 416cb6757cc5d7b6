"""The line cut of ``workers.prompts``: text between added tokens tokenized in lines, so a document
shared by many lines is tokenized once, and never ids other than the tokenizer's own.

Three pre-tokenizers, on tokenizers trained here in milliseconds (no model hub): GPT-2's regex with
newline merges (its last newline of a run is a pre-token of its own), Qwen's (a run is one
pre-token) and SentencePiece-style Metaspace; and the demo model's."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from scheduler.ordering import prompt_key
from workers.prompts import _LINE_CUTS, PromptKeyer, keyer_for

QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Read the document, then answer the question.\n\nThe shelf holds red boxes.\n\nQuestion: which?\n",
    "end.\n\n\nNext line\r\n\r\nwindows line\n \nspaced\n\tTabbed\n",
    "naïve café 1234\n\n- bullet\n1. item\n(x) 'sure' #tag Ω 日本語 😀\n",
] * 50


def trained(kind: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE (or Metaspace) tokenizer of a few hundred merges, newline runs among them."""
    if kind == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *SPECIALS])
    else:
        tok = Tokenizer(models.BPE())
        if kind == "gpt2":
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=SPECIALS)


@pytest.fixture(scope="module")
def keyers(demo_model: Path) -> dict[str, PromptKeyer]:
    out = {kind: PromptKeyer(trained(kind), 1 << 20) for kind in ("gpt2", "qwen", "metaspace")}
    out["demo"] = PromptKeyer(keyer_for(str(demo_model), 2048).tokenizer, 1 << 20)
    return out


def own_key(keyer: PromptKeyer, text: str) -> bytes:
    return prompt_key(keyer._backend.encode(text, add_special_tokens=False).ids, 1 << 20)


def test_each_pre_tokenizer_gets_the_cut_its_pre_tokens_allow(keyers):
    gpt2 = keyers["gpt2"]._backend
    assert "ĊĊ" in gpt2.get_vocab()  # the trained vocab merges newline runs: a cut after one differs
    assert keyers["gpt2"]._lines is _LINE_CUTS[1]  # before a run's last newline
    assert keyers["qwen"]._lines is _LINE_CUTS[0]  # after the run
    assert keyers["demo"]._lines is not None


def test_a_cut_pre_tokenizer_sees_as_one_text_is_refused(keyers):
    """Metaspace marks each piece's start as a word's: cut text tokenizes otherwise, so no cut."""
    keyer = keyers["metaspace"]
    text = "one line\nQuestion here"
    cut_ids = [
        i for p in _LINE_CUTS[0].split(text) for i in keyer._backend.encode(p, add_special_tokens=False).ids
    ]
    assert cut_ids != keyer._backend.encode(text, add_special_tokens=False).ids
    assert keyer._lines is None


LINES = st.lists(
    st.one_of(
        st.text(max_size=30),
        st.sampled_from(["\n", "\n\n", "\r\n", " \n", "\n \n", "\t\n", "\n\n\n", *SPECIALS]),
        st.sampled_from(["Question: why?", "end.", "1. item", "- bullet", "日本語 😀", "'s", "word "]),
    ),
    min_size=1,
    max_size=16,
).map("".join)


@pytest.mark.parametrize("kind", ["gpt2", "qwen", "metaspace", "demo"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(LINES, min_size=1, max_size=8))
def test_keys_are_the_tokenizers_own_ids(keyers, kind, texts):
    """Cut or not, cached or not, one text or a block: the tokenizer's ids on the whole text."""
    keyer = keyers[kind]
    want = [own_key(keyer, t) for t in texts]
    assert keyer.text_keys(texts, False) == want
    assert [keyer.text_key(t, False) for t in texts] == want


class CountingBackend:
    """The Rust tokenizer, counting the characters it was given to encode."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.chars = 0

    def encode_batch(self, texts, add_special_tokens):
        self.chars += sum(len(t) for t in texts)
        return self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)

    def encode(self, text, add_special_tokens):
        self.chars += len(text)
        return self.backend.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.backend, name)


def test_a_document_many_lines_ask_about_is_tokenized_once(keyers):
    keyer = PromptKeyer(keyers["demo"].tokenizer, 1 << 20)
    counting = keyer._backend = CountingBackend(keyer._backend)
    document = "\n".join(f"Paragraph {i}: the shelf in aisle {i} holds red boxes." for i in range(40))
    questions = [f"Question {q}: which aisle holds box {q}?" for q in range(10)]
    texts = [f"<|im_start|>user\nRead this.\n\n{document}\n\n{q}<|im_end|>\n" for q in questions]
    assert keyer.text_keys(texts, False) == [own_key(keyers["demo"], t) for t in texts]
    assert counting.chars < len(document) + sum(len(t) - len(document) for t in texts)
    before = counting.chars
    keyer.text_keys([texts[0].replace("Question 0", "Question 99")], False)
    assert counting.chars - before < 40  # only the new question's line
