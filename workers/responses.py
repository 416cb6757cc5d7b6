"""`/v1/responses` batch lines: a Responses API body turned into the chat request Freight already
runs, and the chat result turned back into a Response object.

Why a translation rather than a third request path: a Responses body on a chat model *is* a chat
request (its `input` messages, `instructions` as a first system message, `max_output_tokens`,
`text.format` as `response_format`, flat function tools as chat's nested ones). Translated, it goes
through chat's validation, tokenization, prefix ordering, packing, structured outputs, forced and
parsed tool calls, cost and cache accounting unchanged, and only the two ends differ. Both ends are
here and pure (no vLLM import): `to_chat` at validation and on the engine worker
(`workers.request_bodies.parse_body` calls it, then parses the chat body as chat; errors it raises
or chat's name Responses fields: `input.2.content.0`, `max_output_tokens`, `text.format`),
`response_from_chat` when the result is written (`workers.rendering.build_response_body`).

What a batch cannot honour is that line's `unsupported_parameter` 400 naming the field, never
ignored: stored responses and conversations (`previous_response_id`, `conversation`, `store: true`:
a batch keeps only its output file), streaming, `background`, `include`, stored `prompt`s, built-in
tools (`web_search`, `file_search`, ...), image/file/audio input parts, `truncation: "auto"`,
`text.verbosity`, reasoning summaries, and `reasoning` on a model whose registry entry reads no
reasoning back (no `reasoning_parser` engine arg). A field the
Responses API does not have (`seed`, `stop`, a misspelling) is malformed input, as for chat.
`developer` messages are sent to the chat template as `system` (open models' templates know no
other instruction role).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from workers.request_errors import RequestError, clip_message

RESPONSES = "/v1/responses"

INVALID, UNSUPPORTED = "invalid_request", "unsupported_parameter"
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = frozenset({"input_text", "output_text"})
_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
_TOOL_KEYS_REFUSED = frozenset({"defer_loading", "allowed_callers", "output_schema", "async"})
_METADATA_KEYS, _METADATA_KEY_CHARS, _METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits
_STORE = "a batch keeps no response store (its output file holds the responses)"
_HISTORY = "a batch keeps no stored responses; send the whole conversation in `input`"
# Responses fields a batch cannot honour, and why; `_ABSENT` values mean "not asked for"
_REFUSED = {
    "previous_response_id": _HISTORY,
    "conversation": _HISTORY,
    "prompt": "stored prompt templates are not available; send the text in `input`",
    "background": "every batch request runs in the background already",
    "background_options": "every batch request runs in the background already",
    "stream": "streaming is not available in batch requests",
    "stream_options": "streaming is not available in batch requests",
    "include": "no extra output data (logprobs, encrypted reasoning, tool results) is produced",
    "top_logprobs": "log probabilities are not produced for Responses lines (chat lines have `logprobs`)",
    "truncation": "the input is never truncated; a prompt too long for the model is that line's error",
    "max_tool_calls": "a line makes one model turn; limit calls with `parallel_tool_calls: false`",
    "service_tier": "a batch's priority comes from its completion_window",
    "prompt_cache_key": "Freight orders requests by prefix and keeps each tenant's prefix cache itself",
    "prompt_cache_retention": "Freight orders requests by prefix and keeps each tenant's prefix cache itself",
    "context_management": "a line makes one model turn over the input it is given",
    "moderation": "no moderation is run",
    "image": "image generation is not available",
    "access_programs": "not available in batch requests",
    "input_transformations": "not available in batch requests",
}
_ABSENT: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "stream": (False,),
    "include": ([],),
    "truncation": ("disabled",),
    "service_tier": ("auto", "default"),
}
FIELDS = frozenset(
    {
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text",
        "tools", "tool_choice", "parallel_tool_calls", "metadata", "user", "safety_identifier",
        "store", "reasoning", *_REFUSED,
    }
)  # fmt: skip
_CHAT_PARAMS = {  # chat's param -> the Responses field it came from
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "structured_outputs": "text.format",
    "reasoning_effort": "reasoning.effort",
    "tool_choice.function.name": "tool_choice.name",
    "tool_choice.function": "tool_choice",
}
_MESSAGE_PARAM = re.compile(r"messages\.(\d+)(.*)")
_TOOL_PARAM = re.compile(r"tools\.(\d+)\.function(.*)")


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses body as chat: `chat` is the chat-completions body to parse and run, `echo` the
    Responses fields a Response object repeats, `origins` the Responses place of each chat message
    (`instructions`, `input`, `input.3`) so that chat's errors can name it."""

    chat: dict[str, Any]
    echo: dict[str, Any]
    origins: tuple[str, ...] = ()

    def responses_error(self, exc: RequestError) -> RequestError:
        """Chat's error for the translated body, its param naming the Responses field."""
        return RequestError(exc.code, exc.message, self.responses_param(exc.param), exc.status_code)

    def responses_param(self, param: str | None) -> str | None:
        if not param:
            return param
        if param in _CHAT_PARAMS or param.split(".", 1)[0] in ("response_format", "structured_outputs"):
            return _CHAT_PARAMS.get(param) or "text.format"
        message = _MESSAGE_PARAM.fullmatch(param)
        if message and int(message.group(1)) < len(self.origins):
            origin, rest = self.origins[int(message.group(1))], message.group(2)
            # a string input or instructions is one message; earlier calls merged into one turn
            if origin in ("input", "instructions") or rest.startswith((".tool_calls", ".tool_call_id")):
                return origin
            return origin + rest
        if param == "messages":
            return "input"
        tool = _TOOL_PARAM.fullmatch(param)
        if tool:
            return f"tools.{tool.group(1)}{tool.group(2)}"
        return param


