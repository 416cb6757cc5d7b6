"""workers/plain_chat_body.py: a plain chat line's body, made from a skeleton, is byte for byte
the body vLLM's response models dump (`workers.rendering._chat_response`), and lines it cannot make
still go through the models."""

from __future__ import annotations

import json
from typing import Any

import pytest

from workers import rendering
from workers.request_bodies import parse_body

CHAT = "/v1/chat/completions"


def _output(texts: list[tuple[str, str | None, Any]], cached: int | None, prompt: list[int]) -> Any:
    from vllm.outputs import CompletionOutput, RequestOutput

    answers = [
        CompletionOutput(
            i, text, list(range(len(text.split()) + 1)), None, None, finish_reason=finish, stop_reason=stop
        )
        for i, (text, finish, stop) in reversed(list(enumerate(texts)))  # out of index order
    ]
    return RequestOutput("r1", None, prompt, None, answers, True, num_cached_tokens=cached)


def _models_body(rendered: Any, output: Any) -> dict:
    """What build_response_body made for every line before the skeleton: vLLM's models, dumped."""
    from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

    prompt = list(output.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in output.outputs)
    usage = UsageInfo(
        prompt_tokens=len(prompt),
        completion_tokens=completion,
        total_tokens=len(prompt) + completion,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=int(output.num_cached_tokens or 0)),
    )
    response = rendering._chat_response(rendered, output, "demo", None, 1700000000, usage, None)
    return response.model_dump()


@pytest.mark.parametrize(
    ("body", "texts", "cached"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, [("Hello there.", "stop", None)], 0),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, [("Hel", "length", None)], None),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 3},
         [("a", "stop", 7), ("", "length", None), ("ü ✓ \n\"q\"", "stop", "</s>")], 96),
        ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "Par"}],
          "add_generation_prompt": False, "continue_final_message": True}, [("tial", None, None)], 32),
        ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "none",
          "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
         [("no call", "stop", None)], 0),
    ],
)  # fmt: skip
def test_a_plain_lines_body_is_the_models_dump_byte_for_byte(
    body: dict, texts: list, cached: int | None
) -> None:
    from vllm.sampling_params import SamplingParams

    parsed = parse_body(CHAT, {"model": "demo", **body})
    prompt = [5, 6, 7, 8]
    rendered = rendering.RenderedRequest(parsed, {}, prompt, SamplingParams())
    output = _output(texts, cached, prompt)
    made = rendering._plain_chat(rendered, output, "demo", 1700000000, None, len(prompt),
                                 sum(len(c.token_ids) for c in output.outputs))  # fmt: skip
    assert made is not None
    assert json.dumps(made) == json.dumps(_models_body(rendered, _output(texts, cached, prompt)))
    built = rendering.build_response_body(rendered, output, model="demo", created=1700000000)
    assert json.dumps(built) == json.dumps(made)


@pytest.mark.parametrize(
    "fields",
    [
        {"logprobs": True, "top_logprobs": 2},
        {"echo": True},
        {"return_token_ids": True},
        {"tool_choice": "required",
         "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
    ],
)  # fmt: skip
def test_lines_the_skeleton_cannot_make_go_through_the_models(fields: dict) -> None:
    from vllm.sampling_params import SamplingParams

    parsed = parse_body(CHAT, {"model": "demo", "messages": [{"role": "user", "content": "hi"}], **fields})
    prompt = [5, 6, 7]
    rendered = rendering.RenderedRequest(parsed, {}, prompt, SamplingParams())
    output = _output([("[]", "stop", None)], 0, prompt)
    assert rendering._plain_chat(rendered, output, "demo", 1, None, 3, 1) is None


def test_each_line_gets_bodies_of_its_own() -> None:
    """The skeleton is shared; no body made from it shares a mutable part with another."""
    from workers.plain_chat_body import plain_chat_body

    first = plain_chat_body("a", 1, "demo", "assistant", [(0, "x", "stop", None)], 3, 1, 0)
    second = plain_chat_body("b", 2, "demo", "assistant", [(0, "y", "stop", None)], 4, 2, 1)
    assert first is not None and second is not None
    first["choices"][0]["message"]["content"] = "changed"
    first["usage"]["prompt_tokens_details"]["cached_tokens"] = 99
    assert second["choices"][0]["message"]["content"] == "y"
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 1
    assert (second["id"], second["usage"]["total_tokens"]) == ("chatcmpl-b", 6)
