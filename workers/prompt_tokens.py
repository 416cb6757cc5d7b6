"""Prompt token ids at validation time: each request is rendered and tokenized once, here, and the
engine worker feeds those ids to vLLM instead of rendering the prompt again.

Why exactness needs care: the engine would otherwise render with vLLM's renderer (chat template,
content-format detection, system-message handling, ``add_special_tokens`` rules). Doing all of that
per line through vLLM costs about 0.7 ms; this module does the common case at a tenth of that with
``workers.prompts.PromptKeyer``'s piecewise, cached tokenization, and only where it provably gives
vLLM's ids: plain conversations (system first, then user/assistant turns of text) with fields that
do not touch the prompt, on a model whose template takes string content; completions prompts
(text or token ids) without ``echo``. Anything else gets ``ids=None``: it still gets its prefix key
(as before), and the engine renders it itself, exactly as it always did. Tests compare these ids
with the engine's own rendering.

Image lines (a vision model's template takes content as a list of parts, vLLM's "openai" format):
the template renders each image part as the model's one placeholder token, which vLLM's processor
expands by the image's size when the engine hands it the ids with the images (``workers.rendering``).
Their ordering key is not their ids (an image's placeholder is the same token for every image):
it is ``PromptKeyer``'s, which names each image by its digest, and the ids are kept beside it. On
the demo VLM the engine then spends 0.73 ms a line instead of vLLM's 1.32 ms chat rendering
(template, tokenization and the processor: Xeon AVX-512 host, 200 lines over 10 images).

A model whose tokenizer cannot be loaded fails validation with ``TokenizerUnavailable`` (no silent
file order): the engine worker could not run it either.
"""

from __future__ import annotations

import functools
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, cast

from scheduler.ordering import KEY_TOKEN_BYTES, prompt_key
from workers.chat_skeletons import ChatSkeletons
from workers.images import is_image_ref
from workers.prompts import PromptKeyer, _template_messages
from workers.request_bodies import CHAT, COMPLETIONS, EMBEDDINGS
from workers.responses import RESPONSES, prompt_chat_body

_ALL = 1 << 40  # tokens: "no limit" for a full rendering
_ROLES = frozenset({"system", "user", "assistant"})
# Body fields that never change the rendered prompt (sampling and output options): a body with
# anything else (tools, chat_template_kwargs, echo, add_generation_prompt, truncate_prompt_tokens,
# cache_salt, add_special_tokens, documents, ...) is left to the engine's renderer.
PROMPT_NEUTRAL = frozenset(
    {
        "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
        "top_k", "min_p", "n", "stop", "stop_token_ids", "seed", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs", "logit_bias",
        "response_format", "structured_outputs", "min_tokens", "ignore_eos", "user", "metadata",
        "store", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
        "length_penalty", "stream", "stream_options", "parallel_tool_calls", "service_tier",
    }
)  # fmt: skip


# An embeddings body's fields (workers/embeddings.py): none changes how its inputs tokenize
EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


class TokenizerUnavailable(Exception):
    """The model's tokenizer could not be loaded where validation runs."""

    def __init__(self, model: str, path: str, cause: BaseException) -> None:
        super().__init__(f"the tokenizer of model {model!r} could not be loaded from {path}: {cause}")
        self.model = model


@dataclass(frozen=True)
class RenderedPrompt:
    key_bytes: bytes  # big-endian uint32 ids: all of them when exact, else a key's worth
    exact: bool  # the engine's prompt token ids are known: key_bytes, or ids_bytes where given
    key_tokens: int  # how many of them make the ordering key
    # the ids when the key is not made of them (an image line: its key names each image)
    ids_bytes: bytes | None = None

    @property
    def key(self) -> bytes:
        return self.key_bytes[: self.key_tokens * KEY_TOKEN_BYTES]

    @property
    def prompt_len(self) -> int:
        """Exact when ``exact`` (an image counts as its one placeholder token: vLLM's processor
        expands it); otherwise a lower bound (the key's length)."""
        return len(self.id_bytes or self.key_bytes) // KEY_TOKEN_BYTES

    @property
    def id_bytes(self) -> bytes | None:
        if not self.exact:
            return None
        return self.key_bytes if self.ids_bytes is None else self.ids_bytes

    def token_ids(self) -> list[int] | None:
        ids = self.id_bytes
        return None if ids is None else ids_of(ids)


class _Text(NamedTuple):
    """A prompt to tokenize exactly (``special``: with the tokenizer's special tokens added), and
    the body and endpoint it came from, to key if tokenizing fails; ``key``: the ordering key when
    it is not the ids' (an image line's)."""

    text: str
    special: bool
    endpoint: str
    body: Mapping[str, Any]
    key: bytes | None = None

    def rendered(self, ids: bytes, key_tokens: int) -> RenderedPrompt:
        if self.key is None:
            return RenderedPrompt(ids, True, key_tokens)
        return RenderedPrompt(self.key, True, key_tokens, ids)