def _error(where: str, message: str, code: str = INVALID) -> RequestError:
    return RequestError(code, clip_message(message), where)


# --------------------------------------------------------------------------- request


def to_chat(data: dict[str, Any], *, reasoning: bool = False) -> ResponsesRequest:
    """A Responses body (a JSON object) -> the chat body Freight runs, or RequestError naming the
    Responses field. ``reasoning``: the model reads reasoning back (see the module), so
    `reasoning` can be honoured."""
    _refuse_unservable(data)
    messages, origins = _messages(data.get("instructions"), data.get("input"))
    chat = _chat_body(data, messages, reasoning)
    for name in ("user", "safety_identifier"):
        if data.get(name) is not None and not isinstance(data[name], str):
            raise _error(name, f"`{name}` must be a string.")
    _check_metadata(data.get("metadata"))
    echo: dict[str, Any] = {}
    for name in _ECHOED:
        if data.get(name) is not None:
            echo[name] = data[name]
    return ResponsesRequest(chat, echo, tuple(origins))


# the Responses fields a Response object repeats, in its order
_ECHOED = (
    "instructions", "max_output_tokens", "temperature", "top_p", "text", "tools", "tool_choice",
    "parallel_tool_calls", "metadata", "user", "safety_identifier", "reasoning",
)  # fmt: skip


def _refuse_unservable(data: dict[str, Any]) -> None:
    """What a batch cannot honour (the _REFUSED fields, `store: true`) and fields Responses does not have."""
    for name, why in _REFUSED.items():
        value = data.get(name)
        if value is not None and not any(
            type(value) is type(a) and value == a for a in _ABSENT.get(name, ())
        ):
            raise _error(name, f"`{name}` is not supported: {why}.", UNSUPPORTED)
    if data.get("store") is not None and data["store"] is not False:
        if data["store"] is True:
            raise _error(
                "store",
                f"`store: true` is not supported: {_STORE}; set it to false or leave it out.",
                UNSUPPORTED,
            )
        raise _error("store", "`store` must be a boolean.")
    unknown = sorted((str(k) for k in set(data) - FIELDS), key=str)
    if unknown:  # as for chat: a misspelt parameter silently ignored hides bugs
        raise _error(unknown[0][:100], f"Unrecognized request argument supplied: {unknown[0][:100]}")


