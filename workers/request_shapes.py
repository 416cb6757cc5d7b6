"""Request shapes: vLLM's request model runs once per shape of request in a file, not once a line.

Why: validating a line with vLLM's pydantic request model and building its sampling parameters
(`request_bodies.parse_body`) is about two thirds of validation's CPU (0.2 of 0.32 ms a line on
the AVX2 host), and a batch file of a million lines usually holds a handful of request shapes:
the same fields, sampling values and message roles, with different text. Nothing in
`parse_body` reads the text of a message or a completions prompt beyond its type and whether it
is empty (Freight's checks and vLLM's validators look at roles, types, fields and values), so a
body whose shape was accepted before is accepted again, with the same output budget.

The rule that keeps this exact: only acceptances are remembered. A line whose shape is new, or
whose shape was never accepted, goes through `parse_body` itself, so every error line (its code,
message and param) is the full path's own. `tests/workers/test_request_shapes.py` checks the
fast and full paths agree on generated bodies.

Bounded: a shape is remembered only when its key is short (`MAX_KEY_CHARS`), and at most
`MAX_SHAPES` are kept (least recently used go first). One cache per validated file, so nothing
of one tenant's file outlives its validation.
"""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from workers.request_bodies import CHAT, ParsedRequest, parse_body
from workers.responses import RESPONSES

MAX_KEY_CHARS = 4096  # longer shapes (long token-id prompts, big schemas) are parsed every time
MAX_SHAPES = 1024  # remembered acceptances per file: at most ~4 MB of keys


def _placeholder(text: str) -> str:
    # the only property of a text parse_body can see: whether it is empty
    return "x" if text else ""


def _message_shape(message: dict) -> dict:
    """A chat message or a Responses message item with its texts (content, text parts) reduced."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": _placeholder(content)}  # same key order
    if isinstance(content, list):
        parts = [
            {**p, "text": _placeholder(p["text"])}
            if isinstance(p, dict) and isinstance(p.get("text"), str)
            else _image_shape(p)
            for p in content
        ]
        return {**message, "content": parts}
    return message


def _image_shape(part: Any) -> Any:
    """An image part with its URL reduced to "empty or not" (what parse_body checks of a tenant's
    URL: ``workers.images`` judges the rest, line by line), so lines that differ only in their
    images share a shape (a data: URL alone would make every key too long to remember). The
    references validation writes (``freight-image:``, ``freight-refused:``) are kept whole: a stored
    body's parse checks what they name."""
    if not isinstance(part, dict):
        return part
    if part.get("type") == "image_url" and isinstance(part.get("image_url"), dict):
        url = part["image_url"].get("url")
        if isinstance(url, str) and not url.startswith("freight-"):
            return {**part, "image_url": {**part["image_url"], "url": _placeholder(url)}}
    if part.get("type") == "input_image":
        url = part.get("image_url")
        if isinstance(url, str) and not url.startswith("freight-"):
            return {**part, "image_url": _placeholder(url)}
    return part


def _chat_shape(body: dict) -> dict | None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    if not all(isinstance(message, dict) for message in messages):
        return None
    return {**body, "messages": [_message_shape(message) for message in messages]}


def _responses_shape(body: dict) -> dict:
    """A Responses body with the texts of `instructions`, a string `input` and its message items
    reduced (`workers.responses.to_chat` reads only their emptiness too); function-call items are
    kept whole."""
    shape = dict(body)
    for name in ("instructions", "input"):
        if isinstance(body.get(name), str):
            shape[name] = _placeholder(body[name])
    items = body.get("input")
    if isinstance(items, list):
        shape["input"] = [
            _message_shape(item)
            if isinstance(item, dict) and item.get("type", "message" if "role" in item else None) == "message"
            else item
            for item in items
        ]
    return shape


def shape_key(endpoint: str, body: dict) -> str | None:
    """The body with its texts reduced to "empty or not", as a string; None when it is not worth
    remembering (too long) or cannot be written (a number JSON cannot hold, too deep)."""
    if endpoint == CHAT:
        shape = _chat_shape(body)
    elif endpoint == RESPONSES:
        shape = _responses_shape(body)
    else:
        prompt = body.get("prompt")
        shape = {**body, "prompt": _placeholder(prompt)} if isinstance(prompt, str) else body
    if shape is None:
        return None
    try:
        key = json.dumps(shape, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):  # odd input: the full path reports it
        return None
    return f"{endpoint} {key}" if len(key) <= MAX_KEY_CHARS else None


class RequestShapes:
    """`parse_body(endpoint, body).max_tokens` with accepted shapes remembered (see the module)."""

    def __init__(self, max_shapes: int = MAX_SHAPES) -> None:
        self.max_shapes = max_shapes
        self._accepted: OrderedDict[str, int | None] = OrderedDict()  # shape key -> max_tokens
        self.hits = 0
        self.misses = 0

    def max_tokens(
        self, endpoint: str, body: dict, auto_tools: bool = False, reasoning: bool = False
    ) -> int | None:
        """The output budget the body asks for; raises RequestError exactly as parse_body does
        (``auto_tools``, ``reasoning``: the body's model has a tool-call parser, a reasoning parser;
        the key holds the model's name, so one key always meets the same answer)."""
        key = shape_key(endpoint, body)
        if key is not None and key in self._accepted:
            self._accepted.move_to_end(key)
            self.hits += 1
            return self._accepted[key]
        self.misses += 1
        # raises: nothing is remembered
        budget = parse_body(endpoint, body, auto_tools=auto_tools, reasoning=reasoning).max_tokens
        if key is not None:
            self._accepted[key] = budget
            if len(self._accepted) > self.max_shapes:
                self._accepted.popitem(last=False)
        return budget


