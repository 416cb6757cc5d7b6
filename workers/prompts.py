"""Prompt keys for batch lines: the rendered prompt's first tokens, as ``scheduler.ordering`` bytes.

Why: sorting a file's lines by these keys puts requests with a shared prompt prefix (a long system
prompt, few-shot examples, a shared document) next to each other, so vLLM's prefix cache serves the
prefix once instead of recomputing it on every line.

A key is an ordering hint, never a correctness input: whatever the body, ``key`` returns bytes and
never raises (``b""``, which sorts first, for anything it cannot read).

Speed matters (every line of files with millions of lines), so for chat bodies the keyer renders
the template to text and tokenizes it itself, in pieces: a fast tokenizer splits out added tokens
(``<|im_start|>`` …) before anything else and encodes the text between them independently, so the
pieces' ids concatenated are exactly the ids of ``apply_chat_template(..., tokenize=True)``. Pieces
are cached (LRU, bounded in bytes), so a system prompt shared by many lines is tokenized once, and
pieces past ``max_tokens`` are never tokenized. Tokenizers for which that split is not exact (added
tokens with strip/word options, whole-string normalizers; checked when loading) skip the cache.

The text between added tokens is cut again between lines (``_LINE_CUTS``), so a document that many
lines ask questions about is tokenized once, not once per question (on document Q&A, tokenizing
was over half of validation's time before this cut). A pre-tokenizer never lets a token cross its
pre-token boundaries, and where a run of newlines ends is one for the common regexes, but which
side of the run it falls on differs (Qwen and Llama 3 keep a run whole, GPT-2 gives its last
newline a pre-token of its own): each candidate cut is checked at load against the tokenizer's own
ids on texts around newline runs, and none is used if none gives them.
"""

from __future__ import annotations

import functools
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scheduler.ordering import KEY_TOKEN_BYTES, prompt_key
from workers.images import IMAGE_REF, is_image_ref, part_url
from workers.request_bodies import CHAT, COMPLETIONS, EMBEDDINGS, RERANK, SCORE

_NO_LIMIT = 1 << 62
# Where text between added tokens may be cut into separately tokenized pieces, tried in this order
# when a keyer loads; the first giving the tokenizer's own ids on every _LINE_SAMPLES text is used.
_LINE_CUTS = (
    re.compile(r"(?<=\n)(?=\S)"),  # after a run of newlines: `\s*[\r\n]+` (Qwen, Llama 3)
    re.compile(r"(?=\n\S)"),  # before a run's last newline: `\s+(?!\S)` then `\s+` (GPT-2)
)
# Texts around newline runs: what precedes a run, the run, what follows it (never whitespace: a cut
# needs a non-space after the run)
_LINE_SAMPLES = tuple(
    left + run + right
    for left in ("word", "word ", "end.", "end. ", "a,", "1234", "naïve", "日本語", "😀", "tab\t", "x  ", "")
    for run in ("\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n", " \n", "\n \n", "\t\n", "\n\t\n", "\r\r\n")
    for right in (
        "Question",
        "question: why?",
        "1. item",
        "12345",
        "- bullet",
        "(x)",
        "'s",
        "日本",
        "😀x",
        ".",
        "#",
        "Ω",
    )
)
_MAX_CACHED_PIECE = 64 * 1024  # characters: longer pieces are tokenized every time
_DEFAULT_CACHE_BYTES = 32 * 1024 * 1024


def _text_content(content: Any) -> str | None:
    """Message content as one string: text parts joined by newlines, as vLLM's string format does;
    an image validation stored (``workers.images``) stands as its digest, so lines are ordered by
    the image as by the text around it and lines with one image and one prefix run together."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(text for part in content if (text := _part_text(part)) is not None)
    return None


def _part_text(part: Any) -> str | None:
    if not isinstance(part, dict):
        return None
    if part.get("type") == "text" and isinstance(part.get("text"), str):
        return str(part["text"])
    if part.get("type") == "image_url":
        url = part_url(part)
        if is_image_ref(url):
            return f"<image {url[len(IMAGE_REF) : len(IMAGE_REF) + 16]}>"
    return None


def _score_query(body: dict) -> Any:
    """A score body's first query, whichever pair of fields holds it (``workers.scoring``)."""
    for name in ("queries", "data_1", "text_1"):
        value = body.get(name)
        if value is not None:
            return value[0] if isinstance(value, list) and value else value
    return None


def _template_messages(messages: list) -> list:
    """Messages with list-of-parts content flattened to a string (what string-only templates expect)."""
    out = []
    for message in messages:
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            message = {**message, "content": _text_content(message["content"])}
        out.append(message)
    return out


def _fallback_text(messages: list) -> str:
    """Plain ``role\\ncontent`` text for messages the chat template refuses: still groups shared prefixes."""
    lines = []
    for message in messages:
        if isinstance(message, dict):
            lines.append(f"{message.get('role', '')}\n{_text_content(message.get('content')) or ''}")
    return "\n".join(lines)