def _chat_body(data: dict[str, Any], messages: list[dict[str, Any]], reasoning: bool) -> dict[str, Any]:
    """The chat body of the translated messages and the Responses fields chat has a name for."""
    chat: dict[str, Any] = {"messages": messages}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls", "user"):
        if data.get(name) is not None:
            chat[name] = data[name]
    max_output = data.get("max_output_tokens")
    if max_output is not None:
        if type(max_output) is not int or max_output < 1:
            raise _error("max_output_tokens", "`max_output_tokens` must be a positive integer.")
        chat["max_completion_tokens"] = max_output
    text = _text_format(data.get("text"))
    if text is not None:
        chat["response_format"] = text
    tools = _tools(data.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    if data.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(data["tool_choice"])
    effort = _reasoning(data.get("reasoning"), reasoning)
    if effort is not None:
        chat["reasoning_effort"] = effort
    return chat


def _messages(instructions: Any, given: Any) -> tuple[list[dict[str, Any]], list[str]]:
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _error("instructions", "`instructions` must be a string.")
        if instructions:
            messages.append({"role": "system", "content": instructions})
            origins.append("instructions")
    if isinstance(given, str):
        if not given:
            raise _error("input", "`input` must not be empty.")
        messages.append({"role": "user", "content": given})
        origins.append("input")
        return messages, origins
    if not isinstance(given, list) or not given:
        raise _error("input", "`input` is required: a string or a non-empty array of input items.")
    for k, item in enumerate(given):
        where = f"input.{k}"
        if not isinstance(item, dict):
            raise _error(where, f"`{where}` must be an object (a message or a function call item).")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # consecutive calls are one assistant turn
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_call_output(item, where))
        elif isinstance(kind, str):
            raise _error(
                where,
                f"`{where}`: input items of type {kind[:64]!r} are not supported; use messages, "
                "function_call and function_call_output items.",
                UNSUPPORTED,
            )
        else:
            raise _error(where, f"`{where}` needs a `role` (a message) or a `type`.")
        origins.append(where)
    return messages, origins


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    extra = sorted(str(k) for k in set(item) - _MESSAGE_KEYS)
    if extra:
        raise _error(f"{where}.{extra[0][:64]}", f"Unrecognized field in `{where}`: {extra[0][:64]}")
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise _error(f"{where}.role", f"`{where}.role` must be one of user, system, developer, assistant.")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": _ROLES[role], "content": content}
    if not isinstance(content, list):
        raise _error(f"{where}.content", f"`{where}.content` must be a string or an array of content parts.")
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise _error(at, f"`{at}` must be a content part: an object with a string `type`.")
        if kind == "input_image":
            parts.append(_input_image(part, at))
            continue
        if kind not in _TEXT_PARTS:
            raise _error(
                at,
                f"`{at}`: only text and image parts (input_text, output_text, input_image) are supported"
                f" ({kind[:64]!r}).",
                UNSUPPORTED,
            )
        if not isinstance(part.get("text"), str):
            raise _error(f"{at}.text", f"`{at}.text` must be a string.")
        parts.append({"type": "text", "text": part["text"]})
    return {"role": _ROLES[role], "content": parts}