def ids_of(key_bytes: bytes) -> list[int]:
    ids = array("I")
    ids.frombytes(key_bytes)
    if sys.byteorder == "little":
        ids.byteswap()
    return ids.tolist()


class PromptRenderer:
    """One model's prompt rendering for validation (thread-safe: the keyer's cache is locked)."""

    def __init__(self, tokenizer: Any, key_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.key_tokens = key_tokens
        self.full = PromptKeyer(tokenizer, _ALL)
        self.keyer = PromptKeyer(tokenizer, key_tokens)
        template = getattr(tokenizer, "chat_template", None)
        self.chat_exact = isinstance(template, str) and _string_content(template)
        # a template of content parts (a vision model's): image lines render exactly too
        self.chat_parts = isinstance(template, str) and not self.chat_exact and _parts_content(template)
        self.skeletons = ChatSkeletons(tokenizer)  # the template once per conversation shape

    @classmethod
    def load(cls, path: str | Path, key_tokens: int) -> PromptRenderer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)), key_tokens)

    def render(self, endpoint: str, body: Mapping[str, Any]) -> RenderedPrompt:
        """The prompt's ids when they can be had exactly, else its prefix key; never raises. A
        Responses body's prompt is its chat translation's (`workers.responses`), as the engine's is."""
        return self._finish(self._job(endpoint, body))

    def render_many(self, endpoint: str, bodies: Sequence[Mapping[str, Any]]) -> list[RenderedPrompt]:
        """``render`` of each body, with the texts to tokenize tokenized together (the tokenizer's
        batch API, `PromptKeyer.text_keys`); the same results, line for line."""
        jobs = [self._job(endpoint, body) for body in bodies]
        out = [job if isinstance(job, RenderedPrompt) else None for job in jobs]
        for special in (False, True):
            where = [i for i, job in enumerate(jobs) if isinstance(job, _Text) and job.special is special]
            if not where:
                continue
            texts = [cast(_Text, jobs[i]).text for i in where]
            try:
                keys: list[bytes | None] = list(self.full.text_keys(texts, special))
            except Exception:  # as render does: each text that fails gets its key the other way
                keys = [None] * len(where)
            for i, key_bytes in zip(where, keys, strict=True):
                if key_bytes is None:
                    out[i] = self._finish(jobs[i])  # alone, as render would (not prepared again)
                else:
                    out[i] = cast(_Text, jobs[i]).rendered(key_bytes, self.key_tokens)
        return out  # type: ignore[return-value]  # every slot filled above

    def _job(self, endpoint: str, body: Mapping[str, Any]) -> RenderedPrompt | _Text:
        """Everything of ``render`` but tokenizing a text: a finished rendering, or the text."""
        if endpoint == RESPONSES:
            chat = prompt_chat_body(dict(body))
            if chat is None:  # it cannot run: no key
                return RenderedPrompt(b"", False, self.key_tokens)
            endpoint, body = CHAT, chat
        try:
            text = self._exact_text(endpoint, body)
            if text is not None:
                return _Text(*text, endpoint, body)
            parts = self._parts_text(endpoint, body)
            if parts is not None:
                return _Text(parts, False, endpoint, body, self.keyer.key(endpoint, dict(body)))
            ids = self._exact_ids(endpoint, body)
            if ids is not None:
                return RenderedPrompt(prompt_key(ids, _ALL), True, self.key_tokens)
        except Exception:
            pass
        return self._key_only(endpoint, body)

    def _finish(self, job: RenderedPrompt | _Text) -> RenderedPrompt:
        """A job's rendering: its text tokenized alone, or its key if that fails."""
        if isinstance(job, RenderedPrompt):
            return job
        try:
            return job.rendered(self.full.text_key(job.text, job.special), self.key_tokens)
        except Exception:
            return self._key_only(job.endpoint, job.body)

    def _key_only(self, endpoint: str, body: Mapping[str, Any]) -> RenderedPrompt:
        return RenderedPrompt(self.keyer.key(endpoint, dict(body)), False, self.key_tokens)

    def _exact_text(self, endpoint: str, body: Mapping[str, Any]) -> tuple[str, bool] | None:
        if endpoint == EMBEDDINGS:  # one text: its ids exactly; several: the engine tokenizes each
            text = _one_prompt(body.get("input"))
            return (text, True) if isinstance(text, str) and text and set(body) <= EMBEDDING_FIELDS else None
        if not set(body) <= PROMPT_NEUTRAL:
            return None
        if endpoint == CHAT and self.chat_exact and _plain_messages(body.get("messages")):
            messages = _template_messages(body["messages"])
            text = self.skeletons.render(messages)
            if text is None:
                text = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                )
            return (text, False) if isinstance(text, str) else None
        if endpoint == COMPLETIONS:
            prompt = _one_prompt(body.get("prompt"))
            if isinstance(prompt, str) and prompt:
                return prompt, True
        return None

    def _parts_text(self, endpoint: str, body: Mapping[str, Any]) -> str | None:
        """A chat prompt with images (or parts) for a template of content parts, rendered as vLLM
        renders it (``_parts_messages``); None where that is not provably the same."""
        if endpoint != CHAT or not self.chat_parts or not set(body) <= PROMPT_NEUTRAL:
            return None
        messages = _parts_messages(body.get("messages"))
        if messages is None:
            return None
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text if isinstance(text, str) else None

    def _exact_ids(self, endpoint: str, body: Mapping[str, Any]) -> list[int] | None:
        if endpoint == EMBEDDINGS and set(body) <= EMBEDDING_FIELDS:
            prompt = _one_prompt(body.get("input"))
        elif endpoint != COMPLETIONS or not set(body) <= PROMPT_NEUTRAL:
            return None
        else:
            prompt = _one_prompt(body.get("prompt"))
        if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < 2**31 for t in prompt):
            return prompt
        return None


