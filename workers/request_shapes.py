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

import json
from collections import OrderedDict

from workers.request_bodies import CHAT, parse_body
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
            else p
            for p in content
        ]
        return {**message, "content": parts}
    return message


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