def _input_image(part: dict[str, Any], at: str) -> dict[str, Any]:
    """An ``input_image`` part as chat's ``image_url`` part (``workers.images`` checks, stores and
    refuses images the same way for both); an image by ``file_id`` is chat's part whose URL is that
    id (``workers.media_files`` reads it at validation, which then drops the ``file_id``)."""
    extra = sorted(str(k) for k in set(part) - {"type", "image_url", "detail", "file_id", "refused"})
    if extra:
        raise _error(f"{at}.{extra[0][:64]}", f"Unrecognized field in `{at}`: {extra[0][:64]}")
    url = part.get("image_url")
    file_id = part.get("file_id")
    if file_id is not None:
        if url is not None:
            raise _error(f"{at}.file_id", f"`{at}`: give one of `image_url` and `file_id`, not both.")
        if not isinstance(file_id, str) or not file_id:
            raise _error(f"{at}.file_id", f"`{at}.file_id` must be a non-empty string (a file id).")
        url = file_id
    if not isinstance(url, str) or not url:
        raise _error(
            f"{at}.image_url",
            f"`{at}.image_url` must be a non-empty string (a data: URL or a link), or `file_id` given.",
        )
    if part.get("detail", "auto") not in ("auto", "low", "high"):
        raise _error(f"{at}.detail", f"`{at}.detail` must be auto, low or high.")
    chat: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    if "refused" in part:  # validation refused the image: the line's error when it runs
        chat["refused"] = part["refused"]
    return chat


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str) or (name != "arguments" and not item[name]):
            raise _error(f"{where}.{name}", f"`{where}.{name}` must be a non-empty string.")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str) or not item["call_id"]:
        raise _error(f"{where}.call_id", f"`{where}.call_id` must be a non-empty string.")
    output = item.get("output")
    if isinstance(output, list):
        raise _error(
            f"{where}.output", f"`{where}.output`: only text outputs (a string) are supported.", UNSUPPORTED
        )
    if not isinstance(output, str):
        raise _error(f"{where}.output", f"`{where}.output` must be a string.")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def _text_format(text: Any) -> dict[str, Any] | None:
    """`text` -> chat's `response_format` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _error("text", '`text` must be an object such as {"format": {"type": "json_object"}}.')
    extra = sorted(str(k) for k in set(text) - {"format", "verbosity"})
    if extra:
        raise _error(f"text.{extra[0][:64]}", f"Unrecognized field in `text`: {extra[0][:64]}")
    if text.get("verbosity") is not None:
        raise _error(
            "text.verbosity",
            "`text.verbosity` is not supported: the model's own length is kept; bound it with max_output_tokens.",
            UNSUPPORTED,
        )
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise _error("text.format.type", "`text.format.type` must be text, json_object or json_schema.")
    assert isinstance(fmt, dict)
    name, schema = fmt.get("name"), fmt.get("schema")
    if not isinstance(name, str) or not name:
        raise _error("text.format.name", "`text.format.name` must be a non-empty string.")
    if not isinstance(schema, dict):
        raise _error("text.format.schema", "`text.format.schema` must be a JSON schema object.")
    extra = sorted(str(k) for k in set(fmt) - {"type", "name", "schema", "strict", "description"})
    if extra:
        raise _error(f"text.format.{extra[0][:64]}", f"Unrecognized field in `text.format`: {extra[0][:64]}")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": spec}


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools -> chat's nested ones."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _error(
            "tools", '`tools` must be an array of {"type": "function", "name": ..., "parameters": {...}}.'
        )
    chat = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise _error(where, f"`{where}` must be an object.")
        kind = tool.get("type")
        if kind != "function":
            if isinstance(kind, str):
                raise _error(
                    f"{where}.type",
                    f"`{where}`: {kind[:64]!r} tools are not available in batches; only function tools are.",
                    UNSUPPORTED,
                )
            raise _error(f"{where}.type", f'`{where}.type` must be "function".')
        refused = sorted(k for k in _TOOL_KEYS_REFUSED if tool.get(k) is not None)
        if refused:
            raise _error(f"{where}.{refused[0]}", f"`{where}.{refused[0]}` is not supported.", UNSUPPORTED)
        extra = sorted(str(k) for k in set(tool) - _TOOL_KEYS - _TOOL_KEYS_REFUSED)
        if extra:
            raise _error(f"{where}.{extra[0][:64]}", f"Unrecognized field in `{where}`: {extra[0][:64]}")
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None
        }
        chat.append({"type": "function", "function": function})
    return chat


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "required", "none"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str) or not choice["name"]:
            raise _error("tool_choice.name", "`tool_choice.name` must be a non-empty string.")
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and isinstance(choice.get("type"), str):
        raise _error(
            "tool_choice",
            f"`tool_choice` of type {choice['type'][:64]!r} is not supported; only function tools are.",
            UNSUPPORTED,
        )
    raise _error(
        "tool_choice",
        '`tool_choice` must be "none", "auto", "required" or {"type": "function", "name": ...}.',
    )


def _reasoning(value: Any, served: bool) -> str | None:
    """`reasoning` -> chat's `reasoning_effort` (None: not asked for)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _error("reasoning", "`reasoning` must be an object.")
    extra = sorted(str(k) for k in set(value) - {"effort", "summary", "generate_summary"})
    if extra:
        raise _error(f"reasoning.{extra[0][:64]}", f"Unrecognized field in `reasoning`: {extra[0][:64]}")
    if not any(v is not None for v in value.values()):
        return None
    if not served:
        raise _error(
            "reasoning",
            "`reasoning` is not supported on this model: its registry entry reads no reasoning back "
            "(it names no reasoning_parser engine arg: `freight models set-engine`).",
            UNSUPPORTED,
        )
    for name in ("summary", "generate_summary"):
        if value.get(name) is not None:
            raise _error(
                f"reasoning.{name}",
                f"`reasoning.{name}` is not supported: the reasoning text itself is returned, not a summary.",
                UNSUPPORTED,
            )
    return value.get("effort")


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > _METADATA_KEYS:
        raise _error("metadata", f"`metadata` must be an object of at most {_METADATA_KEYS} string values.")
    for key, value in metadata.items():
        if len(key) > _METADATA_KEY_CHARS or not isinstance(value, str) or len(value) > _METADATA_VALUE_CHARS:
            raise _error(
                "metadata",
                f"`metadata` keys are at most {_METADATA_KEY_CHARS} characters and its values strings "
                f"of at most {_METADATA_VALUE_CHARS}.",
            )


