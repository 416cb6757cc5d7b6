"""Parsed requests -> engine inputs, and engine outputs -> OpenAI response bodies (the engine stage).

`render_request` turns a `ParsedRequest` (from `workers.request_bodies`) into prompt token ids and
`SamplingParams` with the engine's renderer, exactly as `vllm serve` renders them;
`build_response_body` turns a finished `RequestOutput` into the body `vllm serve` would return
(`chat.completion` / `text_completion`), always with `usage.prompt_tokens_details.cached_tokens`,
or for a `/v1/responses` line the Response object of that chat body (`workers.responses`).
Tool calls (forced through structured outputs, or read by the model's parser) are
`workers.tool_calls`'; this module applies them to the request and to each chat choice.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from workers.output_text import answer_text, decodes_at_end
from workers.plain_chat_body import plain_chat_body
from workers.request_bodies import ParsedRequest, RequestError, clip_message, sampling_params_of
from workers.responses import response_from_chat
from workers.tool_calls import NONE as NO_TOOLS
from workers.tool_calls import ModelParsers, choice_kind, shape_choice

if TYPE_CHECKING:  # vLLM is imported lazily: importing it costs seconds.
    from vllm.outputs import RequestOutput
    from vllm.renderers import BaseRenderer
    from vllm.sampling_params import SamplingParams

    from workers.request_shapes import ParsedShapes


@dataclass(frozen=True)
class RenderedRequest:
    """What the engine needs to run one request: prompt, sampling params, echo text."""

    parsed: ParsedRequest
    engine_input: dict[str, Any]
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    echo_text: str | None = None


# --------------------------------------------------------------------------- rendering


def render_request(
    parsed: ParsedRequest,
    renderer: BaseRenderer,
    *,
    default_max_tokens: int | None = None,
    default_sampling_params: dict | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    parsers: ModelParsers | None = None,
    shapes: ParsedShapes | None = None,
    decode_at_end: bool = False,
) -> RenderedRequest:
    """Prompt token ids (chat template or completion prompt) and SamplingParams for one request.

    `renderer` is the engine's vLLM renderer (tokenizer + model config), so chat prompts
    are rendered exactly as `vllm serve` renders them. `default_sampling_params` are the
    model's generation-config defaults (`ModelConfig.get_diff_sampling_param()`).
    The output budget is the body's max_tokens (or max_completion_tokens), else
    `default_max_tokens`, else the generation config's, capped by the context left.
    `prompt_token_ids`, when validation rendered the prompt already, are used as the prompt
    (through the same length checks) instead of rendering it again; chat `echo` still renders.
    `parsers`, the model's tool-call parser, adjust chat requests as `vllm serve` adjusts them.
    `shapes`, the engine's parse cache, shares SamplingParams between lines of one shape.
    `decode_at_end`: the engine's tokenizer can decode an answer whole when it finishes
    (`workers.output_text`): vLLM's per-token decoding is turned off where that gives the same text.
    """
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
    from vllm.exceptions import VLLMValidationError
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    request = parsed.request
    model_config = renderer.model_config
    max_model_len = model_config.max_model_len
    defaults = dict(default_sampling_params or {})
    if default_max_tokens is not None:
        defaults["max_tokens"] = default_max_tokens
    extras = {"cache_salt": request.cache_salt} if request.cache_salt is not None else None
    echo_text = None
    try:
        tok_params = request.build_tok_params(model_config)
        if prompt_token_ids is not None and not (parsed.is_chat and request.echo):
            tokens = parse_model_prompt(model_config, list(prompt_token_ids))
            if parsed.is_chat:
                _with_images(tokens, request.messages)
            (engine_input,) = renderer.render_cmpl([tokens], tok_params, prompt_extras=extras)
        elif parsed.is_chat:
            tools = None if request.tools is None else [tool.model_dump() for tool in request.tools]
            chat_params = request.build_chat_params(None, "auto").with_defaults(
                {"tools": tools, "tokenize": False}
            )
            (conversation,), (engine_input,) = renderer.render_chat(
                [request.messages], chat_params, tok_params, prompt_extras=extras
            )
            if request.echo:
                echo_text = _chat_echo_text(request, conversation)
        else:
            prompt = parse_model_prompt(model_config, request.prompt)
            (engine_input,) = renderer.render_cmpl([prompt], tok_params, prompt_extras=extras)
    except VLLMValidationError as exc:
        message = clip_message(str(exc.args[0]) if exc.args else str(exc))
        if exc.parameter in ("input_tokens", "input_text"):
            raise RequestError("context_length_exceeded", message, parsed.prompt_param) from None
        raise RequestError("invalid_request", message, exc.parameter) from None
    except (ValueError, TypeError, KeyError, LookupError) as exc:
        raise RequestError("invalid_request", clip_message(f"Could not render the prompt: {exc}")) from None
    except Exception as exc:
        if type(exc).__module__.startswith("jinja2"):
            raise RequestError("invalid_request", clip_message(f"Chat template error: {exc}")) from None
        raise

    prompt_token_ids = list(engine_input.get("prompt_token_ids") or [])
    prompt_len = len(prompt_token_ids)
    if prompt_len >= max_model_len:
        raise RequestError(
            "context_length_exceeded",
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"has {prompt_len} tokens, which leaves no room for output. Please shorten the prompt.",
            parsed.prompt_param,
        )
    try:
        max_tokens = get_max_tokens(
            max_model_len,
            parsed.max_tokens,
            prompt_len,
            defaults,
            None,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
        )
    except ValueError as exc:
        budget = "max_output_tokens" if parsed.responses is not None else "max_tokens"
        raise RequestError("context_length_exceeded", clip_message(str(exc)), budget) from None
    if parsers is not None and parsed.is_chat:
        parsers.adjust(request)
    tokenizer = renderer.tokenizer if decode_at_end else None
    sampling_params = _sampling_params(parsed, max_tokens, defaults, shapes, tokenizer)
    return RenderedRequest(parsed, engine_input, prompt_token_ids, sampling_params, echo_text)


def _with_images(tokens: Any, messages: Any) -> None:
    """A chat prompt's ids with its images (``workers.images.inline_images``' parts, in message
    order, each with its digest as vLLM's ``uuid``): vLLM's processor expands each placeholder token
    of the ids by its image, as it does when it renders the chat itself."""
    images, uuids = [], []
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "image_pil":
                images.append(part["image_pil"])
                uuids.append(part.get("uuid"))
    if images:
        tokens["multi_modal_data"] = {"image": images}
        tokens["multi_modal_uuids"] = {"image": uuids}


def _sampling_params(
    parsed: ParsedRequest, max_tokens: int, defaults: dict, shapes: ParsedShapes | None, tokenizer: Any
) -> SamplingParams:
    """The request's SamplingParams, final output only, decoded at the end where ``tokenizer``
    (None: as vLLM decodes) gives the same text (``workers.output_text``); shared by the lines of
    its shape and budget where ``shapes`` keeps them (``ParsedShapes.sampling_params`` says why
    that is exact: the tokenizer is the engine's, fixed like its defaults)."""
    from vllm.sampling_params import RequestOutputKind

    def build() -> SamplingParams:
        params = sampling_params_of(parsed.request, max_tokens, defaults)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        if decodes_at_end(params, tokenizer):
            params.detokenize = False  # build_response_body decodes each choice whole
        return params

    return build() if shapes is None else shapes.sampling_params(parsed, max_tokens, build)


def _response_role(request: Any) -> str:
    """The role of a chat answer, as vLLM's server gives it: the assistant's, or with no
    generation prompt the role of the last message, which the answer continues."""
    return "assistant" if request.add_generation_prompt else request.messages[-1]["role"]


def _chat_echo_text(request: Any, conversation: list) -> str:
    """vLLM's chat `echo`: the last message's content when its role is the response role."""
    role = _response_role(request)
    if conversation and conversation[-1].get("role") == role:
        content = conversation[-1].get("content") or ""
        if isinstance(content, list):
            return "\n".join(part.get("text", "") for part in content)
        return str(content)
    return ""


# --------------------------------------------------------------------------- responses


def build_response_body(
    rendered: RenderedRequest,
    output: RequestOutput,
    *,
    model: str,
    tokenizer: Any = None,
    created: int | None = None,
    parsers: ModelParsers | None = None,
) -> dict[str, Any]:
    """The `chat.completion` / `text_completion` body `vllm serve` returns for this output.

    Built with vLLM's response models and dumped the way `vllm serve` dumps them;
    `usage.prompt_tokens_details.cached_tokens` is always present (0 without a cache hit).
    """
    from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

    parsed = rendered.parsed
    created = int(time.time()) if created is None else created
    prompt_ids = list(output.prompt_token_ids or rendered.prompt_token_ids)
    params = rendered.sampling_params
    if not params.detokenize and tokenizer is not None:  # vLLM did not decode it: done here, whole
        for choice in output.outputs:
            choice.text = answer_text(
                tokenizer, prompt_ids, choice.token_ids, choice.finish_reason == "stop", params
            )
    completion_tokens = sum(len(choice.token_ids) for choice in output.outputs)
    if parsed.is_chat and parsed.responses is None and output.prompt_logprobs is None:
        plain = _plain_chat(rendered, output, model, created, parsers, len(prompt_ids), completion_tokens)
        if plain is not None:
            return plain
    usage = UsageInfo(
        prompt_tokens=len(prompt_ids),
        completion_tokens=completion_tokens,
        total_tokens=len(prompt_ids) + completion_tokens,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=int(output.num_cached_tokens or 0)),
    )
    prompt_logprobs = _plain_prompt_logprobs(output.prompt_logprobs)
    if parsed.is_chat:
        response = _chat_response(
            rendered, output, model, tokenizer, created, usage, prompt_logprobs, parsers
        )
    else:
        response = _completion_response(rendered, output, model, tokenizer, created, usage, prompt_logprobs)
    # Dumped like vllm serve dumps it: vLLM's extra fields stay, as null when unused.
    body = response.model_dump()
    if parsed.responses is None:
        return body
    reasoning = body["choices"][0]["message"].get("reasoning")  # the text the parser split out
    spent = len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning and tokenizer else 0
    return response_from_chat(body, parsed.responses, reasoning_tokens=spent)


