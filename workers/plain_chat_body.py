"""The `chat.completion` body of a plain chat answer, without vLLM's response models per line.

`workers.rendering.build_response_body` builds a body with vLLM's pydantic response models and
dumps it as `vllm serve` does. On the engine worker's thread that costs some 40 microseconds a
line under load (21 of the engine thread's 1,185 py-spy samples over 5,000 two-token lines on the
2-core CPU host): time the engine's steps wait for. Most lines of a batch are plain: each choice
is the text as generated, with no tool calls, parser, logprobs, echo or token ids. Their body is
the dump of a skeleton response, made once per process with vLLM's own models (so every field
its version adds is there, in its order, with its default), with the line's values put in.

The skeleton is used only if every value not put in is a scalar (nothing a caller could mutate
for the next line); else `plain_chat_body` returns None and the models build the body.
`tests/workers/test_plain_chat_body.py` checks the bodies equal the models' dump byte for byte.
"""

from __future__ import annotations

from functools import cache
from typing import Any

# (index, content, finish_reason, stop_reason) of one choice
Choice = tuple[int, str, str, "int | str | None"]

_SCALARS = (type(None), str, int, float, bool)
# the fields put in per line, by level: the rest keep the skeleton's dumped values
_BODY_FIELDS = {"id", "created", "model", "choices", "usage"}
_CHOICE_FIELDS = {"index", "message", "finish_reason", "stop_reason"}
_MESSAGE_FIELDS = {"role", "content"}
_USAGE_FIELDS = {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
_DETAILS_FIELDS = {"cached_tokens"}


@cache
def _skeleton() -> tuple[dict[str, Any], ...] | None:
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

    usage = UsageInfo(
        prompt_tokens=1,
        completion_tokens=1,
        total_tokens=2,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=0),
    )
    choice = ChatCompletionResponseChoice(
        index=0,
        message=ChatMessage(role="assistant", content=""),
        logprobs=None,
        finish_reason="stop",
        stop_reason=None,
        token_ids=None,
    )
    body = ChatCompletionResponse(
        id="chatcmpl-", created=0, model="", choices=[choice], usage=usage, prompt_logprobs=None,
        prompt_token_ids=None,
    ).model_dump()  # fmt: skip
    parts = (
        (body, _BODY_FIELDS),
        (body["choices"][0], _CHOICE_FIELDS),
        (body["choices"][0]["message"], _MESSAGE_FIELDS),
        (body["usage"], _USAGE_FIELDS),
        (body["usage"]["prompt_tokens_details"], _DETAILS_FIELDS),
    )
    for part, filled in parts:
        if not filled <= part.keys():
            return None
        if any(not isinstance(v, _SCALARS) for k, v in part.items() if k not in filled):
            return None
    return tuple(part for part, _ in parts)


def plain_chat_body(
    request_id: str,
    created: int,
    model: str,
    role: str,
    choices: list[Choice],
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
) -> dict[str, Any] | None:
    """The body vLLM's models dump for these values (see the module docstring); None if its
    skeleton cannot be used."""
    skeleton = _skeleton()
    if skeleton is None:
        return None
    body, choice, message, usage, details = skeleton
    return {
        **body,
        "id": f"chatcmpl-{request_id}",
        "created": created,
        "model": model,
        "choices": [
            {
                **choice,
                "index": index,
                "message": {**message, "role": role, "content": content},
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
            for index, content, finish_reason, stop_reason in choices
        ],
        "usage": {
            **usage,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {**details, "cached_tokens": cached_tokens},
        },
    }
