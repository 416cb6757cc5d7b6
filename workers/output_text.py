"""An answer's text decoded once when it finishes, instead of token by token as vLLM decodes it.

Why: vLLM turns each new token into text as the token is made (its incremental detokenizer,
``vllm.v1.engine.detokenizer``), on the thread that steps the engine, so that it can check stop
strings and stream. A batch line has neither to do unless it gives stop strings: Freight asks only
for the final output. On a CPU host that decoding sits between the model's steps, on the one thread
that steps the engine (bench/README.md, "Where an engine step's time goes": 12.45 against 13.16 ms
a step in bench/results/engine-step.json); decoding each answer whole when it finishes is one call
into the tokenizer per line instead of one per token.

Exact: the text is what vLLM's own ``FastIncrementalDetokenizer`` would have made. vLLM primes a
``tokenizers`` ``DecodeStream`` with the prompt and steps it through the output, leaving out a
final stop token (EOS or a ``stop_token_ids`` one) unless ``include_stop_str_in_output``. Decoding
the prompt's last tokens with the output and dropping the text of those tokens alone gives the same
string whenever nothing in it is an incomplete UTF-8 sequence (the stream holds those back where a
whole decode writes U+FFFD); where one is, the stream itself is replayed.

Only where the result cannot differ (``decodes_at_end``): a fast (``tokenizers``) tokenizer, the
one vLLM would decode with; no stop strings (checked on the text as it grows); no logprobs (their
token strings come from the same detokenizer); special tokens skipped or spaced (vLLM's stream
treats adjacent special tokens apart otherwise); no bad words (vLLM refuses them undecoded).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# prompt tokens decoded before the output, as its context: a token's text can depend on the one
# before it (a leading space, a multi-byte character split over two tokens); the stream vLLM
# primes with the prompt looks back no further than a few tokens either
CONTEXT_TOKENS = 8
REPLACEMENT = "\ufffd"  # what a whole decode writes for an incomplete UTF-8 sequence
INVALID_PREFIX = "Invalid prefix encountered"  # tokenizers' DecodeStream error vLLM recovers from


def decodes_at_end(params: Any, tokenizer: Any) -> bool:
    """Whether a request with these SamplingParams can be run with vLLM's detokenizer off and its
    text decoded at the end (``answer_text``) to the same string (see the module docstring)."""
    from vllm.v1.engine.detokenizer import uses_fast_detokenizer

    return (
        tokenizer is not None
        and uses_fast_detokenizer(tokenizer)
        and bool(params.detokenize)
        and not params.stop
        and params.logprobs is None
        and params.prompt_logprobs is None
        and not params.bad_words
        and (params.skip_special_tokens or params.spaces_between_special_tokens)
    )


def answer_text(
    tokenizer: Any,
    prompt_token_ids: Sequence[int],
    token_ids: Sequence[int],
    stopped: bool,
    params: Any,
) -> str:
    """The text of one finished choice run with ``detokenize=False``. ``stopped``: it ended on a
    stop token (vLLM's finish reason "stop"), which vLLM leaves out of the text unless
    ``include_stop_str_in_output``."""
    ids = list(token_ids)
    if stopped and ids and not params.include_stop_str_in_output:
        ids.pop()
    if not ids:
        return ""
    backend = tokenizer._tokenizer  # the tokenizers.Tokenizer vLLM's fast detokenizer steps
    skip = bool(params.skip_special_tokens)
    context = list(prompt_token_ids[-CONTEXT_TOKENS:])
    whole = backend.decode(context + ids, skip_special_tokens=skip)
    before = backend.decode(context, skip_special_tokens=skip) if context else ""
    if REPLACEMENT not in whole and whole.startswith(before):
        return whole[len(before) :]
    return _streamed(backend, prompt_token_ids, ids, skip)


def _streamed(backend: Any, prompt_token_ids: Sequence[int], ids: list[int], skip: bool) -> str:
    """vLLM's way, token by token: for the rare text with an incomplete character in it."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(ids=list(prompt_token_ids), skip_special_tokens=skip)
    parts = []
    for token in ids:
        try:
            text = stream.step(backend, token)
        except (OverflowError, TypeError):  # an invalid token id: vLLM writes nothing for it
            text = None
        except Exception as exc:  # a non-monotonic prefix: vLLM starts a fresh stream at this token
            if not str(exc).startswith(INVALID_PREFIX):
                raise
            stream = DecodeStream(skip_special_tokens=skip)
            text = stream.step(backend, token)
        parts.append(text or "")
    return "".join(parts)