def token_counts(body: dict[str, Any]) -> tuple[int, int, int]:
    """Prompt, cached and completion tokens of a body `build_response_body` made (chat and
    completions usage, or a Response object's)."""
    usage = body["usage"]
    if "input_tokens" in usage:
        cached = usage["input_tokens_details"]["cached_tokens"]
        return int(usage["input_tokens"]), int(cached or 0), int(usage["output_tokens"] or 0)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return int(usage["prompt_tokens"]), int(cached or 0), int(usage["completion_tokens"] or 0)


def _plain_chat(
    rendered: RenderedRequest,
    output: RequestOutput,
    model: str,
    created: int,
    parsers: ModelParsers | None,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any] | None:
    """A chat line whose choices are the text as generated (no parser, tool calls, logprobs, echo
    or token ids): `_chat_response`'s dump, made without the models (workers/plain_chat_body.py)."""
    request = rendered.parsed.request
    if (
        parsers is not None
        or request.logprobs
        or request.echo
        or request.return_token_ids
        or choice_kind(request.tool_choice, bool(request.tools)) != NO_TOOLS
    ):
        return None
    role = _response_role(request)
    choices = [
        (c.index, c.text, c.finish_reason or "stop", c.stop_reason)
        for c in sorted(output.outputs, key=lambda c: c.index)
    ]
    cached = int(output.num_cached_tokens or 0)
    return plain_chat_body(
        request.request_id, created, model, role, choices, prompt_tokens, completion_tokens, cached
    )