# Body fields a reused parse may hold: scalars, or (stop) a list SamplingParams only reads. A
# shape with any other field (tools, response_format, logit_bias, ...) is parsed every time,
# since its parsed request holds objects vLLM may annotate per request, which copies would share.
REUSABLE_FIELDS = frozenset(
    {
        "model", "messages", "max_tokens", "max_completion_tokens", "min_tokens", "n",
        "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "stop",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs",
        "user", "skip_special_tokens", "spaces_between_special_tokens",
        "include_stop_str_in_output", "add_generation_prompt", "continue_final_message", "echo",
    }
)  # fmt: skip


class ParsedShapes:
    """`parse_body` for the engine worker, which parses every chat line again before it runs:
    a line of a shape seen before gets its shape-mate's parsed request with its own messages and
    a request id of its own (`request_id` is the response's id), and vLLM's request model does not
    run.

    Why: that parse is about 0.09 ms of the engine thread's time a line (2% of the engine's
    wall at a few hundred requests a second on the CPU host; on a GPU, far more of it), and a
    file holds a handful of shapes. Exact for the same reason as the shape cache above: nothing in
    the parse reads a message's text beyond its emptiness, and vLLM's model keeps the messages as
    given, which is checked on the shape's first line (a shape whose parsed messages differ from
    its body's is never reused). Only chat bodies decoded afresh from the request store
    (``validated``) of `REUSABLE_FIELDS` are reused; `tests/workers/test_request_shapes.py`
    checks the reused parse equals the full one on generated bodies.

    ``scope`` keys the cache too (the engine passes the request's cache salt): with prefix caches
    kept per tenant, no tenant's lines are parsed from another's. Bounded like `RequestShapes`.
    """

    def __init__(self, max_shapes: int = MAX_SHAPES) -> None:
        self.max_shapes = max_shapes
        # (scope, parser flags, shape key) -> the shape's parse, its messages emptied: no text of a
        # line stays in the worker's memory once its request has run
        self._parsed: OrderedDict[tuple[str | None, bool, bool, str], ParsedRequest] = OrderedDict()
        # (parser flags, shape key, max_tokens) -> the SamplingParams its lines share
        self._sampling: OrderedDict[tuple[bool, bool, str, int], Any] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.sampling_hits = 0

    def parse(
        self,
        endpoint: str,
        body: dict,
        *,
        validated: bool,
        auto_tools: bool = False,
        reasoning: bool = False,
        scope: str | None = None,
    ) -> ParsedRequest:
        """What ``parse_body(endpoint, body, ...)`` returns; raises RequestError as it does."""
        key = None
        if validated and endpoint == CHAT and isinstance(body, dict) and body.keys() <= REUSABLE_FIELDS:
            shape = shape_key(endpoint, body)
            key = None if shape is None else (scope, auto_tools, reasoning, shape)
        if key is not None:
            hit = self._parsed.get(key)
            if hit is not None:
                self._parsed.move_to_end(key)
                self.hits += 1
                from vllm.utils import random_uuid

                request = hit.request.model_copy(
                    update={"messages": body["messages"], "request_id": random_uuid(), "bad_words": []}
                )
                return replace(hit, request=request)
        self.misses += 1
        given = copy.deepcopy(body.get("messages")) if key is not None else None
        parsed = parse_body(endpoint, body, validated=validated, auto_tools=auto_tools, reasoning=reasoning)
        if key is not None and parsed.request.messages == given == body["messages"]:
            parsed = replace(parsed, shape=key[1:])
            self._parsed[key] = replace(parsed, request=parsed.request.model_copy(update={"messages": []}))
            if len(self._parsed) > self.max_shapes:
                self._parsed.popitem(last=False)
        return parsed

    def sampling_params(self, parsed: ParsedRequest, max_tokens: int, build: Callable[[], Any]) -> Any:
        """``build()``'s SamplingParams, built once per shape and output budget.

        Why: building them (vLLM's ``to_sampling_params``) was about 2% of the engine thread's
        samples on the request-rate workload, once per line although a file's lines share a
        handful of shapes. Exact: they are a function of the request's fields other than its
        messages, which the shape holds whole, the parser flags, which it holds too, the output
        budget, which is the key's other half, and the engine's defaults, fixed for this cache's
        engine. Sharing one object is safe because vLLM clones a request's SamplingParams as it
        takes it (``InputProcessor.process_inputs``) and Freight never changes them after
        ``build``. A ``build`` that raises (a value vLLM refuses) leaves nothing behind.
        """
        if parsed.shape is None:
            return build()
        key = (*parsed.shape, max_tokens)
        params = self._sampling.get(key)
        if params is not None:
            self._sampling.move_to_end(key)
            self.sampling_hits += 1
            return params
        params = build()
        self._sampling[key] = params
        if len(self._sampling) > self.max_shapes:
            self._sampling.popitem(last=False)
        return params
