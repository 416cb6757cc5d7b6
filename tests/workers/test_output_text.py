"""workers/output_text.py against vLLM's own incremental detokenizer, on real tokenizers: the demo
model's byte-level BPE, and a SentencePiece-style one (Metaspace) built here. Every answer decoded
whole must be the very string vLLM builds token by token, on text-like output and on random token
ids (incomplete UTF-8 sequences, special tokens), ended by a stop token or not."""

from __future__ import annotations

import json
import random
import types
from pathlib import Path

import pytest

from workers.output_text import answer_text, decodes_at_end

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prix: 12,50 € — café crème, naïve façade ✓",
    "日本語のテキストと中文混合, 还有한국어도 있습니다。",
    "emoji 🚀🔥👩‍💻 and tabs\tand\nnew lines  double  spaces",
    '{"name": "x", "values": [1, 2, 3]}',
]


def vllm_text(tokenizer, prompt: list[int], ids: list[int], stopped: bool, params) -> str:
    """What vLLM's output processor makes of the same tokens, a token a step."""
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    request = types.SimpleNamespace(request_id="r", sampling_params=params, prompt_token_ids=prompt)
    detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
    for i, token in enumerate(ids):
        detokenizer.update([token], stopped and i == len(ids) - 1)
    return detokenizer.get_next_output_text(True, False)


@pytest.fixture(scope="module")
def byte_level(demo_model_dir: Path):
    from vllm.tokenizers.registry import get_tokenizer

    return get_tokenizer(str(demo_model_dir))


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory: pytest.TempPathFactory):
    from tokenizers import SentencePieceBPETokenizer
    from vllm.tokenizers.registry import get_tokenizer

    folder = tmp_path_factory.mktemp("metaspace")
    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(TEXTS * 20, vocab_size=400, special_tokens=["<s>", "</s>", "<unk>"])
    trained.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return get_tokenizer(str(folder))


def cases(tokenizer, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) pairs: encoded text cut anywhere, and random ids of the whole vocabulary."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    out = []
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for cut in range(0, len(ids), max(1, len(ids) // 6)):
            out.append((ids[:cut] or [rng.randrange(vocab)], ids[cut:]))
    for _ in range(150):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        out.append((prompt, [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]))
    return out


@pytest.mark.parametrize("which", ["byte_level", "metaspace"])
@pytest.mark.parametrize("skip_special", [True, False])
def test_an_answer_decoded_whole_is_vllms_text(request, which: str, skip_special: bool) -> None:
    from vllm import SamplingParams

    tokenizer = request.getfixturevalue(which)
    params = SamplingParams(max_tokens=64, skip_special_tokens=skip_special)
    assert decodes_at_end(params, tokenizer)
    checked = 0
    for i, (prompt, ids) in enumerate(cases(tokenizer, seed=len(which) + skip_special)):
        stopped = i % 3 == 0
        expected = vllm_text(tokenizer, prompt, ids, stopped, params)
        assert answer_text(tokenizer, prompt, ids, stopped, params) == expected, (prompt, ids, stopped)
        checked += 1
    assert checked > 150


def test_a_stop_token_kept_when_asked(byte_level) -> None:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, include_stop_str_in_output=True, skip_special_tokens=False)
    ids = [*byte_level.encode("done", add_special_tokens=False), byte_level.eos_token_id]
    text = answer_text(byte_level, [1], ids, True, params)
    assert text == vllm_text(byte_level, [1], ids, True, params)
    assert text.endswith(byte_level.eos_token)
    dropped = SamplingParams(max_tokens=8, skip_special_tokens=False)
    assert answer_text(byte_level, [1], ids, True, dropped) == "done"


def test_only_where_the_text_cannot_differ(byte_level) -> None:
    from vllm import SamplingParams

    assert decodes_at_end(SamplingParams(), byte_level)
    assert not decodes_at_end(SamplingParams(), None)
    for refused in (
        SamplingParams(stop=["\n"]),  # checked on the text as it grows
        SamplingParams(logprobs=2),  # their token strings come from the detokenizer
        SamplingParams(prompt_logprobs=1),
        SamplingParams(bad_words=["no"]),
        SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False),
        SamplingParams(detokenize=False),  # nothing to decode
    ):
        assert not decodes_at_end(refused, byte_level), refused