def _chat_response(rendered, output, model, tokenizer, created, usage, prompt_logprobs, parsers=None):
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )

    request = rendered.parsed.request
    role = _response_role(request)
    choices = []
    for choice in sorted(output.outputs, key=lambda c: c.index):
        logprobs = None
        if request.logprobs and choice.logprobs is not None:
            logprobs = _chat_logprobs(
                choice.token_ids, choice.logprobs, request.top_logprobs, request, tokenizer
            )
        parser = parsers.new(request) if parsers is not None else None  # stateful: one per choice
        if parser is not None and output.prompt_token_ids is not None:
            parser.set_prompt_token_ids(output.prompt_token_ids)
        shaped = shape_choice(request, choice.text, choice.finish_reason, parser, choice.token_ids)
        content = choice.text if shaped is None else shaped.content
        if request.echo and (shaped is None or not shaped.tool_calls):
            content = (rendered.echo_text or "") + (content or "")
        message = ChatMessage(role=role, content=content)
        if shaped is not None:
            message = ChatMessage(
                role=role, content=content, tool_calls=shaped.tool_calls, reasoning=shaped.reasoning
            )
        choices.append(
            ChatCompletionResponseChoice(
                index=choice.index,
                message=message,
                logprobs=logprobs,
                finish_reason=shaped.finish_reason if shaped is not None else choice.finish_reason or "stop",
                stop_reason=choice.stop_reason,
                token_ids=list(choice.token_ids) if request.return_token_ids else None,
            )
        )
    return ChatCompletionResponse(
        id=f"chatcmpl-{request.request_id}",
        created=created,
        model=model,
        choices=choices,
        usage=usage,
        prompt_logprobs=prompt_logprobs,
        prompt_token_ids=list(output.prompt_token_ids or []) if request.return_token_ids else None,
    )