def prompt_chat_body(body: dict[str, Any]) -> dict[str, Any] | None:
    """The chat body whose prompt the engine will render for this Responses body (validation
    tokenizes it and orders by it); None when the body cannot be translated (it never runs)."""
    try:
        return to_chat(body, reasoning=True).chat
    except (RequestError, TypeError, ValueError, AttributeError):
        return None


# --------------------------------------------------------------------------- response


def response_from_chat(
    chat: dict[str, Any], echo: dict[str, Any], reasoning_tokens: int = 0
) -> dict[str, Any]:
    """A `chat.completion` body (one choice, as vLLM dumps it) -> the Response object OpenAI's
    Responses API returns for the same request. A length-cut answer is `incomplete` with reason
    `max_output_tokens`; `reasoning_tokens` counts the reasoning text split out (0 without)."""
    choice = chat["choices"][0]
    message = choice.get("message") or {}
    cut = choice.get("finish_reason") == "length"
    status = "incomplete" if cut else "completed"
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        output.append(
            {
                "type": "reasoning",
                "id": _new_id("rs"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}],
                "status": status,
            }
        )
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if content is not None and (content or not calls):
        output.append(
            {
                "type": "message",
                "id": _new_id("msg"),
                "status": status,
                "role": "assistant",
                "content": [{"type": "output_text", "text": content, "annotations": []}],
            }
        )
    for call in calls:
        function = call["function"]
        output.append(
            {
                "type": "function_call",
                "id": _new_id("fc"),
                "call_id": call["id"],
                "name": function["name"],
                "arguments": function["arguments"],
                "status": "completed",
            }
        )
    usage = chat.get("usage") or {}
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "id": _new_id("resp"),
        "object": "response",
        "created_at": chat.get("created"),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "model": chat.get("model"),
        "output": output,
        "usage": {
            "input_tokens": prompt,
            # Freight does not count prefix-cache writes (vLLM reports hits only)
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + completion,
        },
        "instructions": echo.get("instructions"),
        "max_output_tokens": echo.get("max_output_tokens"),
        "temperature": echo.get("temperature"),
        "top_p": echo.get("top_p"),
        "text": echo.get("text") or {"format": {"type": "text"}},
        "tools": echo.get("tools") or [],
        "tool_choice": echo.get("tool_choice", "auto"),
        "parallel_tool_calls": echo.get("parallel_tool_calls", True),
        "metadata": echo.get("metadata") or {},
        "reasoning": echo.get("reasoning"),
        "user": echo.get("user"),
        "safety_identifier": echo.get("safety_identifier"),
        "previous_response_id": None,
        "background": False,
        "store": False,
        "truncation": "disabled",
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