def _one_prompt(prompt: Any) -> Any:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]
    return prompt


def _plain_turns(messages: Any) -> list[tuple[str, Any]] | None:
    """Each message's role and content where every one is a system (first only), user or
    assistant turn with no other field, and none is a system turn vLLM's parsing edits; else None."""
    if not isinstance(messages, list) or not messages:
        return None
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            return None
        role, content = message.get("role"), message.get("content")
        if role not in _ROLES or (role == "system" and i > 0) or _stripped_by_vllm(role, content):
            return None
        turns.append((role, content))
    return turns


def _plain_messages(messages: Any) -> bool:
    """System (first only), user and assistant turns of text: what every renderer agrees on."""
    turns = _plain_turns(messages)
    if turns is None:
        return False
    for _, content in turns:
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                and set(p) <= {"type", "text"}
                for p in content
            ):  # fmt: skip
                return False
        elif not isinstance(content, str):
            return False
    return True


def _parts_messages(messages: Any) -> list[dict[str, Any]] | None:
    """What vLLM's chat parsing hands a content-parts template ("openai" format) for plain turns
    (system first only, user and assistant) of text parts and stored images: each message's content
    as a list, a string as one text part, an image as ``{"type": "image"}``; None for anything else
    (a link not stored yet, an image's ``detail`` or ``uuid``, other part types or message fields)."""
    turns = _plain_turns(messages)
    if turns is None:
        return None
    out = []
    for role, content in turns:
        if isinstance(content, str):
            parts: list[dict[str, Any] | None] = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = [_template_part(part) for part in content]
            if None in parts:
                return None
        else:
            return None
        out.append({"role": role, "content": parts})
    return out


def _template_part(part: Any) -> dict[str, Any] | None:
    """A text part as it is, a stored image as ``{"type": "image"}``; None for anything else."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind == "text" and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}:
        return {"type": "text", "text": part["text"]}
    url = part.get("image_url")
    if (
        kind == "image_url"
        and set(part) == {"type", "image_url"}
        and isinstance(url, dict)
        and set(url) == {"url"}
    ):
        return {"type": "image"} if is_image_ref(url["url"]) else None
    return None


def _stripped_by_vllm(role: Any, content: Any) -> bool:
    """A system turn vLLM's chat parsing edits (it drops a Claude Code billing header line)."""
    if role != "system":
        return False
    if isinstance(content, str):
        texts: list[Any] = [content]
    else:
        texts = [p.get("text") for p in content if isinstance(p, dict)] if isinstance(content, list) else []
    return any(isinstance(t, str) and t.startswith("x-anthropic-billing-header") for t in texts)


def _parts_content(template: str) -> bool:
    """vLLM passes content as a list of parts to templates it detects as "openai"-format."""
    try:
        from vllm.renderers.hf import _detect_content_format

        return _detect_content_format(template, default="string") == "openai"
    except Exception:
        return False


def _string_content(template: str) -> bool:
    """vLLM passes content as a string to templates it detects as string-format (most)."""
    try:
        from vllm.renderers.hf import _detect_content_format

        return _detect_content_format(template, default="string") == "string"
    except Exception:
        return False


@functools.lru_cache(maxsize=8)
def renderer_for(path: str, key_tokens: int) -> PromptRenderer:
    """One renderer per checkpoint per process: loading a tokenizer takes a while."""
    return PromptRenderer.load(path, key_tokens)