def _completion_response(rendered, output, model, tokenizer, created, usage, prompt_logprobs):
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice

    request = rendered.parsed.request
    prompt_ids = list(output.prompt_token_ids or rendered.prompt_token_ids)
    prompt_text = output.prompt
    if request.echo and prompt_text is None and tokenizer is not None:
        prompt_text = tokenizer.decode(prompt_ids)
    choices = []
    for choice in sorted(output.outputs, key=lambda c: c.index):
        token_ids: Sequence[int] = choice.token_ids
        step_logprobs = choice.logprobs
        text = choice.text
        if request.echo:
            text = (prompt_text or "") + text
            token_ids = [*prompt_ids, *choice.token_ids]
            if step_logprobs is not None:
                step_logprobs = [*(output.prompt_logprobs or [None] * len(prompt_ids)), *step_logprobs]
        logprobs = None
        if request.logprobs is not None and step_logprobs is not None:
            logprobs = _completion_logprobs(token_ids, step_logprobs, request.logprobs, request, tokenizer)
        choices.append(
            CompletionResponseChoice(
                index=choice.index,
                text=text,
                logprobs=logprobs,
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
                prompt_logprobs=prompt_logprobs,
                prompt_token_ids=prompt_ids if request.return_token_ids else None,
                token_ids=list(choice.token_ids) if request.return_token_ids else None,
            )
        )
    return CompletionResponse(
        id=f"cmpl-{request.request_id}", created=created, model=model, choices=choices, usage=usage
    )


def _token_text(token_id: int, logprob: Any, tokenizer: Any, as_id: bool) -> str:
    if as_id:
        return f"token_id:{token_id}"
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def _chat_logprobs(token_ids, step_logprobs, top_n, request, tokenizer):
    """OpenAI chat logprobs, mirroring OpenAIServingChat._create_chat_logprobs."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionLogProb,
        ChatCompletionLogProbs,
        ChatCompletionLogProbsContent,
    )

    as_id = bool(request.return_tokens_as_token_ids)
    return_all = bool(request.logprob_token_ids)
    content = []
    for i, token_id in enumerate(token_ids):
        step = step_logprobs[i] if i < len(step_logprobs) else None
        if step is None or step.get(token_id) is None:
            token = _token_text(token_id, None, tokenizer, as_id)
            content.append(
                ChatCompletionLogProbsContent(token=token, bytes=list(token.encode("utf-8", "replace")))
            )
            continue
        chosen = step[token_id]
        top = []
        for rank, (tid, lp) in enumerate(step.items()):
            if return_all or top_n == -1 or (top_n is not None and rank < top_n):
                text = _token_text(tid, lp, tokenizer, as_id)
                top.append(
                    ChatCompletionLogProb(
                        token=text,
                        logprob=max(lp.logprob, -9999.0),
                        bytes=list(text.encode("utf-8", "replace")),
                    )
                )
        decoded = chosen.decoded_token
        content.append(
            ChatCompletionLogProbsContent(
                token=_token_text(token_id, chosen, tokenizer, as_id),
                logprob=max(chosen.logprob, -9999.0),
                bytes=None if decoded is None else list(decoded.encode("utf-8", "replace")),
                top_logprobs=top,
            )
        )
    return ChatCompletionLogProbs(content=content)


def _completion_logprobs(token_ids, step_logprobs, top_n, request, tokenizer):
    """OpenAI completions logprobs, mirroring OpenAIServingCompletion._create_completion_logprobs."""
    from vllm.entrypoints.openai.completion.protocol import CompletionLogProbs

    as_id = bool(request.return_tokens_as_token_ids)
    offsets: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []
    last_len = 0
    for i, token_id in enumerate(token_ids):
        step = step_logprobs[i] if i < len(step_logprobs) else None
        if step is None or step.get(token_id) is None:
            token = _token_text(token_id, None, tokenizer, as_id)
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            chosen = step[token_id]
            token = _token_text(token_id, chosen, tokenizer, as_id)
            token_logprobs.append(max(chosen.logprob, -9999.0))
            top_logprobs.append(
                {
                    _token_text(tid, lp, tokenizer, as_id): max(lp.logprob, -9999.0)
                    for rank, (tid, lp) in enumerate(step.items())
                    if request.logprob_token_ids or top_n == -1 or top_n >= rank
                }
            )
        tokens.append(token)
        offsets.append(0 if not offsets else offsets[-1] + last_len)
        last_len = len(token)
    return CompletionLogProbs(
        text_offset=offsets, token_logprobs=token_logprobs, tokens=tokens, top_logprobs=top_logprobs
    )


def _plain_prompt_logprobs(prompt_logprobs: Any) -> list | None:
    """Prompt logprobs as plain lists/dicts with -inf clamped (JSON has no infinity)."""
    if prompt_logprobs is None:
        return None
    from vllm.logprobs import Logprob

    plain: list = []
    for position in prompt_logprobs:
        if position is None:
            plain.append(None)
            continue
        plain.append(
            {
                int(tid): Logprob(
                    logprob=max(lp.logprob, -9999.0), rank=lp.rank, decoded_token=lp.decoded_token
                )
                for tid, lp in position.items()
            }
        )
    return plain