def _ids(result: Any) -> list[int]:
    """Token ids from either shape ``apply_chat_template(tokenize=True)`` returns."""
    if isinstance(result, list):
        return result
    return list(result["input_ids"])


def _splitter(backend: Any) -> tuple[re.Pattern[str], dict[str, bytes]] | None:
    """A regex that splits text at added tokens, and each added token's key bytes; None if not exact.

    The backend extracts added tokens leftmost-longest before normalizing and pre-tokenizing the text
    between them. That equals a regex alternation longest-first, unless a token strips neighbouring
    whitespace, must be a whole word, or is matched after normalization by a normalizer.
    """
    added = backend.get_added_tokens_decoder()
    if not added:
        return None
    for token in added.values():
        if token.lstrip or token.rstrip or token.single_word:
            return None
        if token.normalized and backend.normalizer is not None:
            return None
    contents = sorted({t.content for t in added.values() if t.content}, key=len, reverse=True)
    if len({t.normalized for t in added.values()}) > 1:
        return None  # two extraction phases; a single alternation could split differently
    pattern = re.compile("(" + "|".join(re.escape(c) for c in contents) + ")")
    specials = {t.content: prompt_key([i], 1) for i, t in added.items() if t.content}
    return pattern, specials


class PromptKeyer:
    """Turns a request body into its prompt key, with one model's tokenizer and chat template."""

    def __init__(
        self, tokenizer: Any, max_tokens: int = 2048, cache_bytes: int = _DEFAULT_CACHE_BYTES
    ) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self._limit = max(0, max_tokens) * KEY_TOKEN_BYTES
        # The Rust tokenizer, when there is one: encoding through it skips transformers' wrapping.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._split: tuple[re.Pattern[str], dict[str, bytes]] | None = None
        self._lines: re.Pattern[str] | None = None  # the line cut (_LINE_CUTS) exact for this tokenizer
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._cache_bytes = cache_bytes
        self._cached = 0
        self._lock = threading.Lock()  # the cache is shared by threads using one keyer_for() keyer
        if self._backend is not None:
            try:
                self._split = _splitter(self._backend)
                if self._split is not None and not self._split_is_exact():
                    self._split = None
                if self._split is not None:
                    self._lines = self._line_cut()
            except Exception:
                self._split = self._lines = None

    @classmethod
    def load(cls, model_path: str | Path, max_tokens: int = 2048) -> PromptKeyer:
        """A keyer for a local Hugging Face model directory (only its tokenizer files are read)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_path)), max_tokens)

    def key(self, endpoint: str, body: dict) -> bytes:
        """The prompt key of one request body; ``b""`` for anything unexpected, never an exception."""
        try:
            job = self._job(endpoint, body)
            if job is None:
                return b""
            if isinstance(job, list):
                return prompt_key(job, self.max_tokens)
            return self._key_text(*job)
        except Exception:
            return b""

    def text_key(self, text: str, add_special_tokens: bool) -> bytes:
        """Key bytes of text tokenized as given (the piece cache serves text without special
        tokens added); unlike ``key`` this raises on failure."""
        return self._key_text(text, add_special_tokens)

    # -- internals -----------------------------------------------------------------------------

    def _job(self, endpoint: str, body: Any) -> list[int] | tuple[str, bool] | None:
        """What to key: token ids as they are, ``(text, add_special_tokens)`` to encode, or None."""
        if not isinstance(body, dict):
            return None
        if endpoint == CHAT:
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None
            return self._chat(messages)
        if endpoint in (COMPLETIONS, EMBEDDINGS):
            prompt = body.get("prompt" if endpoint == COMPLETIONS else "input")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # several prompts (inputs): key by the first
            if isinstance(prompt, str):
                return prompt, True
            if isinstance(prompt, list) and all(type(t) is int for t in prompt):
                return prompt
        if endpoint in (SCORE, RERANK):  # by the (first) query: a query's pairs run together
            query = _score_query(body) if endpoint == SCORE else body.get("query")
            if isinstance(query, str):
                return query, True
        return None

    def _chat(self, messages: list) -> list[int] | tuple[str, bool]:
        """The chat template's rendering of the messages, or the plain fallback text if it raises."""
        try:
            if self._backend is None:
                return _ids(
                    self.tokenizer.apply_chat_template(
                        _template_messages(messages), add_generation_prompt=True, tokenize=True
                    )
                )
            text = self.tokenizer.apply_chat_template(
                _template_messages(messages), add_generation_prompt=True, tokenize=False
            )
            if not isinstance(text, str):
                raise TypeError("chat template did not render one string")
            return text, False
        except Exception:
            return _fallback_text(messages), False

    def text_keys(self, texts: list[str], add_special_tokens: bool) -> list[bytes]:
        """``text_key`` of each text, with what is not cached tokenized in one call of the Rust
        tokenizer's batch API: it spreads the texts over the cores and crosses into Rust once.
        Same bytes as ``text_key`` (a test compares them); raises on failure, as it does."""
        backend = self._backend
        if backend is None or backend.padding is not None:  # padding would change batch ids
            return [self._key_text(text, add_special_tokens) for text in texts]
        if self._split is None or add_special_tokens:
            encoded = backend.encode_batch(texts, add_special_tokens=add_special_tokens)
            return [prompt_key(e.ids, self.max_tokens) for e in encoded]
        specials = self._split[1]
        splits = [self._pieces(text) for text in texts]
        with self._lock:
            missing = {
                piece: None
                for pieces in splits
                for piece in pieces
                if piece and piece not in specials and piece not in self._cache
            }
        fresh: dict[str, bytes] = {}
        if missing:
            encoded = backend.encode_batch(list(missing), add_special_tokens=False)
            fresh = {piece: prompt_key(e.ids, _NO_LIMIT) for piece, e in zip(missing, encoded, strict=True)}
            for piece, fragment in fresh.items():
                self._remember(piece, fragment)
        return [self._assemble(pieces, fresh) for pieces in splits]

    def _key_text(self, text: str, add_special_tokens: bool) -> bytes:
        if self._split is None or add_special_tokens:
            return prompt_key(self._encode(text, add_special_tokens), self.max_tokens)
        return self._assemble(self._pieces(text), {})

    def _pieces(self, text: str) -> list[str]:
        """The text cut at its added tokens (kept as pieces of their own), and the text between
        them cut between lines where this tokenizer allows it (``_LINE_CUTS``)."""
        assert self._split is not None
        pattern, specials = self._split
        pieces = pattern.split(text)
        lines = self._lines
        if lines is None:
            return pieces
        out: list[str] = []
        for piece in pieces:
            if "\n" in piece and piece not in specials:
                out.extend(lines.split(piece))
            else:
                out.append(piece)
        return out

    def _assemble(self, pieces: list[str], fresh: dict[str, bytes]) -> bytes:
        """A text's key from its pieces (split at added tokens), up to the key's length."""
        assert self._split is not None
        specials = self._split[1]
        limit = self._limit
        parts: list[bytes] = []
        size = 0
        for piece in pieces:
            if size >= limit:
                break
            if not piece:
                continue
            fragment = specials.get(piece)
            if fragment is None:
                fragment = fresh.get(piece)
            if fragment is None:
                fragment = self._piece(piece)
            parts.append(fragment)
            size += len(fragment)
        key = b"".join(parts)
        return key[:limit] if size > limit else key

    def _piece(self, piece: str) -> bytes:
        """Key bytes of the text between two added tokens, from the LRU cache when seen before."""
        cache = self._cache
        with self._lock:
            fragment = cache.get(piece)
            if fragment is not None:
                cache.move_to_end(piece)
                return fragment
        fragment = prompt_key(self._encode(piece, False), _NO_LIMIT)
        self._remember(piece, fragment)
        return fragment

    def _remember(self, piece: str, fragment: bytes) -> None:
        if len(piece) > _MAX_CACHED_PIECE:
            return
        cache = self._cache
        with self._lock:
            if piece not in cache:
                cache[piece] = fragment
                self._cached += len(piece) + len(fragment)
            while self._cached > self._cache_bytes and cache:
                old, old_fragment = cache.popitem(last=False)
                self._cached -= len(old) + len(old_fragment)

    def _encode(self, text: str, add_special_tokens: bool) -> Sequence[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _split_is_exact(self) -> bool:
        """Check the piecewise encoding against the tokenizer's own on texts around its added tokens."""
        assert self._split is not None
        specials = list(self._split[1])
        samples = ["Hello world", " two  spaces\n\nnew lines\t", "naïve café 1234 ", "x"]
        texts = [s + special + t for special in specials for s in samples for t in samples]
        texts.append("".join(specials) + " " + "".join(reversed(specials)))
        for text in texts:
            expected = prompt_key(self._encode(text, False), _NO_LIMIT)
            if self._key_text(text, False) != expected[: self._limit]:
                return False
        self._cache.clear()
        self._cached = 0
        return True

    def _line_cut(self) -> re.Pattern[str] | None:
        """The first of ``_LINE_CUTS`` whose pieces, tokenized apart, give this tokenizer's own ids
        for every ``_LINE_SAMPLES`` text; None when none does (no cut between lines)."""
        backend = self._backend
        assert backend is not None  # a piece split (the caller's condition) needs the Rust tokenizer
        texts = list(_LINE_SAMPLES)
        expected = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        for cut in _LINE_CUTS:
            cuts = [[piece for piece in cut.split(text) if piece] for text in texts]
            pieces = list({piece: None for pieces in cuts for piece in pieces})
            ids = dict(
                zip(
                    pieces,
                    (e.ids for e in backend.encode_batch(pieces, add_special_tokens=False)),
                    strict=True,
                )
            )
            if all(
                [i for piece in pieces_of for i in ids[piece]] == want
                for pieces_of, want in zip(cuts, expected, strict=True)
            ):
                return cut
        return None


@functools.lru_cache(maxsize=8)
def keyer_for(path: str | Path, max_tokens: int = 2048) -> PromptKeyer:
    """One keyer per (model path, max_tokens) per process: loading a tokenizer takes a while."""
    return PromptKeyer.load(path, max_tokens)
